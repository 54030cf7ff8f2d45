//! [`Applied`]: the prices a call was reserved at, kept with its job so that
//! its settle prices the usage at them, whatever the sheet says by then (an
//! operator may reload it while the call runs), and so that the export can
//! say which prices applied.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{Entry, UnitPrice};

/// The model a call named and the sheet entry that priced it, as reserved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The model the request named (or the operation's fixed one).
    pub model: String,
    /// The entry of the sheet that priced it.
    pub entry: Entry,
}

impl Applied {
    /// A compact JSON text of it, for a job record (about 100 bytes): the
    /// model, the entry's key and its prices, with what only the reservation
    /// needed (`max_output`, unit bounds) left out.
    pub fn to_text(&self) -> String {
        let e = &self.entry;
        let units: BTreeMap<&str, u64> = e
            .units
            .iter()
            .map(|(pointer, u)| (pointer.as_str(), u.price))
            .collect();
        let mut v = json!({
            "m": self.model,
            "k": e.key,
            "p": [e.input, e.cached_input, e.cache_write, e.output, e.reasoning, e.request],
        });
        if !units.is_empty() {
            v["u"] = json!(units);
        }
        v.to_string()
    }

    /// Reads [`to_text`](Self::to_text)'s form back; `None` when it is not
    /// one (a record written by something else: the caller treats the call as
    /// unpriced and keeps its reservation).
    pub fn parse(text: &str) -> Option<Self> {
        let v: Value = serde_json::from_str(text).ok()?;
        let model = v.get("m")?.as_str()?.to_owned();
        let key = v.get("k")?.as_str()?.to_owned();
        let p: Vec<u64> = v
            .get("p")?
            .as_array()?
            .iter()
            .map(Value::as_u64)
            .collect::<Option<_>>()?;
        let [input, cached_input, cache_write, output, reasoning, request] = p[..] else {
            return None;
        };
        let mut units = BTreeMap::new();
        if let Some(u) = v.get("u") {
            for (pointer, price) in u.as_object()? {
                units.insert(
                    pointer.clone(),
                    UnitPrice {
                        price: price.as_u64()?,
                        max: None,
                    },
                );
            }
        }
        Some(Self {
            model,
            entry: Entry {
                key,
                input,
                cached_input,
                cache_write,
                output,
                reasoning,
                request,
                max_output: None,
                units,
            },
        })
    }

    /// The prices as the export gives them, in the sheet's own terms (exact
    /// decimal strings of the currency): per 1,000,000 tokens of each kind
    /// (`input`, `cached_input`, `cache_write`, `output`, `reasoning`), per
    /// `request`, and per unit at each pointer (`units`). A call's cost is
    /// Σ count × price + request, rounded up once to the micro-unit.
    pub fn export(&self) -> Value {
        use crate::money::{format_scaled, MONEY_SCALE};
        let e = &self.entry;
        // Prices are picounits per token: per million tokens, 6 places; a
        // request's or a unit's, 12.
        let per_million = |p: u64| format_scaled(u128::from(p), MONEY_SCALE);
        let each = |p: u64| format_scaled(u128::from(p), 2 * MONEY_SCALE);
        let mut v = json!({
            "input": per_million(e.input),
            "cached_input": per_million(e.cached_input),
            "cache_write": per_million(e.cache_write),
            "output": per_million(e.output),
            "reasoning": per_million(e.reasoning),
            "request": each(e.request),
        });
        if !e.units.is_empty() {
            let units: BTreeMap<&str, String> = e
                .units
                .iter()
                .map(|(pointer, u)| (pointer.as_str(), each(u.price)))
                .collect();
            v["units"] = json!(units);
        }
        v
    }

    /// What `answer`'s usage costs at these prices, in minor units; `None`
    /// when it reports none (the call then keeps its reservation).
    pub fn cost_of(&self, answer: &Value) -> Option<u64> {
        Some(self.entry.cost(&self.entry.usage(answer)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied() -> Applied {
        let mut units = BTreeMap::new();
        units.insert(
            "/usage/results".to_owned(),
            UnitPrice {
                price: 5_000_000_000,
                max: Some(10),
            },
        );
        Applied {
            model: "gpt-4o-mini-2024-07-18".into(),
            entry: Entry {
                key: "models.\"gpt-4o-mini*\"".into(),
                input: 150_000,
                cached_input: 75_000,
                cache_write: 150_000,
                output: 600_000,
                reasoning: 600_000,
                request: 1_000_000,
                max_output: Some(16_384),
                units,
            },
        }
    }

    #[test]
    fn the_text_reads_back_to_the_same_prices() {
        let a = applied();
        let back = Applied::parse(&a.to_text()).expect("reads back");
        let mut want = a.clone();
        want.entry.max_output = None;
        for u in want.entry.units.values_mut() {
            u.max = None;
        }
        assert_eq!(back, want);
        // The same usage costs the same at the prices read back.
        let answer = json!({"usage": {"prompt_tokens": 1234, "completion_tokens": 567,
            "prompt_tokens_details": {"cached_tokens": 1000}, "results": 3}});
        assert_eq!(back.cost_of(&answer), a.cost_of(&answer));
        assert!(back.cost_of(&answer).is_some_and(|c| c > 0));
    }

    #[test]
    fn anything_else_is_not_read() {
        for bad in [
            "",
            "{}",
            "[1,2]",
            r#"{"m":"x","k":"d","p":[1,2,3]}"#,
            r#"{"m":"x","k":"d","p":[1,2,3,4,5,-6]}"#,
            r#"{"m":"x","k":"d","p":[1,2,3,4,5,6],"u":{"/a":"1"}}"#,
            r#"{"m":1,"k":"d","p":[1,2,3,4,5,6]}"#,
        ] {
            assert_eq!(Applied::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn no_usage_is_no_cost() {
        assert_eq!(applied().cost_of(&json!({"choices": []})), None);
    }
}
