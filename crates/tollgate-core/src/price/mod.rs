//! What a call costs in money: a [`PriceSheet`] of per-model prices, the
//! [`Usage`] an answer reports, an [`Entry`]'s exact [`Entry::cost`] of it and
//! its worst case, [`Entry::reserve`], charged before the call.
//!
//! Prices are integers too, in millionths of the currency's minor unit: a
//! pico-unit for money (a micro-dollar per million tokens is a pico-dollar per
//! token), a micro-token for [`crate::money::Currency::Tokens`]. So "0.15" USD
//! per million tokens is 150,000 per token, and "1000000" tokens per million
//! tokens is 1,000,000 (one budget token per token). A call's cost is summed
//! exactly in `u128` and **rounded up once**, to the minor unit (the
//! micro-dollar, the token): never per token kind, so no call is charged more
//! than one minor unit above its exact price, and none less.
//!
//! Each file holds one part, every item is `price::X`: [`PriceSheet`] and its
//! parsing in `sheet.rs`, patterns in `glob.rs`, [`Usage`] in `usage.rs`,
//! [`ModelFrom`] in `model.rs`.

mod applied;
pub(crate) mod glob;
mod model;
mod sheet;
mod usage;

use std::collections::BTreeMap;

pub use applied::Applied;
pub use model::{ModelError, ModelFrom};
pub use sheet::PriceSheet;
pub use usage::Usage;

use crate::money::MAX_AMOUNT;

/// Prices are in `1 / PRICE_PER_MINOR` of the minor unit (pico-dollars for
/// USD, micro-tokens for tokens).
pub const PRICE_PER_MINOR: u64 = 1_000_000;

/// The request fields that bound a call's output tokens: OpenAI Chat
/// Completions (`max_tokens`, `max_completion_tokens`), Anthropic
/// (`max_tokens`), OpenAI Responses (`max_output_tokens`).
pub const OUTPUT_BOUNDS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// The request fields that ask for several completions, each up to the output
/// bound and all billed: OpenAI's `n` (Chat Completions, Completions) and
/// `best_of` (Completions).
pub const CHOICES: [&str; 2] = ["n", "best_of"];

/// What one model costs, from a [`PriceSheet`]. Every price is in
/// [`PRICE_PER_MINOR`]ths of the minor unit, per token (the sheet's price per
/// million tokens), per request or per unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Where the sheet defines it (`models."gpt-4o*"`, `default`), for messages.
    pub key: String,
    /// Per uncached input token.
    pub input: u64,
    /// Per input token read from a cache (default: `input`).
    pub cached_input: u64,
    /// Per input token written to a cache (default: `input`).
    pub cache_write: u64,
    /// Per non-reasoning output token.
    pub output: u64,
    /// Per reasoning output token (default: `output`).
    pub reasoning: u64,
    /// Per request, whatever it used.
    pub request: u64,
    /// The model's output limit in tokens: bounds the reservation of a request
    /// that sets none, or more.
    pub max_output: Option<u64>,
    /// Per unit at a JSON pointer into the answer (`[models.X.units]`).
    pub units: BTreeMap<String, UnitPrice>,
}

/// The price of one kind of unit, and the most of it one call may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitPrice {
    /// Per unit.
    pub price: u64,
    /// The most units one call uses (`[models.X.max_units]`): without it, a
    /// priced unit makes the call's worst case unbounded.
    pub max: Option<u64>,
}

/// Why a call's worst case cannot be known before it is made (the caller
/// answers 422 with the message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    #[error(
        "{entry} prices output tokens, but the request sets no max_tokens (nor \
         max_completion_tokens, max_output_tokens) and the price sheet no max_output: \
         the call's cost has no bound"
    )]
    NoOutputBound { entry: String },
    #[error("{field} must be a whole number, got {value}")]
    BadBound { field: &'static str, value: String },
    #[error(
        "{entry} prices the unit {pointer:?} but sets no max_units for it: the call's cost \
         has no bound"
    )]
    NoUnitBound { entry: String, pointer: String },
}

impl Entry {
    /// Its name or pattern as a label (`gpt-4o*` for `models."gpt-4o*"`,
    /// `default`): what the spend rollups count a call under, bounded by
    /// the sheet.
    pub fn label(&self) -> String {
        match self.key.strip_prefix("models.") {
            Some(k) => k.trim_matches('"').to_owned(),
            None => self.key.clone(),
        }
    }

