//! Budgets in money: a priced operation reserves its request's worst case at
//! its price sheet's prices, and settles to the exact price of the usage the
//! upstream reports (in the providers' own field names), on both backends.
//! Concurrent calls never pass a money limit; random prices and usages never
//! drift from the sum of exact costs; a call that cannot be priced is refused
//! with nothing charged; bad money config is refused naming its key.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tollgate_core::{
    clock::SystemClock,
    config::{Config, PriceError},
    id::{RequestId, UserId},
    job::{JobError, JobQueue, JobRequest, JobSource, SubmitOutcome, Taker},
    ledger::Ledger,
};
use tollgate_memory::{jobs::MemoryJobQueue, ledger::MemoryLedger};
use tollgate_tests::{random_prefix, RedisServer};

const SHEET: &str = r#"
currency = "USD"
[models."gpt-4o-mini*"]
input = "0.15"
output = "0.60"
cached_input = "0.075"
max_output = 16384
[models."claude-sonnet*"]
input = "3"
output = "15"
cached_input = "0.30"
cache_write = "3.75"
max_output = 8192
"#;

/// A fresh folder for one test's files.
fn folder() -> PathBuf {
    let d = std::env::temp_dir().join(format!("tollgate-money-{}", random_prefix()));
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

/// A config in USD whose `chat` operation is priced by `sheet` (written in
/// `dir`), with a plan of `limit` USD an hour.
fn config_in(dir: &Path, sheet: &str, limit: &str) -> Arc<Config> {
    std::fs::create_dir_all(dir).expect("mkdir");
    let path = dir.join("prices.toml");
    std::fs::write(&path, sheet).expect("write the sheet");
    let text = format!(
        r#"
currency = "USD"
hold_grace = "200ms"
default_plan = "paid"
[plans.paid]
limit = "{limit}"
window = "1h"
[providers.llm]
rate = 10000
burst = 10000
max_wait = "5s"
prices = "prices.toml"
[operations.chat]
provider = "llm"
"#
    );
    Arc::new(Config::parse_in(&text, "money test", Some(dir)).expect("the money config"))
}

struct Setup {
    queue: Arc<dyn JobQueue>,
    source: Arc<dyn JobSource>,
    ledger: Arc<dyn Ledger>,
    /// A second api pod's queue on the same store (Redis), else the same.
    other: Arc<dyn JobQueue>,
    _server: Option<RedisServer>,
}

impl Setup {
    fn memory(config: Arc<Config>) -> Self {
        let ledger: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Arc::clone(&config)));
        let q = Arc::new(MemoryJobQueue::with_clock(
            config,
            Arc::clone(&ledger),
            Arc::new(SystemClock),
            crate::jobs::options(),
        ));
        Self {
            queue: q.clone(),
            source: q.clone(),
            other: q,
            ledger,
            _server: None,
        }
    }

    async fn redis(config: Arc<Config>) -> Self {
        let server = RedisServer::start();
        let prefix = random_prefix();
        let (q, ledger) = crate::jobs::redis_queue(&server, &prefix, Arc::clone(&config)).await;
        let (other, _) = crate::jobs::redis_queue(&server, &prefix, config).await;
        Self {
            queue: q.clone(),
            source: q,
            other,
            ledger,
            _server: Some(server),
        }
    }

    async fn used(&self, who: &str) -> u64 {
        self.ledger.usage(&user(who)).await.expect("usage").used
    }

    /// Takes the next `chat` job, settles it to `answer` and completes it.
    async fn run(&self, answer: &Value) -> u64 {
        let lease = self
            .source
            .take(
                "chat",
                Taker::new("w", Duration::from_secs(2), Duration::from_secs(5)),
            )
            .await
            .expect("take")
            .expect("a job within 2 s");
        assert!(self.source.start(&lease).await.expect("start"));
        // As a worker does: the settled charge is recorded with the result.
        let charged = match self.source.settle(&lease, answer).await.expect("settle") {
            tollgate_core::job::Settled::To { cost, .. } => Some(cost),
            _ => None,
        };
        self.source
            .complete_with(&lease, answer.clone(), None, charged)
            .await
            .expect("complete");
        lease.job.cost
    }
}

