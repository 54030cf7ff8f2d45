//! The job browser: `GET /admin/jobs` lists jobs (recent, failed, dead; by
//! user, by operation), `GET /admin/jobs/{id}` shows one job's record and
//! timeline. Read-only (the viewer token or a session opens it); an admin
//! cancels a queued job with the operator refund route
//! (`POST /admin/users/{user}/refunds/{request_id}`, the admin token as
//! Bearer: a session never opens a write).
//!
//! Every read is bounded: a page of at most [`MAX_LIMIT`] rows out of the
//! activity log's capped lists (the newest charges, the newest failures),
//! one read of each listed job's timeline, or the newest entries of a dead
//! list; never a scan of the job store. A job older than what the activity
//! log keeps is found by its id (and its user), from its record.
//!
//! There is no retry of a dead letter: the dead list holds entries a worker
//! could not decode (no record, or an unreadable one), so nothing is left to
//! run again, and no operator requeue exists; the browser says so.

use std::collections::HashSet;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tollgate_core::activity::{JobNote, JobStep, EVENTS_CAP, FAILED_CAP, TIMELINES_CAP};
use tollgate_core::id::{RequestId, UserId};
use tollgate_core::job::{FailureCause, JobInfo, JobStatus};
use tollgate_core::money::{Amount, Currency};

use super::access::Operator;
use crate::extract::QueryParams;
use crate::problem::ApiError;
use crate::state::ApiState;

/// Rows per page when the query names no limit.
pub const DEFAULT_LIMIT: usize = 25;
/// The most rows a page holds.
pub const MAX_LIMIT: usize = 100;

/// What `GET /admin/jobs` lists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum View {
    /// The newest charges of jobs (the activity log keeps [`EVENTS_CAP`]).
    #[default]
    Recent,
    /// The newest failures (the activity log keeps [`FAILED_CAP`]).
    Failed,
    /// The newest entries of the dead lists.
    Dead,
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    view: View,
    user: Option<String>,
    operation: Option<String>,
    limit: Option<usize>,
    offset: Option<usize>,
}

/// `GET /admin/jobs`
#[derive(Debug, Serialize)]
pub struct JobList {
    pub view: View,
    /// Money: its ISO 4217 code, in which `cost` is an exact decimal string
    /// (absent for tokens: integers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    pub limit: usize,
    pub offset: usize,
    /// More rows match past this page.
    pub more: bool,
    /// What the list is drawn from.
    pub scope: &'static str,
    pub rows: Vec<JobRow>,
    /// `dead` only: the entries moved aside.
    pub dead: Vec<DeadRow>,
}

#[derive(Debug, Serialize)]
pub struct JobRow {
    pub id: String,
    pub user: String,
    pub operation: String,
    /// When it was charged (recent) or failed (failed).
    pub at_ms: u64,
    /// What the job was charged: its settled charge once it succeeded with
    /// a settle that changed it, else what was reserved.
    pub cost: Option<Amount>,
    /// What was reserved, when the settle made the charge another amount.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved: Option<Amount>,
    /// From its timeline: queued, running, succeeded, failed, refunded, or
    /// unknown (no timeline kept).
    pub state: String,
    pub cause: Option<String>,
    /// Its charge went back (released or refunded).
    pub refunded: bool,
}

#[derive(Debug, Serialize)]
pub struct DeadRow {
    pub operation: String,
    /// The entry as the queue held it (a job id).
    pub entry: String,
    pub reason: String,
}

const RECENT_SCOPE: &str = "the newest job charges the activity log keeps";
const FAILED_SCOPE: &str = "the newest job failures the activity log keeps";
const DEAD_SCOPE: &str =
    "the newest entries of each queue's dead list: entries a worker could not \
                          decode (no record, or an unreadable one); nothing is left to run, so \
                          there is no retry (no operator requeue exists)";

fn bad(field: &str, detail: impl Into<String>) -> ApiError {
    ApiError::InvalidField {
        field: field.into(),
        detail: detail.into(),
    }
}