    /// Whether any token has a price: if not, the answer need not report tokens.
    pub fn prices_tokens(&self) -> bool {
        [
            self.input,
            self.cached_input,
            self.cache_write,
            self.output,
            self.reasoning,
        ]
        .iter()
        .any(|p| *p > 0)
    }

    /// What `answer` reports this entry charges for: [`Usage::from_answer`]
    /// with its unit pointers, or only the units ([`Usage::units_only`]) when
    /// it prices no token. `None`: unreported (charge the reservation).
    pub fn usage(&self, answer: &serde_json::Value) -> Option<Usage> {
        let pointers = self.units.keys().map(String::as_str);
        if self.prices_tokens() {
            Usage::from_answer(answer, pointers)
        } else {
            Usage::units_only(answer, pointers)
        }
    }

    /// What a call that used `usage` costs, in minor units (micro-units of
    /// money, tokens): the exact sum of count × price over every token kind
    /// and unit, plus the request fee, rounded up once; at most
    /// [`MAX_AMOUNT`]. Units this entry does not price cost nothing.
    pub fn cost(&self, usage: &Usage) -> u64 {
        let tokens = [
            (usage.input, self.input),
            (usage.cached_input, self.cached_input),
            (usage.cache_write, self.cache_write),
            (usage.output, self.output),
            (usage.reasoning, self.reasoning),
        ];
        let units = self
            .units
            .iter()
            .map(|(p, u)| (usage.units.get(p).copied().unwrap_or(0), u.price));
        round_up(total(self.request, tokens.into_iter().chain(units)))
    }

    /// The most a call of `request` (its body `input_bytes` long) can cost,
    /// in minor units, rounded up once as [`Entry::cost`] is:
    /// - input: at most `input_bytes` tokens (a BPE token is at least one byte
    ///   of text, so the body's length bounds the prompt's tokens; it
    ///   overstates them about 4×, which only makes admission stricter: the
    ///   charge is the cost), at the highest of the input, cached-input and
    ///   cache-write prices;
    /// - output: at most the largest of the request's [`OUTPUT_BOUNDS`], no
    ///   more than `max_output`; or `max_output` when it sets none; times the
    ///   largest of its [`CHOICES`] (1 when none); at the higher of the output
    ///   and reasoning prices;
    /// - the request fee, and each priced unit's `max_units`.
    ///
    /// So `reserve >= cost` for any usage within those bounds.
    pub fn reserve(
        &self,
        request: &serde_json::Value,
        input_bytes: usize,
    ) -> Result<u64, ReserveError> {
        let input_price = self.input.max(self.cached_input).max(self.cache_write);
        let output_price = self.output.max(self.reasoning);
        let input = u64::try_from(input_bytes).unwrap_or(u64::MAX);
        let output = match output_price {
            0 => 0,
            _ => self.output_bound(request)?,
        };
        let mut counts = vec![(input, input_price), (output, output_price)];
        for (pointer, unit) in &self.units {
            if unit.price == 0 {
                continue;
            }
            let Some(max) = unit.max else {
                return Err(ReserveError::NoUnitBound {
                    entry: self.key.clone(),
                    pointer: pointer.clone(),
                });
            };
            counts.push((max, unit.price));
        }
        Ok(round_up(total(self.request, counts)))
    }

    /// The most output tokens `request` can produce: see [`Entry::reserve`].
    fn output_bound(&self, request: &serde_json::Value) -> Result<u64, ReserveError> {
        let each = match (largest(request, &OUTPUT_BOUNDS)?, self.max_output) {
            (Some(a), Some(m)) => a.min(m),
            (Some(n), None) | (None, Some(n)) => n,
            (None, None) => {
                return Err(ReserveError::NoOutputBound {
                    entry: self.key.clone(),
                })
            }
        };
        let choices = largest(request, &CHOICES)?.unwrap_or(1).max(1);
        Ok(each.saturating_mul(choices))
    }
}

/// The largest whole number among `request`'s top-level `fields` (`null` is
/// absent), `None` when there is none.
fn largest(
    request: &serde_json::Value,
    fields: &[&'static str],
) -> Result<Option<u64>, ReserveError> {
    let mut most: Option<u64> = None;
    for &field in fields {
        match request.get(field) {
            None | Some(serde_json::Value::Null) => {}
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| ReserveError::BadBound {
                    field,
                    value: v.to_string().chars().take(40).collect(),
                })?;
                most = Some(most.map_or(n, |m| m.max(n)));
            }
        }
    }
    Ok(most)
}

