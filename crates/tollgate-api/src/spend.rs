//! `GET /admin/spend`: spend reports by user, organisation, model, operation
//! or provider, per hour or day, in JSON or CSV, from the ledger's rollups
//! (the report itself is `tollgate_core::spend::report`).

use axum::extract::State;
use axum::http::header::{ACCEPT, CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tollgate_core::spend::{report, SpendError, SpendQuery, SpendQueryError};

use crate::dashboard::access::Operator;
use crate::extract::QueryParams;
use crate::problem::ApiError;
use crate::state::ApiState;

/// The header a CSV page carries its `next_cursor` in (JSON: in the body).
pub const NEXT_CURSOR: &str = "tollgate-next-cursor";

#[derive(Debug, Deserialize)]
pub struct SpendParams {
    pub by: Option<String>,
    pub step: Option<String>,
    pub from: Option<String>,
    pub to: Option<String>,
    pub cursor: Option<String>,
    pub limit: Option<usize>,
    pub format: Option<String>,
}

fn malformed(field: &str, detail: String) -> ApiError {
    ApiError::Malformed {
        detail: format!("query parameter {detail}"),
        field: Some(field.to_owned()),
    }
}

/// The request's report, checked: a bad parameter is a 400 or a 422 naming it.
pub fn query(q: &SpendParams, now_ms: u64) -> Result<SpendQuery, ApiError> {
    let Some(by) = q.by.as_deref() else {
        return Err(malformed(
            "by",
            "by: required (user, org, model, operation or provider)".into(),
        ));
    };
    SpendQuery::new(
        by,
        q.step.as_deref(),
        q.from.as_deref(),
        q.to.as_deref(),
        q.cursor.as_deref(),
        q.limit,
        now_ms,
    )
    .map_err(|e| {
        // A value the document's schema refuses (a `by` or `step` outside
        // its enum, a `limit` out of range) is a malformed request; a string
        // the schema allows that names no time, a range backwards or too
        // long, or a cursor not ours is a 422 naming the field.
        let (field, schema) = match &e {
            SpendQueryError::By(_) => ("by", true),
            SpendQueryError::Step(_) => ("step", true),
            SpendQueryError::Limit(_) => ("limit", true),
            SpendQueryError::Time(name, _) => (*name, false),
            SpendQueryError::Range => ("to", false),
            SpendQueryError::TooLong(_) => ("from", false),
            SpendQueryError::Cursor => ("cursor", false),
        };
        if schema {
            malformed(field, e.to_string())
        } else {
            invalid(field, e.to_string())
        }
    })
}

fn invalid(field: &str, detail: String) -> ApiError {
    ApiError::InvalidField {
        field: field.to_owned(),
        detail: format!("query parameter {detail}"),
    }
}

/// `format=csv|json`, else `Accept: text/csv` asks for CSV.
fn wants_csv(format: Option<&str>, headers: &HeaderMap) -> Result<bool, ApiError> {
    match format {
        Some("csv") => Ok(true),
        Some("json") => Ok(false),
        Some(other) => Err(malformed(
            "format",
            format!("format: must be json or csv, got {other:?}"),
        )),
        None => Ok(headers
            .get_all(ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|m| m.split(';').next().map(str::trim) == Some("text/csv"))),
    }
}

/// `GET /admin/spend?by=&step=&from=&to=&cursor=&limit=&format=`
pub async fn spend(
    _: Operator,
    State(state): State<ApiState>,
    headers: HeaderMap,
    QueryParams(q): QueryParams<SpendParams>,
) -> Result<Response, ApiError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let query = query(&q, now)?;
    let csv = wants_csv(q.format.as_deref(), &headers)?;
    let currency = state.config.currency();
    let page = report(
        state.ledger.as_ref(),
        state.keys.as_ref(),
        &query,
        &currency.to_string(),
    )
    .await
    .map_err(|e| match e {
        SpendError::Ledger(e) => ApiError::from(e),
        SpendError::Keys(e) => ApiError::from(e),
        SpendError::Users(e) => invalid("cursor", e.to_string()),
    })?;
    let mut response = if csv {
        let mut r = page.to_csv(currency).into_response();
        r.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/csv; charset=utf-8"),
        );
        if let Some(next) = page
            .next_cursor
            .as_deref()
            .and_then(|c| HeaderValue::from_str(c).ok())
        {
            r.headers_mut().insert(NEXT_CURSOR, next);
        }
        r
    } else {
        axum::Json(page.to_json(currency)).into_response()
    };
    response
        .headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}
