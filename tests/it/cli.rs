//! `tollgate budget ...` as an operator runs it: a real process against a real
//! Redis, checking exit codes, JSON output and one-line errors.

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::config::Config;
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::job::{JobOptions, JobQueue, JobRequest, JobSource, Lease};
use tollgate_redis::jobs::RedisJobQueue;
use tollgate_tests::jobs::take_one;
use tollgate_tests::{random_prefix, workspace_bin, RedisServer};

struct Cli {
    server: RedisServer,
    prefix: String,
}

impl Cli {
    fn new() -> Self {
        Self {
            server: RedisServer::start(),
            prefix: random_prefix(),
        }
    }

    /// `tollgate <args>` on this Redis and prefix, with no config file.
    fn tollgate(&self, args: &[&str]) -> Output {
        Command::new(workspace_bin("tollgate"))
            .args(args)
            .env("TOLLGATE_REDIS_URL", self.server.url())
            .env("TOLLGATE_KEY_PREFIX", &self.prefix)
            .env_remove("TOLLGATE_CONFIG")
            .output()
            .expect("run tollgate")
    }

    /// `tollgate <group> <args>` on this Redis and prefix.
    fn run_in(&self, group: &str, args: &[&str]) -> Output {
        self.tollgate(&[&[group], args].concat())
    }

    /// `tollgate <group> <args> --json`, which must exit with `code`: its JSON.
    fn json_in(&self, group: &str, args: &[&str], code: i32) -> serde_json::Value {
        let mut all = args.to_vec();
        all.push("--json");
        let out = self.run_in(group, &all);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {out:?}");
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out:?}"))
    }

    fn run(&self, args: &[&str]) -> Output {
        self.run_in("budget", args)
    }

    fn json(&self, args: &[&str], code: i32) -> serde_json::Value {
        self.json_in("budget", args, code)
    }
}

fn one_line_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    err
}

