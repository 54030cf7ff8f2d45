//! Who may see the dashboard: the admin and viewer tokens (as `Authorization:
//! Bearer`, or through the login form), and the login sessions they open.
//!
//! **Sessions** live in the backend's [`SessionStore`] (Redis for pods, memory
//! for the embedded mode); the cookie holds only a random session id. Logout
//! deletes the session, so the cookie is refused by every pod at once. A
//! session ends [`SESSION_LIFETIME`] after login, after [`SESSION_IDLE`]
//! without a request, at logout, or when the token that opened it changes.
//! The cookie is `HttpOnly; SameSite=Strict; Path=/`, and `Secure` when the
//! request came through the trusted proxy (`--trusted-proxy-header`) with
//! `X-Forwarded-Proto: https` (or `Forwarded: proto=https`).
//!
//! **Forms.** Login and logout refuse cross-site requests (`Sec-Fetch-Site`,
//! else `Origin` against `Host`); logout also needs the session's CSRF token,
//! which the page reads from `GET /dashboard/session`.
//!
//! **Wrong tokens** (Bearer or form) count against the client address in one
//! [`AuthFailures`] limiter; an address over its budget gets 429 (the form:
//! `?login=limited`) for wrong tokens only: the right token is compared first
//! and always passes, so a flood of guesses cannot lock the admin out. (What
//! stops guessing is the tokens' length, at least 16 characters; the limiter
//! bounds its rate and noise.)

use axum::body::Body;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::{
    AUTHORIZATION, CACHE_CONTROL, COOKIE, HOST, LOCATION, ORIGIN, SET_COOKIE,
};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use std::time::Duration;
use tollgate_core::keystore::secrets_equal;
use tollgate_core::session::{
    credential_digest, csrf_token, NewSession, Role, Session, SessionId, SessionLimits,
};

use crate::problem::ApiError;
use crate::state::ApiState;

/// The session cookie's name.
pub const COOKIE_NAME: &str = "tollgate_dashboard";
/// The longest a session lasts from login, however active.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// A session without a request for this long ends (an open page polls every
/// second, so only a closed one idles).
pub const SESSION_IDLE: Duration = Duration::from_secs(30 * 60);
/// Largest login or logout form body.
const FORM_BODY_LIMIT: usize = 4096;

/// The role of a configured token `presented` is, if any: compared with both
/// tokens, in constant time, whatever it matches. A blank token is no token.
pub fn token_role(state: &ApiState, presented: &str) -> Option<Role> {
    if presented.trim().is_empty() {
        return None;
    }
    let matches = |token: Option<&str>| token.is_some_and(|t| secrets_equal(presented, t));
    let admin = matches(state.settings.admin_token.as_deref());
    let viewer = matches(state.settings.viewer_token.as_deref());
    match (admin, viewer) {
        (true, _) => Some(Role::Admin),
        (false, true) => Some(Role::Viewer),
        (false, false) => None,
    }
}

/// A wrong admin or viewer token from this request's client: 429 when the
/// address is (or now goes) over its budget of failures, else `unauthorized`.
pub fn wrong_token(state: &ApiState, req: &Request, unauthorized: &'static str) -> ApiError {
    let failures = state.dashboard.failures();
    let client = failures.client(req);
    // Logged while counted: an address over its budget floods no log.
    if let Some(wait) = failures.wait(client) {
        return ApiError::AuthFailures(wait);
    }
    tracing::info!(%client, "wrong admin or viewer token");
    match failures.failed(client) {
        Some(wait) => ApiError::AuthFailures(wait),
        None => ApiError::Unauthorized(unauthorized),
    }
}

/// The role of the request's `Authorization: Bearer` token: a wrong one goes
/// through [`wrong_token`].
pub fn bearer_role(parts: &Parts, state: &ApiState) -> Result<Role, ApiError> {
    let presented = crate::auth::bearer(&parts.headers).unwrap_or("");
    token_role(state, presented).ok_or_else(|| {
        let req = Request::from_parts(parts.clone(), Body::empty());
        wrong_token(state, &req, "wrong admin or viewer token")
    })
}

/// The live session the request's cookie names, if any; its idle time
/// restarts. A session whose token was changed since is ended here.
pub async fn session(
    headers: &HeaderMap,
    state: &ApiState,
) -> Result<Option<(SessionId, Session)>, ApiError> {
    let Some(id) = cookie(headers).and_then(SessionId::parse) else {
        return Ok(None);
    };
    let store = state.dashboard.sessions();
    let Some(session) = store.touch(&id.hash(), SESSION_IDLE).await? else {
        return Ok(None);
    };
    let token = match session.role {
        Role::Admin => state.settings.admin_token.as_deref(),
        Role::Viewer => state.settings.viewer_token.as_deref(),
    };
    if !token.is_some_and(|t| secrets_equal(&credential_digest(t), &session.credential)) {
        store.close(&id.hash()).await?;
        return Ok(None);
    }
    Ok(Some((id, session)))
}

