//! Money in the config: the deployment's `currency`, and the price sheets an
//! upstream or an operation names (`prices = "<file>"`), kept current while
//! the process runs ([`Prices::reload`]).
//!
//! An operation with a sheet is *priced*: its charge up front is the worst
//! case of the request ([`crate::price::Entry::reserve`]), and its settle
//! prices the usage the upstream reports at the prices that applied when it
//! was reserved ([`crate::price::Applied`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use serde_json::Value;

use super::ConfigError;
use crate::money::Currency;
use crate::price::{Applied, ModelError, ModelFrom, PriceSheet, ReserveError};

/// One price sheet file, as last read. Shared by every operation that names
/// the same file.
#[derive(Debug)]
pub struct Prices {
    path: PathBuf,
    currency: Currency,
    sheet: RwLock<Arc<PriceSheet>>,
    /// The file's modification time and length when it was last read: a
    /// change to either is read again.
    seen: Mutex<Option<(SystemTime, u64)>>,
}

impl Eq for Prices {}

impl PartialEq for Prices {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.currency == other.currency && self.sheet() == other.sheet()
    }
}

impl Prices {
    /// Reads the sheet at `path`; every error names the file and the key.
    pub fn load(path: &Path, currency: Currency) -> Result<Self, ConfigError> {
        let seen = stamp(path);
        let sheet = PriceSheet::load(path, currency)?;
        Ok(Self {
            path: path.to_owned(),
            currency,
            sheet: RwLock::new(Arc::new(sheet)),
            seen: Mutex::new(seen),
        })
    }

    /// The file it reads.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The sheet as last read.
    pub fn sheet(&self) -> Arc<PriceSheet> {
        Arc::clone(&self.sheet.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads the file again if it changed since it was last read. A sheet
    /// that no longer parses is refused and the one in use stays (the error
    /// says why): an operator's typo never makes calls unpriced. Returns
    /// whether a new sheet is in use.
    pub fn reload(&self) -> Result<bool, ConfigError> {
        let now = stamp(&self.path);
        let mut seen = crate::lock(&self.seen);
        if now.is_some() && now == *seen {
            return Ok(false);
        }
        let sheet = PriceSheet::load(&self.path, self.currency)?;
        *seen = now;
        let mut current = self.sheet.write().unwrap_or_else(|e| e.into_inner());
        if **current == sheet {
            return Ok(false);
        }
        *current = Arc::new(sheet);
        Ok(true)
    }
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Where a priced operation's model comes from (`model`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// `model = "/model"` (the default): the request names it at a pointer.
    From(ModelFrom),
    /// `model = "gpt-4o-mini"`: every call of the operation is this model.
    Fixed(String),
}

impl ModelSource {
    /// Reads `model`: a JSON pointer when it starts with `/`, else a name.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.starts_with('/') {
            return Ok(Self::From(ModelFrom::new(text)?));
        }
        if text.is_empty() || text.len() > 200 || text.chars().any(char::is_control) {
            return Err(format!(
                "must be a JSON pointer (/model) or a model name (1 to 200 characters), got {text:?}"
            ));
        }
        Ok(Self::Fixed(text.to_owned()))
    }
}

/// How an operation is priced: its sheet and where its model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pricing {
    pub prices: Arc<Prices>,
    pub model: ModelSource,
}

/// Why a call cannot be priced: answered 422, nothing charged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PriceError {
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("the model {0:?} has no price: it is not in the price sheet, which has no default")]
    Unpriced(String),
    #[error("{0}")]
    Reserve(#[from] ReserveError),
}

/// What a priced call reserves, and the prices that applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quote {
    /// The worst case of the request, in minor units (at least 1).
    pub reserve: u64,
    pub applied: Applied,
}

impl Pricing {
    /// The worst case of a call whose input is `input`, at today's prices.
    pub fn quote(&self, input: &Value) -> Result<Quote, PriceError> {
        let model = match &self.model {
            ModelSource::From(from) => from.model(input)?,
            ModelSource::Fixed(name) => name.as_str(),
        };
        let sheet = self.prices.sheet();
        let entry = sheet
            .entry(model)
            .ok_or_else(|| PriceError::Unpriced(crate::job::Rejection::bounded(model)))?;
        let bytes = input.to_string().len();
        let reserve = entry.reserve(input, bytes)?.max(1);
        Ok(Quote {
            reserve,
            applied: Applied {
                model: model.to_owned(),
                entry: entry.clone(),
            },
        })
    }
}

/// The sheets a config's operations use while it is read: each file read
/// once, however many operations name it.
pub(super) struct Sheets<'a> {
    pub currency: Currency,
    /// Relative `prices` paths are read from here (the config file's folder).
    pub base: Option<&'a Path>,
    /// Each provider's `prices`, as written.
    pub providers: std::collections::BTreeMap<String, String>,
    pub loaded: std::collections::BTreeMap<PathBuf, Arc<Prices>>,
}