#[test]
fn reserve_deny_refund_and_usage() {
    let cli = Cli::new();
    let reserve_r1 = [
        "reserve",
        "--user",
        "alice",
        "--cost",
        "600",
        "--request-id",
        "r1",
    ];
    let v = cli.json(&reserve_r1, 0);
    assert_eq!(
        (
            v["allowed"].as_bool(),
            v["used"].as_u64(),
            v["limit"].as_u64(),
            v["remaining"].as_u64()
        ),
        (Some(true), Some(600), Some(1000), Some(400))
    );

    let v = cli.json(&["reserve", "--user", "alice", "--cost", "600"], 3);
    assert_eq!(v["allowed"].as_bool(), Some(false));
    let retry = v["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!(
        retry > 12 * 3600 * 1000 - 60_000 && retry <= 12 * 3600 * 1000,
        "{retry}"
    );

    // Retrying r1 charges nothing.
    let v = cli.json(&reserve_r1, 0);
    assert_eq!(
        (v["duplicate"].as_bool(), v["used"].as_u64()),
        (Some(true), Some(600))
    );

    let v = cli.json(&["usage", "--user", "alice"], 0);
    assert_eq!(
        (
            v["used"].as_u64(),
            v["limit"].as_u64(),
            v["remaining"].as_u64(),
            v["window_secs"].as_u64()
        ),
        (Some(600), Some(1000), Some(400), Some(43200))
    );
    let events = v["events"].as_array().expect("events");
    assert_eq!(events.len(), 1);
    assert_eq!(
        (events[0]["request_id"].as_str(), events[0]["cost"].as_u64()),
        (Some("r1"), Some(600))
    );
    assert!(events[0]["at_ms"].as_u64().is_some());

    let v = cli.json(&["refund", "--user", "alice", "--request-id", "r1"], 0);
    assert_eq!(
        (v["refunded"].as_bool(), v["used"].as_u64()),
        (Some(true), Some(0))
    );
    let v = cli.json(&["refund", "--user", "alice", "--request-id", "r1"], 0);
    assert_eq!(v["refunded"].as_bool(), Some(false));

    // Human output is there too.
    let out = cli.run(&["usage", "--user", "alice"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("used 0/1000"),
        "{out:?}"
    );
}

/// `budget usage --limit --cursor` pages the audit trail, `--all` follows the
/// cursors; a bad limit or cursor exits 2.
#[test]
fn usage_pages_with_limit_cursor_and_all() {
    let cli = Cli::new();
    for id in ["a1", "a2", "a3"] {
        let args = [
            "reserve",
            "--user",
            "carol",
            "--cost",
            "1",
            "--request-id",
            id,
        ];
        cli.json(&args, 0);
    }
    let ids = |v: &serde_json::Value| -> Vec<String> {
        v["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["request_id"].as_str().unwrap_or("?").to_owned())
            .collect()
    };
    let first = cli.json(&["usage", "--user", "carol", "--limit", "2"], 0);
    assert_eq!(
        (ids(&first), first["used"].as_u64()),
        (vec!["a1".to_owned(), "a2".into()], Some(3))
    );
    let cursor = first["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let rest = cli.json(
        &[
            "usage", "--user", "carol", "--limit", "2", "--cursor", &cursor,
        ],
        0,
    );
    assert_eq!(ids(&rest), ["a3"]);
    assert!(rest["next_cursor"].is_null(), "{rest}");
    let all = cli.json(&["usage", "--user", "carol", "--limit", "1", "--all"], 0);
    assert_eq!(ids(&all), ["a1", "a2", "a3"]);
    let out = cli.run(&["usage", "--user", "carol", "--limit", "1"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("--cursor "),
        "{out:?}"
    );
    for bad in [
        &["--limit", "0"][..],
        &["--limit", "51"],
        &["--cursor", "x-1"],
    ] {
        let mut args = vec!["usage", "--user", "carol"];
        args.extend_from_slice(bad);
        let out = cli.run(&args);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
    }
}

#[test]
fn plans_can_be_set_and_read_back() {
    let cli = Cli::new();
    assert_eq!(cli.json(&["get-plan", "--user", "bob"], 0)["plan"], "free");
    cli.json(&["set-plan", "--user", "bob", "--plan", "pro"], 0);
    assert_eq!(cli.json(&["get-plan", "--user", "bob"], 0)["plan"], "pro");
    assert_eq!(cli.json(&["usage", "--user", "bob"], 0)["limit"], 20000);
    let v = cli.json(&["reserve", "--user", "bob", "--cost", "5000"], 0);
    assert_eq!(v["remaining"], 15000);
    let out = cli.run(&["set-plan", "--user", "bob", "--plan", "gold"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(one_line_error(&out).contains("gold"));
}

#[test]
fn bad_input_is_exit_2_with_one_line() {
    let cli = Cli::new();
    for (args, needle) in [
        (&["reserve", "--user", "a:b", "--cost", "1"][..], "user id"),
        (&["reserve", "--user", "{x}", "--cost", "1"][..], "user id"),
        (&["reserve", "--user", "a", "--cost", "0"][..], "at least 1"),
        (
            &["reserve", "--user", "a", "--cost", "1001"][..],
            "exceeds the plan limit",
        ),
        (&["reserve", "--user", "a", "--cost", "-3"][..], "-3"),
        (
            &["refund", "--user", "a", "--request-id", "x y"][..],
            "request id",
        ),
        (
            &[
                "reserve",
                "--user",
                "a",
                "--cost",
                "1",
                "--request-id",
                "..",
            ][..],
            "must not be \".\" or \"..\"",
        ),
    ] {
        let out = cli.run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // Nothing was recorded by any of them.
    assert_eq!(cli.json(&["usage", "--user", "a"], 0)["used"], 0);
}

/// A pool `p` whose members are these lines.
const POOL_MEMBERS_NO_URL: &str = "[plans.tiny]\nlimit = 5\nwindow = \"1h\"\n[providers.p]\nmax_wait = \"1s\"\nmembers = [{ name = \"a\", limits = [{ rate = 60, per = \"1m\" }] }]\n";
const POOL_MEMBERS_TWICE: &str = "[plans.tiny]\nlimit = 5\nwindow = \"1h\"\n[providers.p]\nmax_wait = \"1s\"\nmembers = [{ name = \"a\", url = \"http://127.0.0.1:9\", limits = [{ rate = 60, per = \"1m\" }] }, { name = \"a\", url = \"http://127.0.0.1:8\", limits = [{ rate = 60, per = \"1m\" }] }]\n";
const POOL_MEMBERS_WEIGHT_0: &str = "[plans.tiny]\nlimit = 5\nwindow = \"1h\"\n[providers.p]\nmax_wait = \"1s\"\nmembers = [{ name = \"a\", url = \"http://127.0.0.1:9\", weight = 0, limits = [{ rate = 60, per = \"1m\" }] }]\n";
const POOL_MEMBERS_TOO_LIGHT: &str = "[plans.tiny]\nlimit = 5\nwindow = \"1h\"\n[providers.p]\nmax_wait = \"1s\"\nmembers = [{ name = \"a\", url = \"http://127.0.0.1:9\", limits = [{ rate = 60, per = \"1m\" }, { tokens = 1000, per = \"1m\", burst = 100 }] }]\n[operations.o]\ncost = 1\nprovider = \"p\"\nweight = 101\n";

#[test]
fn config_errors_name_the_key() {
    let cli = Cli::new();
    let good = "default_plan = \"tiny\"\n[plans.tiny]\nlimit = 5\nwindow = \"1h\"\n";
    let (dir, good) = tollgate_tests::temp_file("cli", "good.toml", good).unwrap();
    let v = cli.json(
        &["--config", good.to_str().unwrap(), "usage", "--user", "c"],
        0,
    );
    assert_eq!(
        (v["plan"].as_str(), v["limit"].as_u64()),
        (Some("tiny"), Some(5))
    );

    for (text, key) in [
        (
            "default_plan = \"gold\"\n[plans.tiny]\nlimit = 5\nwindow = \"1h\"\n",
            "default_plan",
        ),
        (
            "[plans.tiny]\nlimit = 0\nwindow = \"1h\"\n",
            "plans.tiny.limit",
        ),
        (
            "[plans.tiny]\nlimit = 5\nwindow = \"an hour\"\n",
            "plans.tiny.window",
        ),
        // Pools: a member without url, a name twice, a weight of 0, limits
        // that could never grant an operation's weight.
        (POOL_MEMBERS_NO_URL, "providers.p.members[0].url"),
        (POOL_MEMBERS_TWICE, "providers.p.members[1].name"),
        (POOL_MEMBERS_WEIGHT_0, "providers.p.members[0].weight"),
        (POOL_MEMBERS_TOO_LIGHT, "providers.p.members[0].limits"),
    ] {
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, text).unwrap();
        let out = cli.run(&["--config", bad.to_str().unwrap(), "usage", "--user", "c"]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(one_line_error(&out).contains(key), "{out:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unreachable_redis_is_a_one_line_failure() {
    let cli = Cli::new();
    let port = tollgate_tests::redis_server::free_port();
    let url = format!("redis://:hunter2@127.0.0.1:{port}/");
    let out = cli.run(&["reserve", "--user", "a", "--cost", "1", "--redis-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = one_line_error(&out);
    assert!(err.contains("unreachable"), "{err}");
    assert!(!err.contains("hunter2"), "the password is redacted: {err}");
}

#[test]
fn demo_runs_on_the_embedded_ledger() {
    let out = Command::new(workspace_bin("tollgate"))
        .args(["budget", "demo"])
        .env_remove("TOLLGATE_REDIS_URL")
        .env_remove("TOLLGATE_CONFIG")
        .output()
        .expect("run tollgate budget demo");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("50 admitted, 10 denied"), "{text}");
}

/// `--help` shows which variable feeds each flag, never its value when that value
/// can hold a secret (a Redis URL with a password, the admin token, a provider
/// URL with credentials).
#[test]
fn help_never_shows_secret_values() {
    let secrets = [
        ("TOLLGATE_REDIS_URL", "redis://:hunter2-redis@127.0.0.1:1/"),
        ("TOLLGATE_ADMIN_TOKEN", "hunter2-admin-token-0123456789"),
        ("TOLLGATE_VIEWER_TOKEN", "hunter2-viewer-token-0123456789"),
        (
            "TOLLGATE_PROVIDER_URL",
            "http://u:hunter2-provider@127.0.0.1:1",
        ),
    ];
    let commands: [&[&str]; 10] = [
        &["all"],
        &["api"],
        &["worker"],
        &["throttler"],
        &["budget"],
        &["budget", "reserve"],
        &["budget", "set-plan"],
        &["users"],
        &["users", "create"],
        &["users", "revoke"],
    ];
    for command in commands {
        let mut cmd = Command::new(workspace_bin("tollgate"));
        cmd.args(command).arg("--help");
        for (name, value) in secrets {
            cmd.env(name, value);
        }
        let out = cmd.output().expect("run tollgate");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(0), "{command:?} --help: {text}");
        assert!(
            text.contains("TOLLGATE_REDIS_URL"),
            "{command:?} --help names the variable: {text}"
        );
        assert!(
            !text.contains("hunter2"),
            "{command:?} --help shows a secret: {text}"
        );
    }
}

/// The job queue the CLI's budget commands act on: its Redis and prefix, the
/// built-in config.
async fn cli_queue(cli: &Cli) -> Arc<RedisJobQueue> {
    let config = Arc::new(Config::builtin());
    let options = JobOptions::default();
    let (queue, _) = crate::jobs::redis_queue_with(&cli.server, &cli.prefix, config, options).await;
    queue
}

/// Queues `id`, a `company.research` job of `user` (it costs 20).
async fn submit_research(queue: &RedisJobQueue, user: &str, id: &str) {
    let request = JobRequest {
        id: RequestId::new(id).unwrap(),
        user: UserId::new(user).unwrap(),
        operation: "company.research".into(),
        input: serde_json::json!({ "id": id }),
        trace: None,
        service_key: None,
    };
    queue.submit(request).await.unwrap();
}

/// Takes the next `company.research` job and starts it: its lease, and
/// whether the start claimed it.
async fn take_research(queue: &RedisJobQueue) -> (Lease, bool) {
    let wait = Duration::from_millis(200);
    let lease = take_one(queue, "company.research", "w", wait).await;
    let claimed = queue.start(&lease).await.unwrap();
    (lease, claimed)
}

/// `budget refund` of a job's charge: a queued job's is refunded and the job
/// cancelled (its claim is refused: it never runs); a running job's is a
/// conflict (exit 4, one line, nothing changed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refund_cancels_a_queued_job_and_refuses_a_running_one() {
    let cli = Cli::new();
    let queue = cli_queue(&cli).await;
    submit_research(&queue, "carol", "queued").await;
    let v = cli.json(&["refund", "--user", "carol", "--request-id", "queued"], 0);
    assert_eq!(
        (&v["refunded"], &v["cancelled"], &v["cost"], &v["used"]),
        (
            &serde_json::json!(true),
            &serde_json::json!(true),
            &serde_json::json!(20),
            &serde_json::json!(0)
        ),
        "{v}"
    );
    let (_, claimed) = take_research(&queue).await;
    assert!(!claimed, "a cancelled job never runs");

    submit_research(&queue, "carol", "running").await;
    let (_, claimed) = take_research(&queue).await;
    assert!(claimed);
    let out = cli.run(&["refund", "--user", "carol", "--request-id", "running"]);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let err = one_line_error(&out);
    assert!(err.contains("owns its charge"), "{err}");
    let v = cli.json(&["usage", "--user", "carol"], 0);
    assert_eq!(v["used"].as_u64(), Some(20), "nothing refunded: {v}");
}

/// Issue 51: `budget settle --cost 0` of a running job's charge was accepted
/// (exit 0) where a refund is refused, and the job then succeeded unpaid. Now
/// it is the same conflict (exit 4); once the job succeeded, a settle to 0
/// needs --force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_of_a_running_job_is_a_conflict_and_to_zero_after_it_needs_force() {
    let cli = Cli::new();
    let queue = cli_queue(&cli).await;
    submit_research(&queue, "dave", "running").await;
    let (lease, claimed) = take_research(&queue).await;
    assert!(claimed);
    let settle = [
        "settle",
        "--user",
        "dave",
        "--request-id",
        "running",
        "--cost",
        "0",
    ];
    let out = cli.run(&settle);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let err = one_line_error(&out);
    assert!(err.contains("not final"), "{err}");
    let v = cli.json(&["usage", "--user", "dave"], 0);
    assert_eq!(v["used"].as_u64(), Some(20), "nothing settled: {v}");

    queue.complete(&lease, serde_json::json!({})).await.unwrap();
    let out = cli.run(&settle);
    assert_eq!(out.status.code(), Some(4), "it ran: {out:?}");
    assert!(one_line_error(&out).contains("--force"), "{out:?}");
    let mut forced = settle.to_vec();
    forced.push("--force");
    let v = cli.json(&forced, 0);
    assert_eq!(
        (v["settled"].as_bool(), v["used"].as_u64()),
        (Some(true), Some(0)),
        "{v}"
    );
}

/// `tollgate users list|show|set-limits|clear-limits|reindex` against a real
/// Redis: JSON output, exit codes, one-line errors.
#[test]
fn users_list_show_and_custom_limits() {
    let cli = Cli::new();
    let users = |args: &[&str]| cli.run_in("users", args);
    let json = |args: &[&str], code: i32| cli.json_in("users", args, code);
    for u in ["cli-a", "cli-b", "cli-c", "zed"] {
        json(&["create", "--user", u], 0);
    }

    let page = json(&["list", "--prefix", "cli-", "--limit", "2"], 0);
    let names: Vec<&str> = page["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["user"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["cli-a", "cli-b"]);
    let cursor = page["next_cursor"].as_str().unwrap().to_owned();
    let page = json(&["list", "--prefix", "cli-", "--cursor", &cursor], 0);
    assert_eq!(page["users"][0]["user"], "cli-c");
    assert_eq!(page["next_cursor"], serde_json::Value::Null);
    let text = String::from_utf8_lossy(&users(&["list", "--limit", "3"]).stdout).into_owned();
    assert!(
        text.contains("cli-a\tuser\tfree\t1 live key(s) of 1"),
        "{text}"
    );
    assert!(text.contains("next cursor: cli-c"), "{text}");

    let v = json(
        &[
            "set-limits",
            "cli-b",
            "--limit",
            "100/1m",
            "--limit",
            "900/1h",
        ],
        0,
    );
    assert_eq!(
        (&v["plan"], &v["base_plan"], &v["custom_limits"]),
        (&"custom".into(), &"free".into(), &true.into())
    );
    assert_eq!(v["limits"][0]["window"], "1h");
    // The budget commands see them at once.
    let r = cli.run(&["reserve", "--user", "cli-b", "--cost", "101", "--json"]);
    assert_eq!(r.status.code(), Some(2), "101 > the 1m limit of 100: {r:?}");
    let shown = json(&["show", "cli-b"], 0);
    assert_eq!(shown["usage"]["plan"], "custom");
    assert_eq!(shown["usage"]["windows"].as_array().unwrap().len(), 2);
    assert_eq!(shown["keys"].as_array().unwrap().len(), 1);
    assert!(shown["keys"][0]["key_id"]
        .as_str()
        .unwrap()
        .starts_with("kid_"));
    assert!(!shown.to_string().contains("tg_user_"), "{shown}");
    let text = String::from_utf8_lossy(&users(&["show", "cli-b"]).stdout).into_owned();
    assert!(
        text.contains("custom limits 900 tokens / 1h + 100 tokens / 1m (plan free when cleared)"),
        "{text}"
    );

    let v = json(&["clear-limits", "cli-b"], 0);
    assert_eq!(
        (&v["plan"], &v["custom_limits"]),
        (&"free".into(), &false.into())
    );

    // Bad input: exit 2, one line.
    for args in [
        &["set-limits", "cli-b", "--limit", "10/13h"][..],
        &["set-limits", "nobody", "--limit", "10/1h"][..],
        &["list", "--limit", "0"][..],
        &["show", "nobody"][..],
    ] {
        let out = users(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = one_line_error(&out);
        if args.contains(&"10/13h") {
            assert!(err.contains("retention"), "{err}");
        }
    }
    // A limit that is not an amount: exit 2 naming it.
    let out = users(&["set-limits", "cli-b", "--limit", "ten/1h"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = one_line_error(&out);
    assert!(
        err.contains("limits[0].limit") && err.contains("\"ten\""),
        "{err}"
    );

    let v = json(&["reindex"], 0);
    assert_eq!(v["users_seen"], 4);
}

/// `tollgate orgs ...` and `tollgate users set-org`: an organisation on a
/// plan, a user put in it (its spend moves along), shown and listed; bad
/// names are one-line errors with exit 2.
#[test]
fn organisations_from_the_command_line() {
    let cli = Cli::new();
    let run = |args: &[&str]| cli.tollgate(args);
    let json = |args: &[&str]| {
        let out = run(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out:?}"))
    };
    let v = json(&["orgs", "set", "acme", "--plan", "free", "--json"]);
    assert_eq!(v["plan"], "free");
    cli.json(
        &[
            "reserve",
            "--user",
            "alice",
            "--cost",
            "7",
            "--request-id",
            "r1",
        ],
        0,
    );
    let v = json(&["users", "set-org", "alice", "acme", "--json"]);
    assert_eq!(
        (&v["org"], &v["moved_events"]),
        (&serde_json::json!("acme"), &serde_json::json!(1))
    );
    let v = json(&["orgs", "show", "acme", "--json"]);
    assert_eq!(v["members"], serde_json::json!(["alice"]));
    assert_eq!(v["windows"][0]["used"], 7);
    let v = json(&["orgs", "list", "--json"]);
    assert_eq!(v["orgs"], serde_json::json!(["acme"]));
    let v = cli.json(&["usage", "--user", "alice"], 0);
    assert_eq!(v["organisation"]["org"], "acme", "{v}");
    let v = json(&["users", "set-org", "alice", "--none", "--json"]);
    assert_eq!(v["org"], serde_json::Value::Null);
    for bad in [
        &["users", "set-org", "alice", "nowhere"][..],
        &["orgs", "set", "acme", "--plan", "platinum"],
        &["orgs", "show", "nowhere"],
    ] {
        let out = run(bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
        one_line_error(&out);
    }
}

/// A budget-only deployment (plans, no `[operations]`): every `tollgate
/// budget ...` and `tollgate users ...` command works against Redis. (A refund
/// used to fail for every request id: the job store's look-up sent Redis an
/// empty pipeline, one command per operation of none.)
#[test]
fn every_budget_and_users_command_runs_on_a_budget_only_config() {
    let cli = Cli::new();
    let text = "default_plan = \"tiny\"\n[plans.tiny]\nlimit = 50\nwindow = \"1h\"\n\
                [plans.big]\nlimit = 500\nwindow = \"1h\"\n";
    let (dir, config) = tollgate_tests::temp_file("cli", "budget-only.toml", text).unwrap();
    let config = config.to_str().unwrap().to_owned();
    let run = |args: &[&str]| {
        Command::new(workspace_bin("tollgate"))
            .args(args)
            .env("TOLLGATE_REDIS_URL", cli.server.url())
            .env("TOLLGATE_KEY_PREFIX", &cli.prefix)
            .env("TOLLGATE_CONFIG", &config)
            .output()
            .expect("run tollgate")
    };
    let ok = |args: &[&str]| {
        let out = run(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        out
    };
    let json = |args: &[&str]| {
        let mut all = args.to_vec();
        all.push("--json");
        let out = ok(&all);
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out:?}"))
    };

    fn budget<'a>(rest: &[&'a str]) -> Vec<&'a str> {
        [&["budget"][..], rest].concat()
    }
    let v = json(&budget(&[
        "reserve",
        "--user",
        "solo",
        "--cost",
        "5",
        "--request-id",
        "r1",
    ]));
    assert_eq!(v["used"], 5, "{v}");
    json(&budget(&[
        "reserve",
        "--user",
        "solo",
        "--cost",
        "3",
        "--request-id",
        "r2",
    ]));
    let v = json(&budget(&["refund", "--user", "solo", "--request-id", "r1"]));
    assert_eq!(
        (&v["refunded"], &v["used"]),
        (&true.into(), &3.into()),
        "{v}"
    );
    // An id that names nothing: nothing to refund, still exit 0.
    let v = json(&budget(&[
        "refund",
        "--user",
        "solo",
        "--request-id",
        "none",
    ]));
    assert_eq!(v["refunded"], false, "{v}");
    let v = json(&budget(&[
        "settle",
        "--user",
        "solo",
        "--request-id",
        "r2",
        "--cost",
        "2",
    ]));
    assert_eq!(v["settled"], true, "{v}");
    let v = json(&budget(&["usage", "--user", "solo", "--all"]));
    assert_eq!(v["used"], 2, "{v}");
    ok(&budget(&["events", "--user", "solo"]));
    json(&budget(&["set-plan", "--user", "solo", "--plan", "big"]));
    assert_eq!(
        json(&budget(&["get-plan", "--user", "solo"]))["plan"],
        "big"
    );
    ok(&budget(&["demo"]));

    fn users<'a>(rest: &[&'a str]) -> Vec<&'a str> {
        [&["users"][..], rest].concat()
    }
    let v = json(&users(&["create", "--user", "solo"]));
    let key_id = v["key_id"].as_str().expect("key_id").to_owned();
    json(&users(&["create", "--user", "svc", "--kind", "service"]));
    let v = json(&users(&["list"]));
    assert_eq!(v["users"].as_array().map(Vec::len), Some(2), "{v}");
    let v = json(&users(&["show", "solo"]));
    // `create` without --plan puts the user on the default plan.
    assert_eq!(v["usage"]["plan"], "tiny", "{v}");
    json(&users(&["set-limits", "solo", "--limit", "10/1h"]));
    json(&users(&["clear-limits", "solo"]));
    json(&users(&["reindex"]));
    ok(&["orgs", "set", "acme", "--plan", "big"]);
    json(&users(&["set-org", "solo", "acme"]));
    json(&users(&["set-org", "solo", "--none"]));
    json(&users(&["revoke", "--key-id", &key_id]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tollgate spend`: what `budget reserve` charged, by user, as JSON, CSV or
/// a table; a bad flag is exit 2 with one line naming it.
#[test]
fn spend_reports_from_the_command_line() {
    let cli = Cli::new();
    for u in ["sp-a", "sp-b"] {
        cli.json_in("users", &["create", "--user", u], 0);
    }
    for (u, cost) in [("sp-a", "3"), ("sp-a", "4"), ("sp-b", "5")] {
        cli.json(&["reserve", "--user", u, "--cost", cost], 0);
    }
    let spend = |args: &[&str]| cli.run_in("spend", args);
    let out = spend(&["--by", "user", "--step", "1h", "--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let page: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows: Vec<(String, u64)> = page["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["key"].as_str().unwrap().to_owned(),
                r["amount"].as_u64().unwrap(),
            )
        })
        .collect();
    // One bucket each (unless the hour turned between the reserves).
    let sum = |u: &str| rows.iter().filter(|r| r.0 == u).map(|r| r.1).sum::<u64>();
    assert_eq!((sum("sp-a"), sum("sp-b")), (7, 5), "{page}");
    assert_eq!(page["total"], 12);
    let csv =
        String::from_utf8_lossy(&spend(&["--by", "org", "--format", "csv"]).stdout).into_owned();
    assert!(csv.starts_with("org,start,amount\n"), "{csv}");
    let table = String::from_utf8_lossy(&spend(&["--by", "operation"]).stdout).into_owned();
    assert!(table.contains("total") && table.contains("12"), "{table}");
    let bad = spend(&["--by", "team"]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(one_line_error(&bad).contains("by"));
}

/// In a money deployment the operator commands read and print decimal
/// strings of the currency: `--cost 0.0025` is 0.0025 USD; a cost that is
/// not an amount (too precise, negative, not a number) exits 2 naming
/// `--cost` and charges nothing.
#[test]
fn money_amounts_are_decimal_strings() {
    let cli = Cli::new();
    let dir = std::env::temp_dir().join(format!("tollgate-cli-money-{}", random_prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("usd.toml");
    std::fs::write(
        &config,
        "currency = \"USD\"\ndefault_plan = \"paid\"\n[plans.paid]\nlimit = \"20\"\nwindow = \"1h\"\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let budget = |args: &[&str], code: i32| {
        cli.json_in("budget", &[&["--config", config], args].concat(), code)
    };
    let v = budget(
        &[
            "reserve",
            "--user",
            "al",
            "--cost",
            "0.0025",
            "--request-id",
            "r1",
        ],
        0,
    );
    assert_eq!(
        (
            &v["cost"],
            &v["used"],
            &v["limit"],
            &v["remaining"],
            &v["currency"]
        ),
        (
            &"0.0025".into(),
            &"0.0025".into(),
            &"20".into(),
            &"19.9975".into(),
            &"USD".into()
        ),
        "{v}"
    );
    for (bad, needle) in [
        ("0.0000001", "6 decimal places"),
        ("-1", "negative"),
        ("abc", "\"abc\""),
        ("1e3", "exponent"),
    ] {
        let cost = format!("--cost={bad}");
        let out = cli.run_in(
            "budget",
            &["--config", config, "reserve", "--user", "al", &cost],
        );
        assert_eq!(out.status.code(), Some(2), "{bad}: {out:?}");
        let err = one_line_error(&out);
        assert!(err.contains("--cost") && err.contains(needle), "{err}");
    }
    let v = budget(&["usage", "--user", "al"], 0);
    assert_eq!(
        v["used"], "0.0025",
        "nothing charged by a refused cost: {v}"
    );
    assert_eq!(v["events"][0]["cost"], "0.0025");
    let v = budget(
        &[
            "settle",
            "--user",
            "al",
            "--request-id",
            "r1",
            "--cost",
            "0.001",
        ],
        0,
    );
    assert_eq!(
        (&v["previous_cost"], &v["cost"]),
        (&"0.0025".into(), &"0.001".into()),
        "{v}"
    );
    let out = cli.run_in("budget", &["--config", config, "usage", "--user", "al"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("used 0.001/20 USD"), "{text}");

    let users = |args: &[&str], code: i32| {
        cli.json_in("users", &[&["--config", config], args].concat(), code)
    };
    users(&["create", "--user", "al"], 0);
    let v = users(&["set-limits", "al", "--limit", "0.50/1h"], 0);
    assert_eq!(v["limits"][0]["limit"], "0.5", "{v}");
    let out = cli.run_in(
        "users",
        &[
            "--config",
            config,
            "set-limits",
            "al",
            "--limit",
            "0.0000001/1h",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(one_line_error(&out).contains("limits[0].limit"));
}

/// `tollgate credits add|show|history` against a real Redis: a grant (the
/// same key again adds nothing; another grant under it exits 4), a bad
/// amount or expiry exits 2 naming the field; the balance shows.
#[test]
fn credits_add_show_and_history() {
    let cli = Cli::new();
    let json = |args: &[&str], code: i32| cli.json_in("credits", args, code);
    cli.json_in("users", &["create", "--user", "cr"], 0);
    let add = ["add", "--user", "cr", "--amount", "7", "--key", "k1"];
    let v = json(&add, 0);
    assert_eq!(
        (&v["outcome"], &v["credits"]["balance"]),
        (&"granted".into(), &7.into()),
        "{v}"
    );
    let v = json(&add, 0);
    assert_eq!(v["outcome"], "existing", "{v}");
    let out = cli.run_in(
        "credits",
        &["add", "--user", "cr", "--amount", "8", "--key", "k1"],
    );
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    for (args, field) in [
        (
            ["add", "--user", "cr", "--amount", "0", "--key", "k2"].as_slice(),
            "amount",
        ),
        (
            &["add", "--user", "cr", "--amount=-3", "--key", "k2"],
            "amount",
        ),
        (
            &[
                "add",
                "--user",
                "cr",
                "--amount",
                "3",
                "--key",
                "k2",
                "--expires-at",
                "2020-01-01T00:00:00Z",
            ],
            "expires_at",
        ),
    ] {
        let out = cli.run_in("credits", args);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(one_line_error(&out).contains(field), "{out:?}");
    }
    let v = json(&["show", "--user", "cr"], 0);
    assert_eq!(v["balance"], 7, "{v}");
    assert_eq!(v["grants"].as_array().map(Vec::len), Some(1), "{v}");
    let text = String::from_utf8_lossy(&cli.run_in("credits", &["show", "--user", "cr"]).stdout)
        .into_owned();
    assert!(text.contains("cr: balance 7 tokens"), "{text}");
    // No [export] configured: no history.
    let v = json(&["history", "--user", "cr"], 0);
    assert_eq!(v["entries"], serde_json::json!([]), "{v}");
}