/// Proof of access to the dashboard's read-only routes: the admin or viewer
/// token as Bearer, or a live session.
#[derive(Debug, Clone)]
pub struct Operator {
    pub role: Role,
    /// The session, when the cookie (not a Bearer token) let the request in.
    pub session: Option<Session>,
}

/// What a request to the admin or dashboard routes presents.
#[derive(Debug)]
pub enum Credential {
    /// A right admin or viewer token as `Authorization: Bearer`.
    Bearer(Role),
    /// No `Authorization`: the live session of its cookie, if any.
    Session(Option<Session>),
}

/// The request's credential, once the admin routes are on (a configured admin
/// token; else `AdminDisabled`). A wrong token is refused here (401, or 429
/// past its address's budget of failures).
pub async fn credential(parts: &Parts, state: &ApiState) -> Result<Credential, ApiError> {
    if state.settings.admin_token.is_none() {
        return Err(ApiError::AdminDisabled);
    }
    if parts.headers.contains_key(AUTHORIZATION) {
        return bearer_role(parts, state).map(Credential::Bearer);
    }
    let session = session(&parts.headers, state).await?;
    Ok(Credential::Session(session.map(|(_, s)| s)))
}

impl FromRequestParts<ApiState> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, ApiError> {
        match credential(parts, state).await? {
            Credential::Bearer(role) => Ok(Operator {
                role,
                session: None,
            }),
            Credential::Session(Some(s)) => Ok(Operator {
                role: s.role,
                session: Some(s),
            }),
            Credential::Session(None) => Err(ApiError::Unauthorized(
                "log in at /dashboard, or send Authorization: Bearer <admin or viewer token>",
            )),
        }
    }
}

/// `GET /dashboard/session`: what the page needs of its session.
#[derive(Debug, Serialize)]
struct SessionView {
    role: &'static str,
    /// Put in every state-changing form (logout); `None` for a Bearer token.
    csrf: Option<String>,
    /// When the session ends at the latest (ms since the epoch).
    expires_ms: Option<u64>,
}

pub async fn session_view(operator: Operator) -> Response {
    let view = SessionView {
        role: operator.role.as_str(),
        csrf: operator.session.as_ref().map(|s| s.csrf.clone()),
        expires_ms: operator.session.as_ref().map(|s| s.expires_ms),
    };
    let mut r = axum::Json(view).into_response();
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// A cross-site form: refused. `Sec-Fetch-Site` when the browser sends it,
/// else `Origin` against `Host`; a request with neither (not a browser's
/// cross-site form) passes.
fn same_origin(headers: &HeaderMap) -> Result<(), ApiError> {
    let refused = || {
        ApiError::CrossSite(
            "a cross-site request: the dashboard's forms are accepted only from its own page",
        )
    };
    let mut sites = headers.get_all("sec-fetch-site").iter().peekable();
    if sites.peek().is_some() {
        return match sites.all(|site| matches!(site.as_bytes(), b"same-origin" | b"none")) {
            true => Ok(()),
            false => Err(refused()),
        };
    }
    let Some(origin) = headers.get(ORIGIN) else {
        return Ok(());
    };
    let origin = origin.to_str().unwrap_or("");
    let authority = origin.split_once("://").map(|(_, a)| a);
    let host = headers.get(HOST).and_then(|h| h.to_str().ok());
    match (authority, host) {
        (Some(a), Some(h)) if a.eq_ignore_ascii_case(h) => Ok(()),
        _ => Err(refused()),
    }
}

/// Whether the request reached the trusted proxy over https: only when a
/// proxy is trusted (`--trusted-proxy-header`), from the last entry of
/// `X-Forwarded-Proto` or the last `proto=` of `Forwarded`.
fn behind_https(state: &ApiState, headers: &HeaderMap) -> bool {
    if state.settings.trusted_proxy_header.is_none() {
        return false;
    }
    let last = |name: &str| {
        headers
            .get_all(name)
            .iter()
            .next_back()
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit(',').next())
            .map(|v| v.trim().to_ascii_lowercase())
    };
    let forwarded_proto = last("forwarded").and_then(|element| {
        element.split(';').find_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (k.trim() == "proto").then(|| v.trim().trim_matches('"').to_owned())
        })
    });
    last("x-forwarded-proto").as_deref() == Some("https")
        || forwarded_proto.as_deref() == Some("https")
}

fn set_cookie(value: &str, max_age: u64, secure: bool) -> String {
    format!(
        "{COOKIE_NAME}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}{}",
        if secure { "; Secure" } else { "" }
    )
}

fn see(location: &'static str, cookie: Option<String>) -> Response {
    let mut r = StatusCode::SEE_OTHER.into_response();
    r.headers_mut()
        .insert(LOCATION, HeaderValue::from_static(location));
    if let Some(c) = cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        r.headers_mut().insert(SET_COOKIE, c);
    }
    r
}

async fn form(req: Request) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(req.into_body(), FORM_BODY_LIMIT)
        .await
        .map_err(|_| ApiError::PayloadTooLarge)
}

