//! Authentication: `Authorization: Bearer <key>` for users, checked against the
//! [`KeyStore`](tollgate_core::KeyStore) by the key's SHA-256; the admin token
//! (`TOLLGATE_ADMIN_TOKEN`) for `/admin/*`, compared in constant time.

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tollgate_core::keystore::secrets_equal;
use tollgate_core::{KeyHash, UserId};

use crate::problem::ApiError;
use crate::state::ApiState;

/// The authenticated caller, put into the request extensions by [`authenticate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub user: UserId,
    pub key_id: String,
}

fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let value = headers
        .get(AUTHORIZATION)
        .ok_or(ApiError::Unauthorized(
            "missing Authorization: Bearer <api key>",
        ))?
        .to_str()
        .map_err(|_| ApiError::Unauthorized("malformed Authorization header"))?;
    let (scheme, token) = value.split_once(' ').ok_or(ApiError::Unauthorized(
        "expected Authorization: Bearer <api key>",
    ))?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(ApiError::Unauthorized(
            "expected Authorization: Bearer <api key>",
        ));
    }
    Ok(token.trim())
}

/// Middleware of the user routes: resolves the bearer key to a [`Caller`] (and
/// its [`UserId`], which the [`Cost`](crate::cost::Cost) layer charges), or
/// answers 401.
pub async fn authenticate(State(state): State<ApiState>, mut req: Request, next: Next) -> Response {
    // Hash first: the request (its body is not Sync) must not be borrowed
    // across the store's await.
    let hash = bearer(req.headers()).map(KeyHash::of);
    let caller = async {
        let record = state
            .keys
            .lookup(&hash?)
            .await?
            .ok_or(ApiError::Unauthorized("unknown API key"))?;
        if record.revoked {
            return Err(ApiError::Unauthorized("this API key was revoked"));
        }
        Ok(Caller {
            user: record.user,
            key_id: record.key_id,
        })
    };
    match caller.await {
        Ok(caller) => {
            tracing::Span::current().record("user", caller.user.as_str());
            req.extensions_mut().insert(caller.user.clone());
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or(ApiError::Unauthorized("authentication required"))
    }
}

/// Proof that the request carried the admin token; extract it in admin handlers.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<ApiState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, ApiError> {
        let Some(expected) = state.settings.admin_token.as_deref() else {
            return Err(ApiError::AdminDisabled);
        };
        let presented = bearer(&parts.headers)?;
        if secrets_equal(presented, expected) {
            Ok(Admin)
        } else {
            Err(ApiError::Unauthorized("wrong admin token"))
        }
    }
}