/// What a job's settle made its charge, if its timeline says (a job that
/// succeeded with a settle that changed the charge).
fn settled_of(steps: &[JobNote]) -> Option<u64> {
    steps.iter().rev().find_map(|s| match s.step {
        JobStep::Succeeded { charged } => charged,
        _ => None,
    })
}

/// The state a timeline ends in.
fn state_of(steps: &[JobNote]) -> (String, Option<String>, bool) {
    let mut state = if steps.is_empty() {
        "unknown"
    } else {
        "queued"
    };
    let mut cause = None;
    let mut refunded = false;
    for s in steps {
        match &s.step {
            JobStep::Charged { .. } => {}
            JobStep::Granted { .. } | JobStep::Started { .. } => {
                if state == "queued" {
                    state = "running";
                }
            }
            JobStep::Succeeded { .. } => state = "succeeded",
            JobStep::Failed { cause: c, .. } => {
                state = "failed";
                cause = Some(c.clone());
            }
            JobStep::Released => refunded = true,
            JobStep::Refunded => {
                refunded = true;
                if state == "queued" || state == "running" {
                    state = "refunded";
                }
            }
        }
    }
    (state.to_owned(), cause, refunded)
}

fn page_bounds(q: &ListQuery) -> Result<(usize, usize), ApiError> {
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if limit == 0 || limit > MAX_LIMIT {
        return Err(bad("limit", format!("limit must be 1 to {MAX_LIMIT}")));
    }
    let offset = q.offset.unwrap_or(0);
    if offset > EVENTS_CAP.max(FAILED_CAP) {
        return Err(bad(
            "offset",
            format!("offset must be at most {}", EVENTS_CAP.max(FAILED_CAP)),
        ));
    }
    Ok((limit, offset))
}

/// `GET /admin/jobs`: see the module docs.
pub async fn list(
    _: Operator,
    State(state): State<ApiState>,
    QueryParams(q): QueryParams<ListQuery>,
) -> Result<Response, ApiError> {
    let (limit, offset) = page_bounds(&q)?;
    let user = q.user.as_deref().filter(|u| !u.is_empty());
    if let Some(u) = user {
        UserId::new(u).map_err(|e| bad("user", format!("user: {e}")))?;
    }
    let operation = q.operation.as_deref().filter(|o| !o.is_empty());
    if let Some(op) = operation {
        if state.config.operation(op).is_none() {
            return Err(ApiError::UnknownOperation(op.to_owned()));
        }
    }
    let matches =
        |u: &str, op: &str| user.is_none_or(|x| x == u) && operation.is_none_or(|x| x == op);
    let activity = state.dashboard.activity.as_ref();
    let currency = state.config.currency();
    let mut list = JobList {
        view: q.view,
        currency: crate::usage::money_code(currency),
        limit,
        offset,
        more: false,
        scope: RECENT_SCOPE,
        rows: Vec::new(),
        dead: Vec::new(),
    };
    match q.view {
        View::Recent => {
            let view = activity.read().await?;
            let mut matching = view.events.iter().filter(|e| {
                e.operation
                    .as_deref()
                    .is_some_and(|op| matches(&e.user, op))
            });
            let page: Vec<_> = matching.by_ref().skip(offset).take(limit).collect();
            list.more = matching.next().is_some();
            let timelines = activity
                .timelines(
                    &page
                        .iter()
                        .map(|e| e.request_id.clone())
                        .collect::<Vec<_>>(),
                )
                .await?;
            list.rows = page
                .into_iter()
                .zip(timelines)
                .map(|(e, steps)| {
                    let steps: Vec<JobNote> =
                        steps.into_iter().filter(|s| s.user == e.user).collect();
                    let (state, cause, refunded) = state_of(&steps);
                    let settled = settled_of(&steps).filter(|&c| c != e.cost);
                    JobRow {
                        id: e.request_id.clone(),
                        user: e.user.clone(),
                        operation: e.operation.clone().unwrap_or_default(),
                        at_ms: e.at_ms,
                        cost: Some(Amount::new(currency, settled.unwrap_or(e.cost))),
                        reserved: settled.map(|_| Amount::new(currency, e.cost)),
                        state,
                        cause,
                        refunded: refunded || e.refunded,
                    }
                })
                .collect();
        }
        View::Failed => {
            list.scope = FAILED_SCOPE;
            let failed = activity.failed(FAILED_CAP).await?;
            let mut matching = failed.iter().filter(|f| matches(&f.user, &f.operation));
            let page: Vec<_> = matching.by_ref().skip(offset).take(limit).collect();
            list.more = matching.next().is_some();
            list.rows = page
                .into_iter()
                .map(|f| JobRow {
                    id: f.id.clone(),
                    user: f.user.clone(),
                    operation: f.operation.clone(),
                    at_ms: f.at_ms,
                    cost: None,
                    reserved: None,
                    state: "failed".into(),
                    refunded: FailureCause::parse(&f.cause).is_some_and(|c| !c.charged()),
                    cause: Some(f.cause.clone()),
                })
                .collect();
        }
        View::Dead => {
            list.scope = DEAD_SCOPE;
            let operations: Vec<String> = match operation {
                Some(op) => vec![op.to_owned()],
                None => state.config.operations().map(|o| o.name.clone()).collect(),
            };
            let reads = operations.iter().map(|op| {
                let jobs = std::sync::Arc::clone(&state.jobs);
                async move { (op, jobs.dead_page(op, offset + limit + 1).await) }
            });
            for (op, page) in futures_util::future::join_all(reads).await {
                for entry in page? {
                    let (entry, reason) = entry.split_once(' ').unwrap_or((entry.as_str(), ""));
                    list.dead.push(DeadRow {
                        operation: op.clone(),
                        entry: entry.to_owned(),
                        reason: reason.to_owned(),
                    });
                }
            }
            list.more = list.dead.len() > offset + limit;
            list.dead = list.dead.into_iter().skip(offset).take(limit).collect();
        }
    }
    Ok(no_store(axum::Json(list).into_response()))
}

