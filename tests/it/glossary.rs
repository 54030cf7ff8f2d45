//! The glossary (ARCHITECTURE.md) gives each concept one word. The words it
//! retired must not come back in product code: the crates' sources, the Lua
//! scripts, the deployment files. A stored name or an operator's alias that
//! keeps a retired word says so within the three lines before it, with the
//! phrase "before the glossary".

use std::path::{Path, PathBuf};

/// A retired word and the one that replaced it.
const RETIRED: &[(&str, &str)] = &[
    // A job's charge given back is a release; a refund is an operator's.
    ("job_refunded", "job_released"),
    ("refund_pending", "release_pending"),
    ("refund_grace", "release_grace"),
    ("tollgate_worker_refunds", "tollgate_worker_releases"),
    (
        "tollgate_worker_refunds_total",
        "tollgate_worker_releases_total",
    ),
    ("budget was refunded", "its charge was released"),
    // A job's leases are runs; an attempt is one send to the upstream.
    ("max_attempts", "max_runs"),
    ("MAX_ATTEMPTS", "MAX_RUNS"),
    ("job.attempt", "job.run"),
    // What counts in flight until done, then frees itself, is a slot's lease.
    ("SLOT_MAX_HOLD", "SLOT_LEASE_MAX"),
    ("DEFAULT_HOLD", "DEFAULT_SLOT_LEASE"),
    ("share.hold", "share.slot_lease"),
    ("Share::hold", "Share::slot_lease"),
    // A heartbeat renews a liveness; a loop's sign of life is a beat.
    ("Heartbeat", "LoopBeat"),
];

const ALLOWED_WITHIN: usize = 3;
const ALLOW_PHRASE: &str = "before the glossary";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the workspace")
        .to_path_buf()
}

/// Every file under `dir` (recursively) whose extension is one of `exts`.
fn files(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, exts, out);
        } else if p
            .extension()
            .and_then(|x| x.to_str())
            .is_some_and(|x| exts.contains(&x))
        {
            out.push(p);
        }
    }
}

/// Whether `word` occurs in `line` not as part of a longer identifier.
fn has_word(line: &str, word: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back();
        let after = line[at + word.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

/// `file:line: text (say "new")` for each retired word in `text`.
fn findings(path: &Path, text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let allowed = lines[i.saturating_sub(ALLOWED_WITHIN)..=i]
            .iter()
            .any(|l| l.contains(ALLOW_PHRASE));
        if allowed {
            continue;
        }
        for (old, new) in RETIRED {
            if has_word(line, old) {
                found.push(format!(
                    "{}:{}: {} (say {new:?})",
                    path.display(),
                    i + 1,
                    line.trim()
                ));
            }
        }
    }
    found
}

#[test]
fn product_code_uses_the_glossary_words() {
    let root = root();
    let mut paths = Vec::new();
    let crates = std::fs::read_dir(root.join("crates")).expect("crates/");
    for c in crates.flatten() {
        files(
            &c.path().join("src"),
            &["rs", "js", "toml", "html"],
            &mut paths,
        );
    }
    files(&root.join("lua"), &["lua"], &mut paths);
    files(&root.join("deploy"), &["yml", "yaml", "json"], &mut paths);
    assert!(
        paths.len() > 100,
        "the scan found {} files: wrong root?",
        paths.len()
    );
    let mut found = Vec::new();
    for p in &paths {
        let text = std::fs::read_to_string(p).unwrap_or_default();
        found.extend(findings(p.strip_prefix(&root).unwrap_or(p), &text));
    }
    assert!(
        found.is_empty(),
        "retired words in product code (ARCHITECTURE.md, Glossary):\n{}",
        found.join("\n")
    );
}

/// The scan finds what it is meant to, and lets an alias say why it stays.
#[test]
fn the_glossary_scan_finds_a_retired_word_and_spares_a_stated_alias() {
    let p = Path::new("x.rs");
    assert_eq!(findings(p, "let max_attempts = 3;").len(), 1);
    assert_eq!(findings(p, "let max_attempts_seen = 3;").len(), 0);
    assert_eq!(findings(p, "// job.attempt: 2").len(), 1);
    assert_eq!(
        findings(
            p,
            "// `max_attempts`: its name before the glossary's.\n#[serde(alias = \"max_attempts\")]"
        )
        .len(),
        0
    );
    assert_eq!(
        findings(p, "// before the glossary\n\n\n\nmax_attempts").len(),
        1,
        "the allowance reaches three lines, no further"
    );
}
