//! [`ModelFrom`]: where in a request its model's name is, to look up its price.

use serde_json::Value;

/// Where a request names its model: a JSON pointer, `/model` by default (the
/// OpenAI and Anthropic APIs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFrom(String);

impl Default for ModelFrom {
    fn default() -> Self {
        Self("/model".into())
    }
}

/// Why a request's model could not be read (the caller answers 422).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("the request names no model: nothing at {pointer}")]
    Missing { pointer: String },
    #[error("the model at {pointer} must be a string, got {found}")]
    NotAString {
        pointer: String,
        found: &'static str,
    },
    #[error("the model at {pointer} is an empty string")]
    Empty { pointer: String },
}

impl ModelFrom {
    /// Reads the model at `pointer`, a JSON pointer (starting with `/`).
    /// Returns a message fit to follow the key's name.
    pub fn new(pointer: &str) -> Result<Self, String> {
        if !pointer.starts_with('/') {
            return Err(format!(
                "must be a JSON pointer starting with /, got {pointer:?}"
            ));
        }
        Ok(Self(pointer.to_owned()))
    }

    /// The JSON pointer.
    pub fn pointer(&self) -> &str {
        &self.0
    }

    /// The model `request` names: a non-empty string at the pointer.
    pub fn model<'a>(&self, request: &'a Value) -> Result<&'a str, ModelError> {
        let pointer = || self.0.clone();
        let found = match request.pointer(&self.0) {
            None | Some(Value::Null) => return Err(ModelError::Missing { pointer: pointer() }),
            Some(Value::String(s)) if s.is_empty() => {
                return Err(ModelError::Empty { pointer: pointer() })
            }
            Some(Value::String(s)) => return Ok(s),
            Some(Value::Bool(_)) => "a boolean",
            Some(Value::Number(_)) => "a number",
            Some(Value::Array(_)) => "an array",
            Some(Value::Object(_)) => "an object",
        };
        Err(ModelError::NotAString {
            pointer: pointer(),
            found,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_the_model_or_says_why_not() {
        let m = ModelFrom::default();
        assert_eq!(m.pointer(), "/model");
        assert_eq!(m.model(&json!({"model": "gpt-4o-mini"})), Ok("gpt-4o-mini"));
        let e = m.model(&json!({"messages": []})).unwrap_err();
        assert!(
            e.to_string().contains("no model") && e.to_string().contains("/model"),
            "{e}"
        );
        let e = m.model(&json!({"model": null})).unwrap_err();
        assert_eq!(
            e,
            ModelError::Missing {
                pointer: "/model".into()
            }
        );
        let e = m.model(&json!({"model": 4})).unwrap_err();
        assert!(
            e.to_string().contains("must be a string, got a number"),
            "{e}"
        );
        let e = m.model(&json!({"model": ""})).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        assert!(m.model(&json!("gpt-4o")).is_err(), "not an object");

        let nested = ModelFrom::new("/config/model").unwrap();
        assert_eq!(nested.model(&json!({"config": {"model": "m"}})), Ok("m"));
        let e = ModelFrom::new("model").unwrap_err();
        assert!(e.contains("JSON pointer") && e.contains("\"model\""), "{e}");
    }
}