fn user(s: &str) -> UserId {
    UserId::new(s).expect("user")
}

fn request(id: &str, who: &str, input: Value) -> JobRequest {
    JobRequest {
        id: RequestId::new(id).expect("id"),
        user: user(who),
        operation: "chat".into(),
        input,
        trace: None,
        service_key: None,
    }
}

/// A chat request for `model` with a prompt of `chars` characters.
fn chat(model: &str, chars: usize, max_tokens: u64) -> Value {
    json!({
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "x".repeat(chars)}],
    })
}

async fn submit(s: &dyn JobQueue, id: &str, who: &str, input: Value) -> Option<u64> {
    match s.submit(request(id, who, input)).await.expect("submit") {
        SubmitOutcome::Queued { job, .. } => Some(job.cost),
        SubmitOutcome::Denied { .. } => None,
        other => panic!("{other:?}"),
    }
}

/// `ceil(pico / 10^6)`: picodollars to the micro-dollars charged.
fn micro(pico: u128) -> u64 {
    pico.div_ceil(1_000_000) as u64
}

async fn priced_calls_pay_exactly_their_usage(s: &Setup) {
    // OpenAI Chat Completions: cached tokens are part of prompt_tokens,
    // reasoning tokens part of completion_tokens; each is priced once.
    let input = chat("gpt-4o-mini-2024-07-18", 5_000, 600);
    let bytes = input.to_string().len() as u128;
    let reserve = submit(&*s.queue, "o1", "ann", input).await.expect("queued");
    assert_eq!(reserve, micro(bytes * 150_000 + 600 * 600_000));
    assert_eq!(s.used("ann").await, reserve);
    let answer = json!({"usage": {
        "prompt_tokens": 1234, "completion_tokens": 567, "total_tokens": 1801,
        "prompt_tokens_details": {"cached_tokens": 1000},
        "completion_tokens_details": {"reasoning_tokens": 100},
    }});
    s.run(&answer).await;
    // 234 × 0.15 + 1000 × 0.075 + 467 × 0.60 + 100 × 0.60 per million:
    // 450.3 micro-dollars, rounded up once.
    let openai = micro(234 * 150_000 + 1000 * 75_000 + 467 * 600_000 + 100 * 600_000);
    assert_eq!(openai, 451);
    assert_eq!(s.used("ann").await, openai);
    // Its record says what it was charged, beside what was reserved.
    let info = s
        .queue
        .status(&user("ann"), &RequestId::new("o1").expect("id"))
        .await
        .expect("status")
        .expect("the job");
    assert_eq!((info.job.charged, info.job.cost), (Some(openai), reserve));

    // Anthropic: cache reads and writes are beside input_tokens, not in it.
    submit(&*s.queue, "a1", "ann", chat("claude-sonnet-4", 3_000, 100))
        .await
        .expect("queued");
    let answer = json!({"usage": {"input_tokens": 100, "output_tokens": 50,
        "cache_read_input_tokens": 2000, "cache_creation_input_tokens": 500}});
    s.run(&answer).await;
    let anthropic = micro(100 * 3_000_000 + 2000 * 300_000 + 500 * 3_750_000 + 50 * 15_000_000);
    assert_eq!(anthropic, 3_525);
    assert_eq!(s.used("ann").await, openai + anthropic);

    // The Responses API's names.
    submit(&*s.queue, "r1", "ann", chat("gpt-4o-mini", 1_000, 100))
        .await
        .expect("queued");
    let answer = json!({"usage": {"input_tokens": 700, "output_tokens": 80,
        "input_tokens_details": {"cached_tokens": 200},
        "output_tokens_details": {"reasoning_tokens": 30}}});
    s.run(&answer).await;
    let responses = micro(500 * 150_000 + 200 * 75_000 + 50 * 600_000 + 30 * 600_000);
    assert_eq!(s.used("ann").await, openai + anthropic + responses);

    // No usage reported: the call keeps its reservation, never less.
    let reserve = submit(&*s.queue, "n1", "ann", chat("gpt-4o-mini", 100, 50))
        .await
        .expect("queued");
    s.run(&json!({"choices": []})).await;
    assert_eq!(
        s.used("ann").await,
        openai + anthropic + responses + reserve
    );

    // The spend rollups count each call under the sheet entry that priced
    // it (never the raw model named), its operation and provider, settled.
    let now = tollgate_core::clock::Clock::now_ms(&tollgate_core::clock::SystemClock);
    let day = tollgate_core::spend::DAY_MS;
    let mut by_model = std::collections::BTreeMap::new();
    for b in s
        .ledger
        .spend(
            &user("ann"),
            tollgate_core::spend::Step::Day,
            now - day,
            now + day,
        )
        .await
        .expect("spend")
    {
        assert_eq!(
            (b.dims.operation.as_str(), b.dims.provider.as_str()),
            ("chat", "llm")
        );
        *by_model.entry(b.dims.model).or_insert(0) += b.amount;
    }
    let expected = std::collections::BTreeMap::from([
        ("claude-sonnet*".to_owned(), anthropic),
        ("gpt-4o-mini*".to_owned(), openai + responses + reserve),
    ]);
    assert_eq!(by_model, expected);
}