fn no_store(mut r: Response) -> Response {
    r.headers_mut().insert(
        axum::http::header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-store"),
    );
    r
}

#[derive(Debug, Deserialize)]
pub struct DetailQuery {
    /// Whose job: needed when the activity log no longer keeps its timeline.
    user: Option<String>,
}

/// `GET /admin/jobs/{id}`
#[derive(Debug, Serialize)]
pub struct JobDetail {
    pub id: String,
    /// Money: its ISO 4217 code (absent for tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// A job (a record or a timeline) was found.
    pub found: bool,
    /// One per user with a job of this id (ids are per user: two users may
    /// send the same Idempotency-Key).
    pub jobs: Vec<JobView>,
    /// Why nothing was found, when nothing was.
    pub note: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct JobView {
    pub user: String,
    /// The job's record; `None`: gone (see `note`).
    pub record: Option<RecordView>,
    /// Queued, waited for the provider, started, outcome, charge: the record's
    /// times and the activity log's steps, oldest first.
    pub timeline: Vec<Entry>,
    /// What became of the charge, and why.
    pub charge: String,
    /// Said when the record is gone, or the timeline is.
    pub note: Option<String>,
    /// Queued: an admin may cancel it (the operator refund route).
    pub cancellable: bool,
}

#[derive(Debug, Serialize)]
pub struct RecordView {
    pub state: &'static str,
    pub operation: String,
    pub provider: String,
    /// Its settled charge, else its reservation.
    pub cost: Amount,
    pub run: u32,
    pub enqueued_at_ms: u64,
    pub deadline_ms: u64,
    pub finished_at_ms: Option<u64>,
    pub cause: Option<String>,
    pub message: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Entry {
    pub at_ms: u64,
    /// queued, granted, started, succeeded, failed, released, refunded,
    /// finished.
    pub step: &'static str,
    pub what: String,
    /// A granted step's pool member (its config name), when its provider
    /// is a pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub member: Option<String>,
}

const FORGOTTEN: &str = "the job's record is gone: a synchronous call without an \
    Idempotency-Key is forgotten once answered, and every record leaves after its result TTL; \
    the timeline is what the activity log kept";
const NO_TIMELINE: &str = "the activity log keeps no timeline of this job any more (it keeps the \
    newest jobs'): the record's times only";

fn record_view(info: &JobInfo, currency: Currency) -> RecordView {
    let (state, cause, message) = match &info.status {
        JobStatus::Queued => ("queued", None, None),
        JobStatus::Running => ("running", None, None),
        JobStatus::Succeeded { .. } => ("succeeded", None, None),
        JobStatus::Failed { cause, message } => (
            "failed",
            Some(cause.as_str().to_owned()),
            Some(message.clone()),
        ),
    };
    RecordView {
        state,
        operation: info.job.operation.clone(),
        provider: info.job.provider.clone(),
        cost: Amount::new(currency, info.job.charged.unwrap_or(info.job.cost)),
        run: info.job.run,
        enqueued_at_ms: info.job.enqueued_at_ms,
        deadline_ms: info.job.deadline_ms,
        finished_at_ms: info.finished_at_ms,
        cause,
        message,
    }
}

fn entry(n: &JobNote, currency: Currency) -> Entry {
    let (step, what) = match &n.step {
        JobStep::Charged { operation, cost } => {
            let cost = Amount::new(currency, *cost);
            ("queued", format!("charged {cost} for {operation}: queued"))
        }
        JobStep::Granted {
            provider,
            waited_us,
            member,
        } => (
            "granted",
            match member {
                Some(m) => format!(
                    "waited {:.1} ms for a slot of {provider}, member {m}",
                    *waited_us as f64 / 1000.0
                ),
                None => format!(
                    "waited {:.1} ms for a slot of {provider}",
                    *waited_us as f64 / 1000.0
                ),
            },
        ),
        JobStep::Started { run } => ("started", format!("run {run} started")),
        JobStep::Succeeded { charged: None } => ("succeeded", "succeeded".to_owned()),
        JobStep::Succeeded { charged: Some(c) } => (
            "succeeded",
            format!("succeeded: charged {}", Amount::new(currency, *c)),
        ),
        JobStep::Failed {
            cause,
            charge_stands,
            message,
            ..
        } => (
            "failed",
            format!(
                "failed ({cause}): {message}{}",
                if *charge_stands {
                    " · the charge stands"
                } else {
                    ""
                }
            ),
        ),
        JobStep::Released => ("released", "the charge went back to the user".to_owned()),
        JobStep::Refunded => ("refunded", "an operator refunded the charge".to_owned()),
    };
    let member = match &n.step {
        JobStep::Granted { member, .. } => member.clone(),
        _ => None,
    };
    Entry {
        at_ms: n.at_ms,
        step,
        what,
        member,
    }
}

/// What became of the charge, and why.
fn charge(record: Option<&RecordView>, steps: &[JobNote]) -> String {
    let refunded = steps.iter().any(|s| matches!(s.step, JobStep::Refunded));
    let released = steps.iter().any(|s| matches!(s.step, JobStep::Released));
    let failed = steps.iter().rev().find_map(|s| match &s.step {
        JobStep::Failed {
            cause,
            charge_stands,
            message,
            ..
        } => Some((cause.clone(), *charge_stands, message.clone())),
        _ => None,
    });
    let state = record.map(|r| r.state);
    let cause = record
        .and_then(|r| r.cause.clone().zip(r.message.clone()))
        .or_else(|| failed.as_ref().map(|(c, _, m)| (c.clone(), m.clone())));
    if refunded {
        return "refunded by an operator".into();
    }
    match (state, &cause) {
        (Some("queued" | "running"), _) => "held by the job until it ends".into(),
        (Some("succeeded"), _) => "charged: the job succeeded".into(),
        (_, Some((c, m))) => {
            let stands = FailureCause::parse(c).map_or_else(
                || failed.as_ref().is_some_and(|(_, s, _)| *s),
                FailureCause::charged,
            );
            if stands {
                format!("stands: {c} (the upstream may have done the work): {m}")
            } else if released || state == Some("failed") {
                format!("released: {c}: {m}")
            } else {
                format!("to be released: {c}: {m}")
            }
        }
        _ if steps
            .iter()
            .any(|s| matches!(s.step, JobStep::Succeeded { .. })) =>
        {
            "charged: the job succeeded".into()
        }
        _ if released => "released".into(),
        _ => "unknown: neither its record nor its outcome is kept".into(),
    }
}

/// `GET /admin/jobs/{id}`: see the module docs.
pub async fn detail(
    _: Operator,
    State(state): State<ApiState>,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<DetailQuery>,
) -> Result<Response, ApiError> {
    let id = RequestId::existing(&id).map_err(|e| bad("id", format!("id: {e}")))?;
    let given = q
        .user
        .as_deref()
        .filter(|u| !u.is_empty())
        .map(|u| UserId::new(u).map_err(|e| bad("user", format!("user: {e}"))))
        .transpose()?;
    let currency = state.config.currency();
    let activity = state.dashboard.activity.as_ref();
    let steps = activity
        .timelines(&[id.to_string()])
        .await?
        .into_iter()
        .next()
        .unwrap_or_default();
    let mut users: Vec<String> = Vec::new();
    let mut seen = HashSet::new();
    for u in given
        .iter()
        .map(ToString::to_string)
        .chain(steps.iter().map(|s| s.user.clone()))
    {
        if seen.insert(u.clone()) {
            users.push(u);
        }
    }
    let mut jobs = Vec::new();
    for user in users {
        let Ok(uid) = UserId::existing(&user) else {
            continue;
        };
        let info = state.jobs.status(&uid, &id).await?;
        let record = info.as_ref().map(|i| record_view(i, currency));
        let mine: Vec<JobNote> = steps.iter().filter(|s| s.user == user).cloned().collect();
        if record.is_none() && mine.is_empty() {
            continue;
        }
        let mut timeline = Vec::new();
        if let Some(r) = &record {
            if !mine
                .iter()
                .any(|s| matches!(s.step, JobStep::Charged { .. }))
            {
                timeline.push(Entry {
                    at_ms: r.enqueued_at_ms,
                    step: "queued",
                    what: format!("queued ({} for {})", r.cost, r.operation),
                    member: None,
                });
            }
        }
        timeline.extend(mine.iter().map(|n| entry(n, currency)));
        if let Some(r) = &record {
            let noted = mine
                .iter()
                .any(|s| matches!(s.step, JobStep::Succeeded { .. } | JobStep::Failed { .. }));
            if let (Some(at), false) = (r.finished_at_ms, noted) {
                timeline.push(Entry {
                    at_ms: at,
                    step: "finished",
                    what: match (&r.cause, &r.message) {
                        (Some(c), Some(m)) => format!("failed ({c}): {m}"),
                        _ => r.state.to_owned(),
                    },
                    member: None,
                });
            }
        }
        timeline.sort_by_key(|e| e.at_ms);
        let note = match (&record, mine.is_empty()) {
            (None, _) => Some(FORGOTTEN.to_owned()),
            (Some(_), true) => Some(NO_TIMELINE.to_owned()),
            _ => None,
        };
        jobs.push(JobView {
            charge: charge(record.as_ref(), &mine),
            cancellable: record.as_ref().is_some_and(|r| r.state == "queued"),
            user,
            record,
            timeline,
            note,
        });
    }
    let note = jobs.is_empty().then(|| {
        format!(
            "no job {id}{}: the activity log keeps the timelines of the newest {TIMELINES_CAP} \
             jobs; an older job is found by its id and its user while its record lasts",
            given
                .as_ref()
                .map(|u| format!(" of user {u}"))
                .unwrap_or_default()
        )
    });
    Ok(no_store(
        axum::Json(JobDetail {
            id: id.to_string(),
            currency: crate::usage::money_code(currency),
            found: !jobs.is_empty(),
            jobs,
            note,
        })
        .into_response(),
    ))
}

/// The schemas of the job browser's answers in the OpenAPI document.
pub fn list_schema(currency: Currency) -> serde_json::Value {
    let int = serde_json::json!({"type": "integer"});
    let string = serde_json::json!({"type": "string"});
    serde_json::json!({
        "type": "object",
        "required": ["view", "limit", "offset", "more", "scope", "rows", "dead"],
        "properties": {
            "currency": {"type": "string", "description": "A money deployment's ISO 4217 code (absent for tokens)."},
            "view": {"type": "string", "enum": ["recent", "failed", "dead"]},
            "limit": int, "offset": int, "more": {"type": "boolean"}, "scope": string,
            "rows": {"type": "array", "items": {
                "type": "object",
                "required": ["id", "user", "operation", "at_ms", "cost", "state", "cause", "refunded"],
                "properties": {
                    "id": string, "user": string, "operation": string, "at_ms": int,
                    "cost": crate::openapi::nullable_amount(currency),
                    "reserved": crate::openapi::amount_schema(currency),
                    "state": {"type": "string", "enum": ["queued", "running", "succeeded", "failed", "refunded", "unknown"]},
                    "cause": {"type": ["string", "null"]},
                    "refunded": {"type": "boolean"},
                },
            }},
            "dead": {"type": "array", "items": {
                "type": "object",
                "required": ["operation", "entry", "reason"],
                "properties": {"operation": string, "entry": string, "reason": string},
            }},
        },
    })
}

pub fn detail_schema(currency: Currency) -> serde_json::Value {
    let int = serde_json::json!({"type": "integer"});
    let string = serde_json::json!({"type": "string"});
    let nullable_string = serde_json::json!({"type": ["string", "null"]});
    serde_json::json!({
        "type": "object",
        "required": ["id", "found", "jobs", "note"],
        "properties": {
            "currency": {"type": "string", "description": "A money deployment's ISO 4217 code (absent for tokens)."},
            "id": string,
            "found": {"type": "boolean"},
            "note": nullable_string,
            "jobs": {"type": "array", "items": {
                "type": "object",
                "required": ["user", "record", "timeline", "charge", "note", "cancellable"],
                "properties": {
                    "user": string,
                    "record": {"type": ["object", "null"],
                        "required": ["state", "operation", "provider", "cost", "run", "enqueued_at_ms", "deadline_ms", "finished_at_ms", "cause", "message"],
                        "properties": {
                            "state": {"type": "string", "enum": ["queued", "running", "succeeded", "failed"]},
                            "operation": string, "provider": string, "cost": crate::openapi::amount_schema(currency), "run": int,
                            "enqueued_at_ms": int, "deadline_ms": int,
                            "finished_at_ms": {"type": ["integer", "null"]},
                            "cause": nullable_string, "message": nullable_string,
                        }},
                    "timeline": {"type": "array", "items": {
                        "type": "object",
                        "required": ["at_ms", "step", "what"],
                        "properties": {"at_ms": int, "step": string, "what": string,
                            "member": {"type": "string", "description": "A granted step's pool member (its name in the provider's members), when the provider is a pool."}},
                    }},
                    "charge": string,
                    "note": nullable_string,
                    "cancellable": {"type": "boolean"},
                },
            }},
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(step: JobStep) -> JobNote {
        JobNote {
            id: "r".into(),
            user: "u".into(),
            at_ms: 1,
            step,
        }
    }

    #[test]
    fn a_timeline_ends_in_its_last_state() {
        assert_eq!(state_of(&[]).0, "unknown");
        let charged = note(JobStep::Charged {
            operation: "op".into(),
            cost: 3,
        });
        assert_eq!(state_of(std::slice::from_ref(&charged)).0, "queued");
        let failed = note(JobStep::Failed {
            operation: "op".into(),
            cause: "provider".into(),
            charge_stands: false,
            message: "m".into(),
        });
        let (state, cause, refunded) =
            state_of(&[charged.clone(), failed, note(JobStep::Released)]);
        assert_eq!(
            (state.as_str(), cause.as_deref(), refunded),
            ("failed", Some("provider"), true)
        );
        assert_eq!(state_of(&[charged, note(JobStep::Refunded)]).0, "refunded");
    }
}
