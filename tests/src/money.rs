//! A USD deployment for the tests of money: one price sheet, one priced
//! operation, and the plans a test gives.

use std::path::Path;
use std::sync::Arc;

use tollgate_core::config::Config;

/// The sheet: `gpt-4o-mini*` at 0.15 USD per million input tokens, 0.60
/// per million output tokens, at most 16,384 output tokens a call.
pub const SHEET: &str = r#"
currency = "USD"
[models."gpt-4o-mini*"]
input = "0.15"
output = "0.60"
max_output = 16384
"#;

/// A USD deployment in a new folder: [`SHEET`] as `prices.toml`, priced
/// operation `chat` on provider `llm` (room for every call), after `plans`
/// (the config's top: `default_plan`, `[plans.*]`, `[export]`, ...).
/// `name` names the config in its errors.
pub fn usd_config(name: &str, plans: &str) -> Arc<Config> {
    usd_config_with(name, SHEET, plans)
}

/// [`usd_config`] with another price sheet.
pub fn usd_config_with(name: &str, sheet: &str, plans: &str) -> Arc<Config> {
    let dir = std::env::temp_dir().join(format!("tollgate-usd-{}", crate::random_prefix()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("prices.toml"), sheet).expect("write the sheet");
    let text = format!(
        "currency = \"USD\"\n{plans}\n\
         [providers.llm]\nrate = 10000\nburst = 10000\nmax_wait = \"5s\"\nprices = \"prices.toml\"\n\
         [operations.chat]\nprovider = \"llm\"\n"
    );
    Arc::new(Config::parse_in(&text, name, Some(Path::new(&dir))).expect("the USD config"))
}