async fn a_call_that_cannot_be_priced_is_refused_and_charges_nothing(s: &Setup) {
    let cases = [
        (
            json!({"model": "o1-preview", "max_tokens": 5}),
            "o1-preview",
        ),
        (json!({"max_tokens": 5}), "/model"),
        (json!({"model": 7, "max_tokens": 5}), "/model"),
    ];
    for (i, (input, named)) in cases.into_iter().enumerate() {
        let e = s
            .queue
            .submit(request(&format!("u{i}"), "bea", input))
            .await
            .expect_err("refused");
        assert!(
            matches!(
                &e,
                JobError::Unpriced(PriceError::Unpriced(_) | PriceError::Model(_))
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains(named), "{e}");
    }
    assert_eq!(s.used("bea").await, 0);
    assert!(s
        .queue
        .status(&user("bea"), &RequestId::new("u0").expect("id"))
        .await
        .expect("status")
        .is_none());
}

/// 100 calls at once, half through each api pod, against a 1 USD limit:
/// the reservations never pass it, and once settled the total is exactly
/// the sum of each call's price × usage.
async fn concurrent_calls_never_pass_a_money_limit(s: &Setup) {
    // Each reserves its worst case: 1,000 output tokens at 15 USD/M
    // (15,000 µUSD) plus its input bytes at 3.75 USD/M: ~60 fit in 1 USD.
    let calls: Vec<_> = (0..100)
        .map(|i| {
            let q = if i % 2 == 0 {
                Arc::clone(&s.queue)
            } else {
                Arc::clone(&s.other)
            };
            tokio::spawn(async move {
                submit(
                    &*q,
                    &format!("c{i}"),
                    "cy",
                    chat("claude-sonnet-4", 200, 1_000),
                )
                .await
            })
        })
        .collect();
    let mut reserved = Vec::new();
    for c in calls {
        if let Some(cost) = c.await.expect("task") {
            reserved.push(cost);
        }
    }
    let total: u64 = reserved.iter().sum();
    assert!(total <= 1_000_000, "{total} µUSD reserved of 1 USD");
    assert!(
        reserved.len() >= 50 && reserved.len() < 100,
        "{} admitted",
        reserved.len()
    );
    assert_eq!(s.used("cy").await, total);
    // One more is refused, saying what it needed, in USD.
    match s
        .queue
        .submit(request("c-more", "cy", chat("claude-sonnet-4", 200, 1_000)))
        .await
        .expect("submit")
    {
        SubmitOutcome::Denied { denied } => {
            assert_eq!(denied.needed, reserved[0], "{denied:?}");
            assert_eq!(denied.currency.to_string(), "USD");
        }
        other => panic!("{other:?}"),
    }
    let mut exact = 0;
    for i in 0..reserved.len() as u128 {
        let (input, output) = (10 + i, 1 + i * 7);
        let answer =
            json!({"usage": {"input_tokens": input as u64, "output_tokens": output as u64}});
        s.run(&answer).await;
        exact += micro(input * 3_000_000 + output * 15_000_000);
    }
    assert_eq!(s.used("cy").await, exact);
    assert!(exact < total, "settled below the reservations");
}

/// xorshift64*: a small deterministic generator for the property test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A price per million tokens with up to 6 decimals: (text, picodollars).
    fn price(&mut self) -> (String, u128) {
        let micro = self.below(20_000_000);
        (
            format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000),
            u128::from(micro),
        )
    }
}

