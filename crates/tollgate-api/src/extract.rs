//! [`JsonBody`]: the JSON extractor of the api, whose rejections are problems that
//! name the field: 415 without a JSON content type, 413 past the body limit, 400
//! for malformed JSON, 422 for a value of the wrong shape.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Query, RawPathParams, Request};
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::problem::{echo, ApiError};

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

/// The body of a call, which must be a JSON object: anything else is a 422
/// naming `$`, `detail` saying what the object is to the route.
pub fn json_object(
    body: Result<JsonBody<serde_json::Value>, ApiError>,
    detail: &str,
) -> Result<serde_json::Value, ApiError> {
    let JsonBody(input) = body?;
    if !input.is_object() {
        return Err(ApiError::InvalidField {
            field: "$".into(),
            detail: detail.into(),
        });
    }
    Ok(input)
}

/// The route's single path parameter, percent-decoded; a parameter that is not
/// UTF-8 is a 400 problem rather than axum's plain-text rejection.
#[derive(Debug, Clone)]
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let params = RawPathParams::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::Malformed {
                detail: format!("bad path parameter: {e}"),
                field: None,
            })?;
        let value = params.iter().next().map(|(_, v)| v.to_owned());
        value
            .map(PathParam)
            .ok_or_else(|| ApiError::Internal("route has no path parameter".into()))
    }
}

/// The query string as `T`: one that does not parse is a 400 (`bad query:
/// …`) naming no field.
#[derive(Debug, Clone)]
pub struct QueryParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Query(q) = Query::<T>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::Malformed {
                detail: format!("bad query: {}", e.body_text()),
                field: None,
            })?;
        Ok(Self(q))
    }
}

/// The `T` a layer put in the request's extensions; `missing()` when none did.
pub(crate) fn extension<T: Clone + Send + Sync + 'static>(
    parts: &Parts,
    missing: impl FnOnce() -> ApiError,
) -> Result<T, ApiError> {
    parts.extensions.get::<T>().cloned().ok_or_else(missing)
}

/// Query flags of the form `name=true|false|1|0` (or a bare `name`); unknown
/// names are ignored, a bad value is a 400 naming the parameter.
#[derive(Debug, Clone, Default)]
pub struct Flags(Vec<(String, bool)>);

impl Flags {
    pub fn get(&self, name: &str) -> Option<bool> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Flags {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let mut flags = Vec::new();
        for pair in parts.uri.query().unwrap_or("").split('&') {
            if pair.is_empty() {
                continue;
            }
            let (name, value) = pair.split_once('=').unwrap_or((pair, "true"));
            let value = match value {
                "true" | "1" | "" => true,
                "false" | "0" => false,
                other => {
                    return Err(ApiError::Malformed {
                        detail: format!(
                            "query parameter {}: expected true or false, got {:?}",
                            echo(name),
                            echo(other)
                        ),
                        field: Some(echo(name)),
                    })
                }
            };
            flags.push((name.to_owned(), value));
        }
        Ok(Flags(flags))
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
        user: tollgate_core::id::UserId,
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