/// `fee` plus Σ count × price, exactly (saturating far past any real sum).
fn total(fee: u64, counts: impl IntoIterator<Item = (u64, u64)>) -> u128 {
    counts
        .into_iter()
        .fold(u128::from(fee), |sum, (count, price)| {
            sum.saturating_add(u128::from(count) * u128::from(price))
        })
}

/// `total` prices rounded up to minor units, at most [`MAX_AMOUNT`].
fn round_up(total: u128) -> u64 {
    let minor = total.div_ceil(u128::from(PRICE_PER_MINOR));
    u64::try_from(minor).unwrap_or(u64::MAX).min(MAX_AMOUNT)
}

#[cfg(test)]
mod tests {
    use super::sheet::tests::SHEET;
    use super::*;
    use crate::money::Currency;
    use crate::testing::rng;
    use serde_json::json;

    fn sheet() -> PriceSheet {
        PriceSheet::parse(SHEET, "prices.toml", Currency::parse("USD").unwrap()).unwrap()
    }

    fn charge(model: &str, answer: serde_json::Value) -> Option<u64> {
        let s = sheet();
        let e = s.entry(model).unwrap();
        e.usage(&answer).map(|u| e.cost(&u))
    }

    #[test]
    fn chat_cost_is_exact_and_rounded_up_once() {
        // 234 × 0.15 + 1,000 × 0.075 + 467 × 0.60 + 100 × 0.60 (reasoning at
        // the output price), per million: 450.3 micro-dollars, charged 451.
        let answer = json!({"usage": {"prompt_tokens": 1234, "completion_tokens": 567,
            "prompt_tokens_details": {"cached_tokens": 1000},
            "completion_tokens_details": {"reasoning_tokens": 100}}});
        assert_eq!(charge("gpt-4o-mini", answer.clone()), Some(451));
        // The dated snapshot also charges $0.001 a request: 1,000 micro-dollars more.
        assert_eq!(charge("gpt-4o-mini-2024-07-18", answer), Some(1451));
        // Rounded per token kind instead, it would be 36 + 75 + 281 + 60 = 452.
    }

    #[test]
    fn anthropic_cost_adds_cache_reads_and_writes() {
        // 50 × 3 + 10,001 × 0.30 + 2,000 × 3.75 + 300 × 15 = 15,150.3 micro-dollars.
        let answer = json!({"usage": {"input_tokens": 50, "cache_read_input_tokens": 10001,
            "cache_creation_input_tokens": 2000, "output_tokens": 300}});
        assert_eq!(charge("claude-sonnet-4-20250514", answer), Some(15_151));
    }

    #[test]
    fn responses_cost_subtracts_cached_and_reasoning() {
        // 500 × 0.15 + 1,500 × 0.075 + 500 × 0.60 + 300 × 0.60 = 667.5.
        let answer = json!({"usage": {"input_tokens": 2000,
            "input_tokens_details": {"cached_tokens": 1500}, "output_tokens": 800,
            "output_tokens_details": {"reasoning_tokens": 300}}});
        assert_eq!(charge("gpt-4o-mini", answer), Some(668));
    }