/// `POST /dashboard/login` (form: `token=<admin or viewer token>`): opens a
/// session, sets its cookie and goes back to the page; a wrong token goes
/// back with `?login=failed` (and counts against the address), or
/// `?login=limited` once the address is over its budget of failures.
pub async fn login(State(state): State<ApiState>, req: Request) -> Result<Response, ApiError> {
    if state.settings.admin_token.is_none() {
        return Err(ApiError::AdminDisabled);
    }
    same_origin(req.headers())?;
    let secure = behind_https(&state, req.headers());
    let failures = state.dashboard.failures();
    let client = failures.client(&req);
    let body = form(req).await?;
    let token = form_field(&body, "token").unwrap_or_default();
    // The right token first: an address over its budget still logs in with it.
    let Some(role) = token_role(&state, &token) else {
        if failures.wait(client).is_some() {
            return Ok(see("/dashboard?login=limited", None));
        }
        tracing::info!(%client, "dashboard login refused: wrong token");
        return Ok(match failures.failed(client) {
            Some(_) => see("/dashboard?login=limited", None),
            None => see("/dashboard?login=failed", None),
        });
    };
    let id = SessionId::generate()?;
    let new = NewSession {
        role,
        csrf: csrf_token()?,
        credential: credential_digest(&token),
    };
    let limits = SessionLimits {
        lifetime: SESSION_LIFETIME,
        idle: SESSION_IDLE,
    };
    state
        .dashboard
        .sessions()
        .open(&id.hash(), &new, limits)
        .await?;
    tracing::info!(%client, role = role.as_str(), "dashboard login");
    Ok(see(
        "/dashboard",
        Some(set_cookie(id.expose(), SESSION_LIFETIME.as_secs(), secure)),
    ))
}

/// `POST /dashboard/logout` (form: `csrf=<the session's CSRF token>`): ends
/// the session in the store (every pod refuses its cookie from then on) and
/// clears the cookie. Cross-site, or without the session's CSRF token: 403,
/// and the session stays.
pub async fn logout(State(state): State<ApiState>, req: Request) -> Result<Response, ApiError> {
    same_origin(req.headers())?;
    let secure = behind_https(&state, req.headers());
    let clear = Some(set_cookie("", 0, secure));
    let Some((id, session)) = session(req.headers(), &state).await? else {
        return Ok(see("/dashboard", clear));
    };
    let body = form(req).await?;
    let csrf = form_field(&body, "csrf").unwrap_or_default();
    if !secrets_equal(&csrf, &session.csrf) {
        return Err(ApiError::CrossSite(
            "logout needs this session's CSRF token (the csrf form field)",
        ));
    }
    state.dashboard.sessions().close(&id.hash()).await?;
    tracing::info!(role = session.role.as_str(), "dashboard logout");
    Ok(see("/dashboard", clear))
}

/// The value of `name` in an `application/x-www-form-urlencoded` body.
fn form_field(body: &[u8], name: &str) -> Option<String> {
    body.split(|b| *b == b'&').find_map(|pair| {
        let mut kv = pair.splitn(2, |b| *b == b'=');
        let key = percent_decode(kv.next()?)?;
        (key == name).then(|| percent_decode(kv.next().unwrap_or(b"")))?
    })
}

fn percent_decode(s: &[u8]) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while let Some(&b) = s.get(i) {
        match b {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE_NAME)?.strip_prefix('='))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn form_fields_are_decoded() {
        assert_eq!(
            form_field(b"a=1&token=s%20e+c%2Fr", "token").as_deref(),
            Some("s e c/r")
        );
        assert_eq!(form_field(b"token=%zz", "token"), None);
        assert_eq!(form_field(b"other=1", "token"), None);
    }

    #[test]
    fn cross_site_forms_are_refused() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert!(same_origin(&headers(&[])).is_ok());
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-origin")])).is_ok());
        assert!(same_origin(&headers(&[("sec-fetch-site", "cross-site")])).is_err());
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-site")])).is_err());
        let local = [
            ("host", "127.0.0.1:8080"),
            ("origin", "http://127.0.0.1:8080"),
        ];
        assert!(same_origin(&headers(&local)).is_ok());
        let evil = [
            ("host", "127.0.0.1:8080"),
            ("origin", "https://evil.example"),
        ];
        assert!(same_origin(&headers(&evil)).is_err());
        assert!(same_origin(&headers(&[("host", "a"), ("origin", "null")])).is_err());
    }

    #[test]
    fn cookies_are_found_among_others() {
        let mut h = HeaderMap::new();
        h.insert(
            COOKIE,
            HeaderValue::from_static("a=1; tollgate_dashboard=abc; b=2"),
        );
        assert_eq!(cookie(&h), Some("abc"));
        assert_eq!(
            set_cookie("v", 10, true),
            "tollgate_dashboard=v; HttpOnly; SameSite=Strict; Path=/; Max-Age=10; Secure"
        );
    }
}