/// Random sheets and usages, with refunds between: the budget's used is
/// always the sum of the exact costs of the calls that stand.
async fn random_prices_and_usages_never_drift(dir: &Path, redis: bool) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ u64::from(redis));
    for round in 0..4 {
        let (input, pi) = rng.price();
        let (output, po) = rng.price();
        let (cached, pc) = rng.price();
        let sheet = format!(
            "currency = \"USD\"\n[default]\ninput = \"{input}\"\noutput = \"{output}\"\n\
             cached_input = \"{cached}\"\nmax_output = 4096\n"
        );
        let config = config_in(&dir.join(format!("r{round}")), &sheet, "1000000");
        let s = if redis {
            Setup::redis(config).await
        } else {
            Setup::memory(config)
        };
        let mut standing: Vec<(String, u64)> = Vec::new();
        for call in 0..12 {
            let id = format!("p{round}-{call}");
            submit(&*s.queue, &id, "pat", chat("any-model", 3_000, 4_000))
                .await
                .expect("queued");
            let (prompt, cached_n, completion) = (
                u128::from(rng.below(2_000)),
                0,
                u128::from(rng.below(4_000)),
            );
            let cached_n = if rng.below(2) == 0 {
                cached_n
            } else {
                prompt / 3
            };
            let answer = json!({"usage": {"prompt_tokens": prompt as u64,
                "completion_tokens": completion as u64,
                "prompt_tokens_details": {"cached_tokens": cached_n as u64}}});
            s.run(&answer).await;
            let cost = micro((prompt - cached_n) * pi + cached_n * pc + completion * po);
            standing.push((id, cost));
            if rng.below(4) == 0 {
                let (gone, _) = standing.remove(rng.below(standing.len() as u64) as usize);
                let outcome = tollgate_core::refund::operator_refund(
                    &*s.ledger,
                    &*s.queue,
                    &user("pat"),
                    &RequestId::new(&gone).expect("id"),
                )
                .await
                .expect("refund");
                assert!(
                    matches!(
                        outcome,
                        tollgate_core::ledger::RefundOutcome::Refunded { .. }
                    ),
                    "{gone}: {outcome:?}"
                );
            }
            let want: u64 = standing.iter().map(|(_, c)| c).sum();
            assert_eq!(s.used("pat").await, want, "round {round} call {call}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_priced_calls_pay_exactly_their_usage() {
    let s = Setup::memory(config_in(&folder(), SHEET, "1"));
    priced_calls_pay_exactly_their_usage(&s).await;
    a_call_that_cannot_be_priced_is_refused_and_charges_nothing(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_priced_calls_pay_exactly_their_usage() {
    let s = Setup::redis(config_in(&folder(), SHEET, "1")).await;
    priced_calls_pay_exactly_their_usage(&s).await;
    a_call_that_cannot_be_priced_is_refused_and_charges_nothing(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_concurrent_calls_never_pass_a_money_limit() {
    concurrent_calls_never_pass_a_money_limit(&Setup::memory(config_in(&folder(), SHEET, "1")))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_concurrent_calls_never_pass_a_money_limit() {
    let s = Setup::redis(config_in(&folder(), SHEET, "1")).await;
    concurrent_calls_never_pass_a_money_limit(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_random_prices_and_usages_never_drift() {
    random_prices_and_usages_never_drift(&folder(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_random_prices_and_usages_never_drift() {
    random_prices_and_usages_never_drift(&folder(), true).await;
}

/// A call reserved before a price change settles at the prices it was
/// reserved at; a call reserved after pays the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_sheet_prices_new_calls_and_spares_reserved_ones() {
    let dir = folder();
    let config = config_in(&dir, SHEET, "1");
    let s = Setup::memory(Arc::clone(&config));
    submit(&*s.queue, "before", "dan", chat("gpt-4o-mini", 2_000, 100))
        .await
        .expect("queued");
    std::fs::write(
        dir.join("prices.toml"),
        SHEET.replace("\"0.15\"", "\"0.30\""),
    )
    .expect("write");
    let reloaded: Vec<bool> = config
        .price_sheets()
        .map(|p| p.reload().expect("reloads"))
        .collect();
    assert_eq!(reloaded, [true]);
    let usage = json!({"usage": {"prompt_tokens": 1000, "completion_tokens": 10}});
    s.run(&usage).await;
    let old = micro(1000 * 150_000 + 10 * 600_000);
    assert_eq!(s.used("dan").await, old);
    submit(&*s.queue, "after", "dan", chat("gpt-4o-mini", 2_000, 100))
        .await
        .expect("queued");
    s.run(&usage).await;
    assert_eq!(
        s.used("dan").await,
        old + micro(1000 * 300_000 + 10 * 600_000)
    );
}

/// Bad money config is refused at start, the message naming the key.
#[test]
fn bad_money_config_is_refused_naming_the_key() {
    let dir = folder();
    let ok = config_in(&dir, SHEET, "20");
    assert_eq!(ok.currency().to_string(), "USD");
    assert_eq!(
        ok.default_plan().limits[0].limit,
        20_000_000,
        "20 USD in µUSD"
    );
    let base = std::fs::read_to_string(dir.join("prices.toml")).expect("sheet");
    assert_eq!(base, SHEET);
    let config = |text: &str| Config::parse_in(text, "t", Some(&dir)).map(|_| ());
    let good = String::from(
        "currency = \"USD\"\n[plans.p]\nlimit = \"20\"\nwindow = \"30d\"\n\
         [providers.llm]\nrate = 1\nburst = 1\nmax_wait = \"1s\"\nprices = \"prices.toml\"\n\
         [operations.chat]\nprovider = \"llm\"\n",
    );
    config(&good).expect("the good config");
    for (from, to, key) in [
        ("currency = \"USD\"", "currency = \"usd\"", "currency"),
        ("currency = \"USD\"", "currency = \"XYZ\"", "currency"),
        ("limit = \"20\"", "limit = \"-1\"", "plans.p.limit"),
        ("limit = \"20\"", "limit = \"0.0000001\"", "plans.p.limit"),
        ("limit = \"20\"", "limit = 20.5", "plans.p.limit"),
        (
            "prices = \"prices.toml\"",
            "prices = \"missing.toml\"",
            "missing.toml",
        ),
        (
            "provider = \"llm\"\n",
            "provider = \"llm\"\ncost = 3\n",
            "operations.chat.cost",
        ),
        (
            "provider = \"llm\"\n",
            "provider = \"llm\"\nmodel = \"\"\n",
            "operations.chat.model",
        ),
        ("currency = \"USD\"\n", "", "providers.llm.prices"),
    ] {
        let text = good.replacen(from, to, 1);
        let e = config(&text).expect_err(&text).to_string();
        assert!(e.contains(key), "{key}: {e}");
    }
    // A sheet with a negative price, one that prices nothing, one in
    // another currency: each refused naming the sheet's key.
    for (sheet, key) in [
        (
            SHEET.replace("\"0.60\"", "\"-0.60\""),
            "models.\"gpt-4o-mini*\".output",
        ),
        ("currency = \"USD\"\n".to_owned(), "models"),
        (
            SHEET.replace("currency = \"USD\"", "currency = \"EUR\""),
            "currency",
        ),
    ] {
        std::fs::write(dir.join("bad.toml"), &sheet).expect("write");
        let text = good.replace("prices.toml", "bad.toml");
        let e = config(&text).expect_err(&sheet).to_string();
        assert!(e.contains(key), "{key}: {e}");
        assert!(e.contains("bad.toml"), "names the file: {e}");
    }
}

/// The example sheet the docs point at is a valid sheet.
#[test]
fn the_example_sheet_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/prices.toml");
    let usd = tollgate_core::money::Currency::parse("USD").expect("USD");
    let sheet = tollgate_core::price::PriceSheet::load(&path, usd).expect("the example sheet");
    let mini = sheet.entry("gpt-4o-mini-2024-07-18").expect("priced");
    assert_eq!((mini.input, mini.output), (150_000, 600_000));
    assert_eq!(sheet.entry("gpt-4o").map(|e| e.output), Some(10_000_000));
    assert!(sheet.entry("unknown-model").is_none());
}