    #[test]
    fn more_cached_than_prompt_charges_the_prompt_once() {
        // cached 150 > prompt 100: 100 cached × 0.075 + 10 × 0.60 = 13.5.
        let answer = json!({"usage": {"prompt_tokens": 100, "completion_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 150}}});
        assert_eq!(charge("gpt-4o-mini", answer), Some(14));
    }

    #[test]
    fn units_and_request_fees() {
        // $0.005 + 7 × $0.0001 = 5,700 micro-dollars; no token report needed.
        assert_eq!(
            charge("search", json!({"usage": {"results": 7}})),
            Some(5_700)
        );
        assert_eq!(charge("search", json!({"hits": []})), Some(5_000));
        assert_eq!(charge("search", json!({"usage": {"results": "7"}})), None);
        // A token-priced model with no usage: unreported.
        assert_eq!(charge("gpt-4o", json!({"choices": []})), None);
        let s = sheet();
        let search = s.entry("search").unwrap();
        assert_eq!(search.reserve(&json!({}), 10_000), Ok(5_000 + 5_000));
    }

    #[test]
    fn a_zero_usage_costs_nothing_but_the_fee() {
        let s = sheet();
        assert_eq!(s.entry("gpt-4o").unwrap().cost(&Usage::default()), 0);
        assert_eq!(
            s.entry("gpt-4o-mini-2024-07-18")
                .unwrap()
                .cost(&Usage::default()),
            1_000
        );
        // One cached token at $0.075/M is 0.075 micro-dollars: charged 1.
        let one = Usage {
            cached_input: 1,
            ..Usage::default()
        };
        assert_eq!(s.entry("gpt-4o-mini").unwrap().cost(&one), 1);
    }

    #[test]
    fn costs_saturate_at_the_lua_bound() {
        let s = sheet();
        let e = s.entry("gpt-4o").unwrap();
        let huge = Usage {
            input: MAX_AMOUNT,
            output: MAX_AMOUNT,
            ..Usage::default()
        };
        assert_eq!(e.cost(&huge), MAX_AMOUNT);
        let most = Entry {
            input: u64::MAX,
            output: u64::MAX,
            cached_input: u64::MAX,
            cache_write: u64::MAX,
            reasoning: u64::MAX,
            request: u64::MAX,
            ..e.clone()
        };
        let all = Usage {
            input: u64::MAX,
            cached_input: u64::MAX,
            cache_write: u64::MAX,
            output: u64::MAX,
            reasoning: u64::MAX,
            units: BTreeMap::new(),
        };
        assert_eq!(most.cost(&all), MAX_AMOUNT);
        assert_eq!(
            most.reserve(&json!({"max_tokens": u64::MAX}), usize::MAX),
            Ok(MAX_AMOUNT)
        );
    }

    #[test]
    fn reserve_bounds_input_by_bytes_and_output_by_the_request() {
        let s = sheet();
        let mini = s.entry("gpt-4o-mini").unwrap();
        // 4,000 bytes × 0.15 + 1,000 × 0.60 = 1,200 micro-dollars.
        assert_eq!(mini.reserve(&json!({"max_tokens": 1000}), 4000), Ok(1200));
        assert_eq!(
            mini.reserve(&json!({"max_completion_tokens": 1000}), 4000),
            Ok(1200)
        );
        assert_eq!(
            mini.reserve(&json!({"max_output_tokens": 1000}), 4000),
            Ok(1200)
        );
        // Several bounds: the largest; null is no bound.
        assert_eq!(
            mini.reserve(
                &json!({"max_tokens": 10, "max_completion_tokens": 1000}),
                4000
            ),
            Ok(1200)
        );
        assert_eq!(
            mini.reserve(
                &json!({"max_tokens": null, "max_output_tokens": 1000}),
                4000
            ),
            Ok(1200)
        );
        // None, or more than the model's limit: max_output (16,384 × 0.60 = 9,830.4).
        assert_eq!(mini.reserve(&json!({}), 0), Ok(9831));
        assert_eq!(mini.reserve(&json!({"max_tokens": 1_000_000}), 0), Ok(9831));
        // n completions, each up to the bound: 4,000 × 0.15 + 3 × 1,000 × 0.60.
        assert_eq!(
            mini.reserve(&json!({"max_tokens": 1000, "n": 3}), 4000),
            Ok(2400)
        );
        assert_eq!(
            mini.reserve(&json!({"max_tokens": 1000, "n": 1, "best_of": 2}), 0),
            Ok(1200)
        );
        assert_eq!(
            mini.reserve(&json!({"max_tokens": 1000, "n": 0}), 0),
            Ok(600)
        );
        let e = mini.reserve(&json!({"n": "3"}), 0).unwrap_err();
        assert!(e.to_string().contains("n must be a whole number"), "{e}");
        // Input at the highest input-side price: Claude's cache write, 3.75.
        let claude = s.entry("claude-sonnet-4").unwrap();
        assert_eq!(claude.reserve(&json!({"max_tokens": 0}), 1000), Ok(3750));
    }

    #[test]
    fn reserve_errors_say_what_bound_is_missing() {
        let s = sheet();
        let default = s.entry("o3").unwrap();
        let e = default.reserve(&json!({"messages": []}), 100).unwrap_err();
        assert_eq!(
            e,
            ReserveError::NoOutputBound {
                entry: "default".into()
            }
        );
        assert!(
            e.to_string().contains("default prices output tokens")
                && e.to_string().contains("max_tokens"),
            "{e}"
        );
        assert_eq!(
            default.reserve(&json!({"max_tokens": 10}), 100),
            Ok(100 * 10 + 10 * 30)
        );
        let e = default
            .reserve(&json!({"max_tokens": "many"}), 100)
            .unwrap_err();
        assert!(
            e.to_string().contains("max_tokens") && e.to_string().contains("\"many\""),
            "{e}"
        );
        let e = default
            .reserve(&json!({"max_output_tokens": -1}), 100)
            .unwrap_err();
        assert!(
            e.to_string().contains("max_output_tokens") && e.to_string().contains("-1"),
            "{e}"
        );
        let e = default
            .reserve(&json!({"max_tokens": 1.5}), 100)
            .unwrap_err();
        assert!(
            matches!(
                e,
                ReserveError::BadBound {
                    field: "max_tokens",
                    ..
                }
            ),
            "{e}"
        );
        // Free output needs no bound.
        let text = "currency = \"USD\"\n[default]\ninput = \"1\"\noutput = \"0\"\n";
        let free = PriceSheet::parse(text, "p.toml", Currency::parse("USD").unwrap()).unwrap();
        assert_eq!(free.entry("e").unwrap().reserve(&json!({}), 10), Ok(10));
        // A priced unit with no max.
        let mut search = s.entry("search").unwrap().clone();
        search.units.get_mut("/usage/results").unwrap().max = None;
        let e = search.reserve(&json!({}), 10).unwrap_err();
        assert!(
            e.to_string().contains("models.search") && e.to_string().contains("\"/usage/results\""),
            "{e}"
        );
    }

    /// A random price per million tokens, in micro-dollars (so per token in
    /// pico-dollars): zero, tiny, typical or huge.
    fn random_price(next: &mut impl FnMut() -> u64) -> u64 {
        match next() % 5 {
            0 => 0,
            1 => next() % 100,
            2 => next() % 100_000_000,
            3 => next() % 1_000_000_000_000,
            _ => next() % (MAX_AMOUNT + 1),
        }
    }

    fn random_count(next: &mut impl FnMut() -> u64, most: u64) -> u64 {
        match next() % 4 {
            0 => 0,
            1 => next() % 1_000.min(most + 1),
            _ => next() % (most + 1),
        }
    }

    /// A sheet whose one entry has the given prices, written as decimals: the
    /// parse is exercised too.
    fn entry_of(
        p: [u64; 5],
        fee_pico: u64,
        unit_pico: u64,
        max_units: u64,
        max_output: u64,
    ) -> Entry {
        let d = |micro: u64| format!("\"{}.{:06}\"", micro / 1_000_000, micro % 1_000_000);
        let text = format!(
            "currency = \"USD\"\n[default]\ninput = {}\noutput = {}\ncached_input = {}\n\
             cache_write = {}\nreasoning = {}\nrequest = \"{}.{:012}\"\nmax_output = {max_output}\n\
             [default.units]\n\"/n\" = \"{}.{:012}\"\n[default.max_units]\n\"/n\" = {max_units}\n",
            d(p[0]),
            d(p[1]),
            d(p[2]),
            d(p[3]),
            d(p[4]),
            fee_pico / 1_000_000_000_000,
            fee_pico % 1_000_000_000_000,
            unit_pico / 1_000_000_000_000,
            unit_pico % 1_000_000_000_000,
        );
        let sheet = PriceSheet::parse(&text, "p.toml", Currency::parse("USD").unwrap()).unwrap();
        let e = sheet.entry("m").unwrap().clone();
        assert_eq!(
            [
                e.input,
                e.output,
                e.cached_input,
                e.cache_write,
                e.reasoning,
                e.request
            ],
            [p[0], p[1], p[2], p[3], p[4], fee_pico],
            "{text}"
        );
        e
    }

    /// The cost computed another way: whole micro-dollars and pico remainders
    /// summed apart, the remainders rounded up at the end.
    fn cost_by_parts(e: &Entry, u: &Usage, units: u64) -> u64 {
        let pairs = [
            (u.input, e.input),
            (u.cached_input, e.cached_input),
            (u.cache_write, e.cache_write),
            (u.output, e.output),
            (u.reasoning, e.reasoning),
            (units, e.units["/n"].price),
            (1, e.request),
        ];
        let (mut micro, mut pico) = (0u128, 0u128);
        for (count, price) in pairs {
            let (whole, rest) = (price / 1_000_000, price % 1_000_000);
            micro += u128::from(count) * u128::from(whole);
            pico += u128::from(count) * u128::from(rest);
        }
        let exact = micro + pico / 1_000_000 + u128::from(pico % 1_000_000 != 0);
        u64::try_from(exact).unwrap_or(u64::MAX).min(MAX_AMOUNT)
    }

    #[test]
    fn cost_is_the_exact_sum_rounded_up_and_reserve_bounds_it() {
        let mut next = rng(0x5eed_cafe_f00d_0001);
        let (mut sum_costs, mut sum_exact) = (0u128, 0u128);
        for case in 0..3_000 {
            let prices = [0; 5].map(|_| random_price(&mut next));
            let fee = match next() % 3 {
                0 => 0,
                1 => next() % 10_000_000_000,
                _ => next() % 1_000_000_000_000_000,
            };
            let unit = next() % 1_000_000_000_000_000;
            let max_units = 1 + next() % 1_000;
            let max_output = 1 + next() % 200_000;
            let e = entry_of(prices, fee, unit, max_units, max_output);

            let bytes = (next() % 2_000_000) as usize;
            let asked = next() % 300_000;
            let choices = 1 + next() % 4;
            let request = match next() % 4 {
                0 => json!({}),
                1 => json!({"max_tokens": asked}),
                2 => json!({"max_tokens": asked, "n": choices}),
                _ => json!({"max_completion_tokens": asked, "max_tokens": asked / 2}),
            };
            let out_most = request
                .get("max_completion_tokens")
                .or(request.get("max_tokens"))
                .and_then(|v| v.as_u64())
                .map_or(max_output, |a| a.min(max_output))
                * request.get("n").and_then(|v| v.as_u64()).unwrap_or(1);
            // A usage within the request's bounds: input ≤ bytes, output ≤ max.
            let input_all = random_count(&mut next, bytes as u64);
            let cached = random_count(&mut next, input_all);
            let write = random_count(&mut next, input_all - cached);
            let output_all = random_count(&mut next, out_most);
            let reasoning = random_count(&mut next, output_all);
            let units = random_count(&mut next, max_units);
            let usage = Usage {
                input: input_all - cached - write,
                cached_input: cached,
                cache_write: write,
                output: output_all - reasoning,
                reasoning,
                units: BTreeMap::from([("/n".to_owned(), units)]),
            };
            let cost = e.cost(&usage);
            assert_eq!(
                cost,
                cost_by_parts(&e, &usage, units),
                "case {case}: {e:?} {usage:?}"
            );
            let reserve = e.reserve(&request, bytes).unwrap();
            assert!(
                reserve >= cost,
                "case {case}: reserve {reserve} < cost {cost}"
            );
            assert!(reserve <= MAX_AMOUNT && cost <= MAX_AMOUNT);
            if cost < MAX_AMOUNT {
                sum_costs += u128::from(cost);
                sum_exact += u128::from(cost_by_parts(&e, &usage, units));
            }
        }
        // Integers add up: many calls' charges never drift from their sum.
        assert_eq!(sum_costs, sum_exact);
    }

    #[test]
    fn the_worst_case_usage_costs_exactly_the_reservation() {
        let mut next = rng(7);
        for _ in 0..1_000 {
            let (i, o) = (random_price(&mut next), random_price(&mut next));
            let e = entry_of(
                [i, o, i, i, o],
                next() % 1_000_000_000,
                next() % 1_000_000_000,
                3,
                4096,
            );
            let bytes = next() % 100_000;
            let max = next() % 4096;
            let worst = Usage {
                input: bytes,
                output: max,
                units: BTreeMap::from([("/n".to_owned(), 3)]),
                ..Usage::default()
            };
            assert_eq!(
                e.reserve(&json!({"max_tokens": max}), bytes as usize),
                Ok(e.cost(&worst))
            );
        }
    }

    #[test]
    fn a_cost_is_never_more_than_one_micro_unit_above_exact() {
        let mut next = rng(99);
        for _ in 0..2_000 {
            let e = entry_of(
                [0; 5].map(|_| next() % 10_000_000),
                next() % 10_000_000,
                0,
                1,
                1,
            );
            let u = Usage {
                input: next() % 100_000,
                cached_input: next() % 100_000,
                cache_write: next() % 100_000,
                output: next() % 100_000,
                reasoning: next() % 100_000,
                units: BTreeMap::new(),
            };
            let pico = total(
                e.request,
                [
                    (u.input, e.input),
                    (u.cached_input, e.cached_input),
                    (u.cache_write, e.cache_write),
                    (u.output, e.output),
                    (u.reasoning, e.reasoning),
                ],
            );
            let cost = u128::from(e.cost(&u)) * 1_000_000;
            assert!(cost >= pico && cost - pico < 1_000_000, "{cost} vs {pico}");
        }
    }
}