impl Sheets<'_> {
    /// The pricing of the operation at `key` of `provider`: its own `prices`
    /// or else its provider's, with its `model` (default `/model`); `None`
    /// when neither names a sheet.
    pub fn pricing(
        &mut self,
        key: &str,
        provider: &str,
        prices: Option<&str>,
        model: Option<&str>,
        invalid: &impl Fn(String, String) -> ConfigError,
    ) -> Result<Option<Pricing>, ConfigError> {
        let (file, file_key) =
            match (prices, self.providers.get(provider)) {
                (Some(p), _) => (p.to_owned(), format!("{key}.prices")),
                (None, Some(p)) => (p.clone(), format!("providers.{provider}.prices")),
                (None, None) => return match model {
                    Some(_) => Err(invalid(
                        format!("{key}.model"),
                        "only a priced operation (`prices`, its own or its provider's) has a model"
                            .into(),
                    )),
                    None => Ok(None),
                },
            };
        if self.currency == Currency::Tokens {
            return Err(invalid(
                file_key,
                "prices need budgets in money: set `currency` (e.g. \"USD\")".into(),
            ));
        }
        if file.is_empty() {
            return Err(invalid(file_key, "must name a price sheet file".into()));
        }
        let path = match self.base {
            Some(dir) if Path::new(&file).is_relative() => dir.join(&file),
            _ => PathBuf::from(&file),
        };
        let prices = match self.loaded.get(&path) {
            Some(p) => Arc::clone(p),
            None => {
                let p = Arc::new(Prices::load(&path, self.currency)?);
                self.loaded.insert(path, Arc::clone(&p));
                p
            }
        };
        let model = match model {
            None => ModelSource::From(ModelFrom::default()),
            Some(m) => ModelSource::parse(m).map_err(|e| invalid(format!("{key}.model"), e))?,
        };
        Ok(Some(Pricing { prices, model }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::money::IsoCode;

    const SHEET: &str = r#"
currency = "USD"
[models."gpt-4o-mini*"]
input = "0.15"
output = "0.60"
max_output = 16384
"#;

    fn usd() -> Currency {
        Currency::Money(IsoCode::new("USD").expect("USD"))
    }

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("prices.toml");
        std::fs::write(&p, text).expect("write");
        p
    }

    #[test]
    fn a_model_is_quoted_its_worst_case_and_an_unpriced_one_is_named() {
        let dir = tempdir();
        let p = write(&dir, SHEET);
        let pricing = Pricing {
            prices: Arc::new(Prices::load(&p, usd()).expect("loads")),
            model: ModelSource::parse("/model").expect("pointer"),
        };
        let input = serde_json::json!({"model": "gpt-4o-mini", "max_tokens": 100});
        let q = pricing.quote(&input).expect("priced");
        let bytes = input.to_string().len() as u128;
        // ceil((bytes × 150,000 + 100 × 600,000) / 10^6) micro-USD.
        let want = (bytes * 150_000 + 100 * 600_000).div_ceil(1_000_000) as u64;
        assert_eq!(q.reserve, want);
        assert_eq!(q.applied.model, "gpt-4o-mini");
        let e = pricing
            .quote(&serde_json::json!({"model": "o1", "max_tokens": 1}))
            .unwrap_err();
        assert!(e.to_string().contains("\"o1\""), "{e}");
        let e = pricing
            .quote(&serde_json::json!({"max_tokens": 1}))
            .unwrap_err();
        assert!(e.to_string().contains("/model"), "{e}");
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_broken_one_keeps_the_old_prices() {
        let dir = tempdir();
        let p = write(&dir, SHEET);
        let prices = Prices::load(&p, usd()).expect("loads");
        assert!(!prices.reload().expect("unchanged"));
        let before = prices.sheet();
        // Another length: seen as changed even within the clock's resolution.
        std::fs::write(&p, SHEET.replace("\"0.60\"", "\"0.625\"")).expect("write");
        assert!(prices.reload().expect("reloads"));
        let entry_output = |s: &PriceSheet| s.entry("gpt-4o-mini").map(|e| e.output);
        assert_eq!(entry_output(&prices.sheet()), Some(625_000));
        assert_eq!(entry_output(&before), Some(600_000));
        std::fs::write(&p, "currency = \"USD\"\n[models.x]\ninput = \"-1\"\n").expect("write");
        let e = prices.reload().unwrap_err().to_string();
        assert!(e.contains("models.x"), "{e}");
        assert_eq!(entry_output(&prices.sheet()), Some(625_000), "still in use");
    }

    #[test]
    fn a_model_is_a_pointer_or_a_name() {
        assert!(matches!(
            ModelSource::parse("/model"),
            Ok(ModelSource::From(_))
        ));
        assert_eq!(
            ModelSource::parse("gpt-4o"),
            Ok(ModelSource::Fixed("gpt-4o".into()))
        );
        assert!(ModelSource::parse("").is_err());
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "tollgate-prices-{}-{}",
            std::process::id(),
            crate::job::nonce()
        ));
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }
}
