//! [`JsonBody`]: the JSON extractor of the api, whose rejections are problems that
//! name the field: 415 without a JSON content type, 413 past the body limit, 400
//! for malformed JSON, 422 for a value of the wrong shape.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::CONTENT_TYPE;
use serde::de::DeserializeOwned;

use crate::problem::ApiError;

/// A JSON request body of type `T`.
#[derive(Debug, Clone)]
pub struct JsonBody<T>(pub T);

fn is_json(req: &Request) -> bool {
    let Some(ct) = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(&req) {
            return Err(ApiError::UnsupportedMediaType(
                "send the body as JSON with Content-Type: application/json".into(),
            ));
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge
            } else {
                ApiError::Malformed {
                    detail: format!("cannot read the body: {e}"),
                    field: None,
                }
            }
        })?;
        parse(&bytes).map(JsonBody)
    }
}

/// Parses `bytes` as `T`, naming the offending field on failure.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let message = inner.to_string();
            if inner.is_syntax() || inner.is_eof() || inner.is_io() {
                return Err(ApiError::Malformed {
                    detail: format!("malformed JSON: {message}"),
                    field: None,
                });
            }
            // serde names a missing field only in its message.
            let field = match message
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
            {
                Some(missing) if path == "." => missing.to_owned(),
                Some(missing) => format!("{path}.{missing}"),
                None => path,
            };
            let detail = match message.find(" at line ") {
                Some(i) => message[..i].to_owned(),
                None => message,
            };
            Err(ApiError::InvalidField {
                detail: format!("{field}: {detail}"),
                field,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Create {
        user: tollgate_core::UserId,
        plan: String,
    }

    fn field(body: &str) -> (u16, Option<String>) {
        let e = parse::<Create>(body.as_bytes()).unwrap_err();
        (e.status().as_u16(), e.problem().field)
    }

    #[test]
    fn names_the_field() {
        assert_eq!(field("{\"user\": \"a\"}"), (422, Some("plan".into())));
        assert_eq!(
            field("{\"user\": \"a:b\", \"plan\": \"pro\"}"),
            (422, Some("user".into()))
        );
        assert_eq!(
            field("{\"user\": \"a\", \"plan\": 3}"),
            (422, Some("plan".into()))
        );
        assert_eq!(field("{\"user\": "), (400, None));
        assert_eq!(field("nope"), (400, None));
        let (status, f) = field("{\"user\": \"a\", \"plan\": \"p\", \"x\": 1}");
        assert_eq!(status, 422, "{f:?}");
    }
}
