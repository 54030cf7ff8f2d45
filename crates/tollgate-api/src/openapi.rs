//! The OpenAPI 3.1 document, generated from the route table: every route is
//! added through [`Routes::route`], which registers the handler with axum and
//! its description with the document in one call, so no route can exist without
//! being documented. Schemas of the JSON bodies are written here, beside the
//! problem types of [`ProblemType::ALL`].

use std::collections::BTreeMap;

use axum::http::Method;
use axum::routing::MethodRouter;
use axum::Router;
use serde_json::{json, Map, Value};
use tollgate_core::config::Config;
use tollgate_core::money::Currency;

use crate::cost::Cost;
use crate::problem::ProblemType;
use crate::state::ApiState;

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Public,
    User,
    Admin,
    /// The admin token or the read-only viewer token (or a dashboard session).
    Viewer,
}

/// One route's entry in the document.
#[derive(Debug, Clone)]
pub struct Doc {
    pub method: Method,
    pub path: String,
    pub summary: String,
    pub access: Access,
    body: Option<Value>,
    responses: Vec<(u16, String, Option<Value>)>,
    errors: Vec<ProblemType>,
    metered: Option<Cost>,
    query: Vec<Value>,
}

impl Doc {
    pub fn new(method: Method, path: &str, summary: &str) -> Self {
        Self {
            method,
            path: path.to_owned(),
            summary: summary.to_owned(),
            access: Access::Public,
            body: None,
            responses: Vec::new(),
            errors: vec![ProblemType::Internal],
            metered: None,
            query: Vec::new(),
        }
    }

    pub fn get(path: &str, summary: &str) -> Self {
        Self::new(Method::GET, path, summary)
    }
    pub fn post(path: &str, summary: &str) -> Self {
        Self::new(Method::POST, path, summary)
    }
    pub fn put(path: &str, summary: &str) -> Self {
        Self::new(Method::PUT, path, summary)
    }
    pub fn delete(path: &str, summary: &str) -> Self {
        Self::new(Method::DELETE, path, summary)
    }

    /// A route for API keys: a user's, or a service's naming the user
    /// (`Tollgate-User`, `Tollgate-Plan`).
    pub fn user(mut self) -> Self {
        self.access = Access::User;
        self.errors.extend([
            ProblemType::Unauthorized,
            ProblemType::TooManyFailedAuthentications,
            ProblemType::BackendUnavailable,
            ProblemType::MalformedRequest,
            ProblemType::UserRequired,
            ProblemType::ActingForAnotherUser,
            ProblemType::PlanNotAllowed,
        ]);
        self
    }

    pub fn admin(mut self) -> Self {
        self.access = Access::Admin;
        self.errors.extend([
            ProblemType::Unauthorized,
            ProblemType::TooManyFailedAuthentications,
            ProblemType::AdminDisabled,
            ProblemType::ReadOnlyCredential,
            ProblemType::BackendUnavailable,
        ]);
        self
    }

    /// A read-only operator route: the admin or the viewer token.
    pub fn viewer(mut self) -> Self {
        self.access = Access::Viewer;
        self.errors.extend([
            ProblemType::Unauthorized,
            ProblemType::TooManyFailedAuthentications,
            ProblemType::AdminDisabled,
            ProblemType::BackendUnavailable,
        ]);
        self
    }

    /// A JSON request body (adds the 400/413/415/422 problems).
    pub fn body(mut self, schema: Value) -> Self {
        self.body = Some(schema);
        self.errors.extend([
            ProblemType::MalformedRequest,
            ProblemType::InvalidField,
            ProblemType::UnsupportedMediaType,
            ProblemType::PayloadTooLarge,
        ]);
        self
    }

    pub fn ok(mut self, status: u16, description: &str, schema: Option<Value>) -> Self {
        self.responses
            .push((status, description.to_owned(), schema));
        self
    }

    /// A required query parameter (missing, or a bad value: a 400 problem).
    pub fn required_query(mut self, name: &str, description: &str, schema: Value) -> Self {
        self = self.query(name, description, schema);
        if let Some(last) = self.query.last_mut() {
            last["required"] = Value::Bool(true);
        }
        self
    }

    /// An optional query parameter (a bad value is a 400 problem).
    pub fn query(mut self, name: &str, description: &str, schema: Value) -> Self {
        self.query
            .push(json!({"name": name, "in": "query", "required": false,
            "description": description, "schema": schema}));
        if !self.errors.contains(&ProblemType::MalformedRequest) {
            self.errors.push(ProblemType::MalformedRequest);
        }
        self
    }

    pub fn errors(mut self, errors: &[ProblemType]) -> Self {
        self.errors.extend_from_slice(errors);
        self
    }

    fn operation(&self) -> Value {
        let mut op = Map::new();
        op.insert("summary".into(), json!(self.summary));
        op.insert(
            "operationId".into(),
            json!(format!(
                "{}{}",
                self.method.as_str().to_lowercase(),
                self.path
                    .replace(['/', '{', '}', '.'], "_")
                    .trim_end_matches('_')
            )),
        );
        let mut params: Vec<Value> = self
            .path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|name| {
                // Ids are validated like `UserId`/`RequestId`: say so, so that
                // clients (and generators) know what the server accepts.
                let schema = match name {
                    "user" | "org" => subject_id_schema(),
                    "id" | "request_id" => id_schema(),
                    _ => json!({"type": "string"}),
                };
                json!({"name": name, "in": "path", "required": true, "schema": schema})
            })
            .collect();
        params.extend(self.query.iter().cloned());
        if self.access == Access::User {
            params.push(json!({"name": "Tollgate-User", "in": "header", "required": false,
                "description": "With a service key (`tg_svc_...`, required): the user the call is for; its budget pays, its jobs and usage are read. With a user's key: only its own user (another: 403 acting-for-another-user).",
                "schema": subject_id_schema()}));
            params.push(json!({"name": "Tollgate-Plan", "in": "header", "required": false,
                "description": "With a service key: one of the key's allowed_plans, given to the named user when its plan is the default or another plan the key may give (a plan an admin set otherwise stays). Any other: 403 plan-not-allowed.",
                "schema": {"type": "string"}}));
        }
        if let Some(cost) = self.metered {
            params.push(json!({"name": "Idempotency-Key", "in": "header", "required": false,
                "description": "Makes a retry safe: the same key (per user) is the same request, charged once, returning the same job.",
                "schema": {"type": "string", "minLength": 1,
                    // Visible ASCII (spaces and tabs inside), 1 to 255 characters:
                    // what `request_id` accepts once HTTP dropped the blanks around it.
                    "pattern": "^[!-~]([ \t!-~]{0,253}[!-~])?$"}}));
            params.push(json!({"name": "Prefer", "in": "header", "required": false,
                "description": "`respond-async`: answer 202 at once, or with `wait=<seconds>` once the job is final or that long passed (whichever first); `wait=<seconds>` alone: a sync call that waits at most that long. Every wait is capped by the sync timeout.",
                "schema": {"type": "string"}}));
            params.push(json!({"name": "async", "in": "query", "required": false,
                "description": "`true`: like `Prefer: respond-async`.", "schema": {"type": "boolean"}}));
            op.insert(
                "x-tollgate-cost".into(),
                match cost.fixed() {
                    Some(n) => json!(n),
                    None => json!("the operation's cost in the config ([operations.<name>].cost)"),
                },
            );
        }
        if !params.is_empty() {
            op.insert("parameters".into(), Value::Array(params));
        }
        match self.access {
            Access::Public => {
                op.insert("security".into(), json!([]));
            }
            Access::User => {
                op.insert("security".into(), json!([{"apiKey": []}]));
            }
            Access::Admin => {
                op.insert("security".into(), json!([{"adminToken": []}]));
            }
            Access::Viewer => {
                op.insert(
                    "security".into(),
                    json!([{"adminToken": []}, {"viewerToken": []}]),
                );
            }
        }
        if let Some(schema) = &self.body {
            op.insert(
                "requestBody".into(),
                json!({"required": true, "content": {"application/json": {"schema": schema}}}),
            );
        }
        let mut responses = Map::new();
        for (status, description, schema) in &self.responses {
            let mut r = json!({"description": description});
            if let Some(schema) = schema {
                let media = if *status == 200 && self.path == "/metrics" {
                    "text/plain"
                } else {
                    "application/json"
                };
                r["content"] = json!({media: {"schema": schema}});
                if *status == 200 && self.path == "/admin/spend" {
                    r["content"]["text/csv"] = json!({"schema": {"type": "string",
                        "description": "A header `<by>,start,amount`, then a line per row (RFC 4180)."}});
                }
            }
            if self.metered.is_some() {
                r["headers"] = ratelimit_headers(false);
            }
            responses.insert(status.to_string(), r);
        }
        let mut by_status: BTreeMap<u16, Vec<ProblemType>> = BTreeMap::new();
        for e in &self.errors {
            let list = by_status.entry(e.status().as_u16()).or_default();
            if !list.contains(e) {
                list.push(*e);
            }
        }
        for (status, types) in by_status {
            let description = types
                .iter()
                .map(|t| format!("`{}`: {}", t.uri(), t.title()))
                .collect::<Vec<_>>()
                .join("; ");
            let mut r = json!({
                "description": description,
                "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}},
                "x-problem-types": types.iter().map(|t| t.uri()).collect::<Vec<_>>(),
            });
            if status == 429 {
                r["headers"] = if self.metered.is_some() {
                    ratelimit_headers(true)
                } else {
                    json!({"Retry-After": {"description": "Seconds until this address may try again.", "schema": {"type": "integer"}}})
                };
            }
            responses.insert(status.to_string(), r);
        }
        op.insert("responses".into(), Value::Object(responses));
        Value::Object(op)
    }
}

fn ratelimit_headers(retry_after: bool) -> Value {
    let mut h = json!({
        "RateLimit-Policy": {"description": "The budget: `\"budget\";q=<limit>;w=<window seconds>`; a plan of several limits lists one `\"budget-<window>\"` item per window", "schema": {"type": "string"}},
        "RateLimit": {"description": "What is left in the window closest to exhaustion: `\"budget\";r=<remaining>;t=<seconds until more frees up>`", "schema": {"type": "string"}},
    });
    if retry_after {
        h["Retry-After"] = json!({"description": "Seconds until this request's cost fits (rounded up from the exact retry_after).", "schema": {"type": "integer"}});
    }
    h
}

/// A router being built together with its OpenAPI document.
#[derive(Debug)]
pub struct Routes {
    router: Router<ApiState>,
    docs: Vec<Doc>,
}

impl Default for Routes {
    fn default() -> Self {
        Self::new()
    }
}

impl Routes {
    pub fn new() -> Self {
        Self {
            router: Router::new(),
            docs: Vec::new(),
        }
    }

    /// Adds `handler` at `doc.path` and documents it.
    pub fn route(mut self, doc: Doc, handler: MethodRouter<ApiState>) -> Self {
        self.router = self.router.route(&doc.path, handler);
        self.docs.push(doc);
        self
    }

    /// Adds a metered operation route: `cost` wraps `handler` (the price sits
    /// next to the path), and the document shows the price and the budget
    /// problems, and every failure of its job (one type per
    /// [`FailureCause`](tollgate_core::job::FailureCause), as `ApiError::kind`
    /// maps them).
    pub fn metered(self, mut doc: Doc, cost: Cost, handler: MethodRouter<ApiState>) -> Self {
        doc.metered = Some(cost);
        doc.errors.extend([
            ProblemType::QuotaExceeded,
            ProblemType::CreditsExhausted,
            ProblemType::CostExceedsLimit,
            ProblemType::IdempotencyConflict,
            ProblemType::IdempotencyKeyReused,
            ProblemType::ProviderFailure,
            ProblemType::ThrottleTimeout,
            ProblemType::JobExpired,
            ProblemType::JobAbandoned,
            ProblemType::UpstreamRejected,
            ProblemType::UpstreamUnanswered,
            ProblemType::BadUpstreamResponse,
            ProblemType::JobCancelled,
        ]);
        if cost.fixed().is_none() {
            doc.errors.push(ProblemType::UnknownOperation);
        }
        doc.errors.push(ProblemType::ResultExpired);
        doc.errors.push(ProblemType::StoredBytesExceeded);
        // A connection over the api's caps is shed with 503 `overloaded`,
        // whatever it asked for (docs/src/http.md, "Slow clients").
        doc.errors.push(ProblemType::Overloaded);
        self.route(doc, handler.layer(cost))
    }

    /// The router and the document (`config` names the plans a body may ask for).
    pub fn finish(self, config: &Config) -> (Router<ApiState>, Value) {
        let document = document(&self.docs, config);
        (self.router, document)
    }

    pub fn docs(&self) -> &[Doc] {
        &self.docs
    }

    /// Documents a route that is added to the router later, by the caller.
    pub fn describe(mut self, doc: Doc) -> Self {
        self.docs.push(doc);
        self
    }

    /// The router so far and its docs (to wrap the router in route layers).
    pub fn into_parts(self) -> (Router<ApiState>, Vec<Doc>) {
        (self.router, self.docs)
    }

    pub fn from_parts(router: Router<ApiState>, docs: Vec<Doc>) -> Self {
        Self { router, docs }
    }
}

/// The OpenAPI document of `docs`.
pub fn document(docs: &[Doc], config: &Config) -> Value {
    let mut paths: BTreeMap<&str, Map<String, Value>> = BTreeMap::new();
    for doc in docs {
        paths
            .entry(&doc.path)
            .or_default()
            .insert(doc.method.as_str().to_lowercase(), doc.operation());
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "tollgate",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "User budgets and provider throttles for services that pay upstream APIs. \
    Errors are application/problem+json (RFC 9457); every problem type is listed under x-problem-types.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "A user's API key (`tg_user_...`), or a service key (`tg_svc_...`) with `Tollgate-User` naming the user the call is for."},
                "adminToken": {"type": "http", "scheme": "bearer", "description": "The admin token (TOLLGATE_ADMIN_TOKEN)."},
                "viewerToken": {"type": "http", "scheme": "bearer", "description": "The read-only viewer token (TOLLGATE_VIEWER_TOKEN): the dashboard's read-only routes only."},
            },
            "schemas": schemas(config),
        },
        "x-problem-types": ProblemType::ALL.iter().map(|t| json!({
            "type": t.uri(), "status": t.status().as_u16(), "title": t.title(),
        })).collect::<Vec<_>>(),
    })
}

/// A user id as a query filter: an id, or empty for none (what the
/// dashboard's forms send for a field left blank).
pub(crate) fn id_filter_schema() -> Value {
    json!({"type": "string", "maxLength": tollgate_core::id::MAX_ID_LEN, "pattern": "^[A-Za-z0-9._@+=~-]*$"})
}

/// A request id: what `tollgate_core::id` accepts.
fn id_schema() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": tollgate_core::id::MAX_ID_LEN, "pattern": "^[A-Za-z0-9._@+=~-]+$"})
}

/// A user or organisation id: a request id's alphabet, but never `.` nor
/// `..` (a URL path drops such a segment).
fn subject_id_schema() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": tollgate_core::id::MAX_ID_LEN,
        "pattern": "^(?!\\.\\.?$)[A-Za-z0-9._@+=~-]+$"})
}

fn schemas(config: &Config) -> Value {
    let currency = config.currency();
    let amount = amount_schema(currency);
    // With money: `currency` beside the amounts (absent for tokens).
    let money_code = json!({"type": "string", "description": "A money deployment's ISO 4217 code, in which the amounts are decimal strings (absent for tokens: integers)."});
    let plans: Vec<&str> = config.plans().map(|p| p.name.as_str()).collect();
    let plan = json!({"type": "string", "enum": plans, "description": "A plan of the config."});
    let mut all = json!({
        "Problem": {
            "type": "object",
            "required": ["type", "title", "status"],
            "properties": {
                "type": {"type": "string", "enum": ProblemType::ALL.iter().map(|t| t.uri()).collect::<Vec<_>>()},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
                "field": {"type": "string", "description": "The offending field (400/422)."},
                "job_id": {"type": "string"},
                "cause": {"type": "string", "enum": ["provider", "unanswered", "bad_response", "throttle_timeout", "expired", "abandoned", "cancelled", "rejected"]},
                "charged": {"type": "boolean", "description": "A failed job: true when its charge stands (the upstream may have done the work: unanswered, bad_response), false when it was released."},
                "retry_after_ms": {"type": "integer", "description": "429: exactly when this request fits."},
                "waited_ms": {"type": "integer", "description": "A failed job (502/503/504, e.g. no provider slot within max_wait): from its submission to its end."},
                "stored_bytes": {"type": "integer", "description": "429 stored-bytes-exceeded: the bytes your jobs store in the operation's queue now (inputs of unfinished jobs, results and errors still kept, 256 per job besides)."},
                "max_stored_bytes": {"type": "integer", "description": "429 stored-bytes-exceeded: your plan's max_stored_bytes."},
                "upstream_status": {"type": "integer", "description": "422 upstream-rejected: the upstream's status (400, 413, 414, 415 or 422)."},
                "upstream_body": {"type": "string", "description": "422 upstream-rejected: the upstream's body (at most 1024 bytes), only for an operation with expose_upstream_errors = true."},
                "scope": {"type": "string", "enum": ["user", "organisation"], "description": "429 quota-exceeded: whose budget held the request back: the user's own, or its organisation's."},
                "balance": amount.clone(),
                "needed": amount.clone(),
            },
        },
        "OperationInput": {"type": "object", "description": "The operation's input, passed to the provider as it is.", "additionalProperties": true},
        "Job": {
            "type": "object",
            "required": ["job_id", "operation", "status", "cost", "reserved", "enqueued_at"],
            "properties": {
                "job_id": {"type": "string"},
                "operation": {"type": "string"},
                "status": {"type": "string", "enum": ["queued", "waiting_for_provider", "running", "succeeded", "failed"],
                    "description": "queued: for a worker; waiting_for_provider: a worker holds it and waits for a slot of the provider; running: calling the provider."},
                "provider_queue": {
                    "type": "object",
                    "description": "While waiting_for_provider: where the job stands. Calls are ordered when they queue, so the estimate counts the calls served before it as the queue stands (only users who start waiting later can still come between): ((position - 1) + others_ahead + 1) / rate.",
                    "required": ["provider", "position", "others_ahead", "users_waiting", "estimated_wait_ms", "estimated_start"],
                    "properties": {
                        "provider": {"type": "string"},
                        "position": {"type": "integer", "minimum": 1, "description": "Its place in its user's queue at the provider (1: next); a FIFO provider: in the one queue."},
                        "others_ahead": {"type": "integer", "description": "Calls of other users served before it, as the queue stands (a FIFO provider: 0)."},
                        "users_waiting": {"type": "integer", "description": "Users waiting at the provider, its own included."},
                        "estimated_wait_ms": {"type": "integer"},
                        "estimated_start": {"type": "string", "format": "date-time"},
                    },
                },
                "result": {"description": "The provider's result (succeeded)."},
                "error": {"type": "object", "properties": {"cause": {"type": "string"}, "message": {"type": "string"}, "charged": {"type": "boolean", "description": "Whether the failed job's charge stands (the upstream may have done the work) or was released."},
                    "upstream_status": {"type": "integer", "description": "Cause rejected: the upstream's status."},
                    "upstream_body": {"type": "string", "description": "Cause rejected: the upstream's body (at most 1024 bytes), only for an operation with expose_upstream_errors = true."}}},
                "cost": {"allOf": [amount], "description": "What the job is charged (tokens: an integer; money: an exact decimal string of `currency`): its settled charge once the upstream reported usage, else its reservation."},
                "reserved": {"allOf": [amount], "description": "What was reserved up front: the most the job can be charged."},
                "currency": money_code,
                "enqueued_at": {"type": "string", "format": "date-time"},
                "finished_at": {"type": "string", "format": "date-time"},
            },
        },
        "Usage": {
            "type": "object",
            "required": ["user", "plan", "custom_limits", "currency", "used", "limit", "remaining", "window_secs", "windows", "events", "next_cursor"],
            "properties": {
                "user": {"type": "string"},
                "currency": {"type": "string", "description": "What the amounts count: tokens (integers), or an ISO 4217 currency (exact decimal strings of it: \"0.00015\")."},
                "plan": {"type": "string", "description": "The user's plan, or `custom` when an admin set its limits."},
                "custom_limits": {"type": "boolean", "description": "True when an admin set this user's limits (PUT /admin/users/{user}/limits): `windows` are those, not its plan's."},
                "used": amount,
                "limit": amount,
                "remaining": amount,
                "window_secs": {"type": "integer"},
                "reset_after_secs": {"type": ["integer", "null"]},
                "reset_at": {"type": ["string", "null"], "format": "date-time"},
                "windows": {"type": "array", "description": "Every limit of the plan, longest window first; the figures above are the one closest to exhaustion's.", "items": window(currency)},
                "next_cursor": {"type": ["string", "null"], "description": "Pass it as `cursor` for the next page of events; `null`: this page reached the newest event."},
                "organisation": {"type": "object", "description": "A member of an organisation: the organisation's windows (each charge must fit them as well as the user's own).",
                    "required": ["org", "plan", "windows"],
                    "properties": {"org": {"type": "string"}, "plan": {"type": "string"},
                        "windows": {"type": "array", "items": {"$ref": "#/components/schemas/Window"}}}},
                "events": {"type": "array", "description": "One page of the live spend events, oldest first (`limit` at most).", "items": {
                    "type": "object",
                    "required": ["request_id", "cost", "at", "at_ms"],
                    "properties": {
                        "request_id": {"type": "string"},
                        "operation": {"type": ["string", "null"]},
                        "service_key": {"type": "string", "description": "The id (kid_...) of the service key that made the call for this user; absent: the user's own key."},
                        "cost": amount,
                        "estimate": {"allOf": [nullable_amount(currency)], "description": "The estimate reserved up front, for a charge settled to what the provider reported (`cost` is the actual)."},
                        "at": {"type": "string", "format": "date-time"},
                        "at_ms": {"type": "integer"},
                    },
                }},
            },
        },
        "CreateUser": {
            "type": "object", "required": ["user"], "additionalProperties": false,
            "properties": {"user": subject_id_schema(), "plan": {
                "description": "A plan of the config; omitted or null: the default plan. Not for a service key.",
                "anyOf": [plan.clone(), {"type": "null"}],
            },
            "kind": {"type": "string", "enum": ["user", "service"], "description": "user (default): the user's own key. service: a key (tg_svc_...) that acts for the user each call names in Tollgate-User; `user` is then the service's own name."},
            "allowed_plans": {"type": "array", "items": plan, "description": "A service key: the plans it may give users with Tollgate-Plan (default none)."}},
            // A service key has no plan; only a service key gives plans.
            "if": {"required": ["kind"], "properties": {"kind": {"const": "service"}}},
            "then": {"properties": {"plan": {"type": "null"}}},
            "else": {"properties": {"allowed_plans": {"maxItems": 0}}},
        },
        "CreatedUser": {
            "type": "object", "required": ["user", "kind", "key_id", "api_key"],
            "properties": {"user": {"type": "string"}, "plan": {"type": "string", "description": "The user's plan (absent for a service key)."},
                "kind": {"type": "string", "enum": ["user", "service"]},
                "allowed_plans": {"type": "array", "items": {"type": "string"}},
                "key_id": {"type": "string"},
                "api_key": {"type": "string", "description": "Shown once; stored only as a SHA-256 hash."}},
        },
        "SetPlan": {"type": "object", "required": ["plan"], "additionalProperties": false, "properties": {"plan": plan}},
        "Plan": {"type": "object", "required": ["user", "plan"], "properties": {"user": {"type": "string"}, "plan": {"type": "string"}}},
        "SetLimits": {"type": "object", "required": ["limits"], "additionalProperties": false, "properties": {
            "limits": {"type": "array", "minItems": 1, "maxItems": tollgate_core::config::MAX_LIMITS,
                "description": "As a plan's `limits`: distinct windows, none longer than the longest window of any configured plan (the log's retention).",
                "items": {"type": "object", "required": ["limit", "window"], "additionalProperties": false, "properties": {
                    "limit": limit_input(currency),
                    "window": {"type": "string", "maxLength": 32, "pattern": "^([0-9]+(ms|s|m|h|d))+$",
                        "description": "A duration: `90s`, `15m`, `1h`, `1h30m`; at least 1ms, at most the retention.", "examples": ["1h"]},
                }}},
        }},
        "Limits": {"type": "object", "required": ["user", "plan", "base_plan", "custom_limits", "limits"], "properties": {
            "user": {"type": "string"},
            "plan": {"type": "string", "description": "`custom` when the user has its own limits, else its plan."},
            "base_plan": {"type": "string", "description": "The named plan: what the user returns to when its own limits are cleared; its other settings (share, max_in_flight, max_stored_bytes) apply meanwhile."},
            "custom_limits": {"type": "boolean"},
            "currency": money_code,
            "limits": limit_list(currency),
        }},
        "UserList": {"type": "object", "required": ["users", "next_cursor"], "properties": {
            "users": {"type": "array", "items": {"type": "object",
                "required": ["user", "plan", "base_plan", "custom_limits", "limits", "kind", "live_keys", "keys", "created", "created_ms"],
                "properties": {
                    "user": {"type": "string"},
                    "plan": {"type": "string", "description": "`custom` (its own limits) or its plan."},
                    "base_plan": {"type": "string"},
                    "custom_limits": {"type": "boolean"},
                    "limits": limit_list(currency),
                    "kind": {"type": "string", "enum": ["user", "service"], "description": "`service` when every key of the user is a service key."},
                    "live_keys": {"type": "integer", "minimum": 0, "description": "Keys not revoked."},
                    "keys": {"type": "integer", "minimum": 0},
                    "created": {"type": ["string", "null"], "format": "date-time", "description": "When its first key was issued."},
                    "created_ms": {"type": ["integer", "null"]},
                }}},
            "next_cursor": {"type": ["string", "null"], "description": "Pass it as `cursor` for the next page; `null`: the last page."},
        }},
        "UserKeys": {"type": "object", "required": ["user", "keys"], "properties": {
            "user": {"type": "string"},
            "keys": {"type": "array", "items": key_view(false)},
        }},
        "KeyList": {"type": "object", "required": ["keys", "next_cursor"], "properties": {
            "keys": {"type": "array", "items": key_view(true)},
            "next_cursor": {"type": ["string", "null"], "description": "Pass it as `cursor` for the next page; `null`: the last page."},
        }},
        "AdminUsage": {"allOf": [schema("Usage"), {"type": "object", "required": ["base_plan"], "properties": {
            "base_plan": {"type": "string", "description": "The user's named plan (what it returns to when its own limits are cleared)."},
        }}]},
        "Window": window(currency),
        "SetOrg": {"type": "object", "required": ["org"], "additionalProperties": false, "properties": {"org": {"oneOf": [subject_id_schema(), {"type": "null"}], "description": "An organisation created with PUT /admin/orgs/{org}; null: in no organisation."}}},
        "UserOrg": {"type": "object", "required": ["user", "org", "moved_events"], "properties": {"user": {"type": "string"}, "org": {"type": ["string", "null"]}, "moved_events": {"type": "integer", "description": "Live spend events this call moved with the user."}}},
        "OrgPlan": {"type": "object", "required": ["org", "plan"], "properties": {"org": {"type": "string"}, "plan": {"type": "string"}}},
        "OrgList": {"type": "object", "required": ["orgs", "next"], "properties": {"orgs": {"type": "array", "items": {"type": "string"}}, "next": {"type": ["string", "null"], "description": "after= for the next page; null on the last."}}},
        "Org": {"type": "object", "required": ["org", "plan", "windows", "members", "next_member"], "properties": {
            "org": {"type": "string"}, "plan": {"type": "string"}, "currency": money_code,
            "windows": {"type": "array", "items": {"$ref": "#/components/schemas/Window"}},
            "members": {"type": "array", "items": {"type": "string"}},
            "next_member": {"type": ["string", "null"], "description": "after= for the next page of members; null on the last."}}},
        "RevokedKey": {"type": "object", "required": ["key_id", "user", "revoked"],
            "properties": {"key_id": {"type": "string"}, "user": {"type": "string"}, "revoked": {"type": "boolean"}}},
        "Refund": {"type": "object", "required": ["user", "request_id", "outcome", "used"],
            "properties": {"user": {"type": "string"}, "request_id": {"type": "string"},
                "outcome": {"type": "string", "enum": ["refunded", "cancelled", "not_found"],
                    "description": "refunded: a plain reserve or a final job's charge; cancelled: a queued job's charge released and the job cancelled (it never runs); not_found: nothing live under this id."},
                "cost": {"allOf": [amount], "description": "What was given back (absent for not_found)."},
                "used": {"allOf": [amount], "description": "Used in the plan's longest window after it."},
                "currency": money_code}},
        "Status": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
        "Ready": {"type": "object", "required": ["status", "durability"], "properties": {
            "status": {"type": "string"},
            "durability": {
                "type": "object",
                "description": "What an accepted call survives a store crash: the --durability mode, the store's AOF setting (`unknown` when it cannot be read, `n/a` in memory) and its loss window.",
                "required": ["mode", "appendonly", "appendfsync", "loss_window"],
                "properties": {
                    "mode": {"type": "string", "enum": ["none", "fsync", "replica"]},
                    "appendonly": {"type": "string"},
                    "appendfsync": {"type": "string"},
                    "replicas": {"type": "integer", "minimum": 0},
                    "loss_window": {"type": "string"},
                    "problem": {"type": "string"}
                }
            }
        }},
        "Overview": crate::dashboard::schema(currency),
        "History": crate::dashboard::history::schema(),
        "JobList": crate::dashboard::jobs::list_schema(currency),
        "JobDetail": crate::dashboard::jobs::detail_schema(currency),
    });
    if let (Some(all), Value::Object(more)) = (all.as_object_mut(), credit_schemas(currency)) {
        all.extend(more);
    }
    // Past the one `json!` above: it is at the macro's recursion limit.
    all["SpendPage"] = spend_page_schema(amount);
    all
}

/// One key as the admin views show it (never its secret or hash); `user`:
/// with its user.
fn key_view(user: bool) -> Value {
    let mut v = json!({"type": "object", "required": ["key_id", "kind", "created", "created_ms", "revoked"], "properties": {
        "key_id": {"type": "string"},
        "kind": {"type": "string", "enum": ["user", "service"]},
        "created": {"type": "string", "format": "date-time"},
        "created_ms": {"type": "integer"},
        "revoked": {"type": "boolean"},
        "allowed_plans": {"type": "array", "items": {"type": "string"}},
    }});
    if user {
        if let Some(required) = v["required"].as_array_mut() {
            required.push(json!("user"));
        }
        v["properties"]["user"] = json!({"type": "string"});
    }
    v
}

/// An amount of `currency` as the answers write it: an integer of tokens, or
/// an exact decimal string of money in its shortest spelling.
pub fn amount_schema(currency: Currency) -> Value {
    match currency {
        Currency::Tokens => json!({"type": "integer", "minimum": 0}),
        Currency::Money(code) => json!({
            "type": "string",
            "pattern": "^(0|[1-9][0-9]*)(\\.[0-9]{0,5}[1-9])?$",
            "description": format!("An exact decimal amount of {}: at most 6 decimals, no trailing zeros.", code.as_str()),
            "examples": ["0.00015"],
        }),
    }
}

/// A limit as `PUT /admin/users/{user}/limits` reads it: a whole number of
/// tokens, or a decimal string of money.
fn limit_input(currency: Currency) -> Value {
    match currency {
        Currency::Tokens => {
            json!({"type": "integer", "minimum": 1, "maximum": tollgate_core::config::MAX_TOKENS})
        }
        Currency::Money(code) => json!({
            "type": "string",
            "pattern": "^[0-9]+(\\.[0-9]{1,6})?$",
            "description": format!("An amount of {}, more than 0: digits with at most 6 decimals (\"20\", \"0.0025\"); a JSON number is refused.", code.as_str()),
        }),
    }
}

/// [`amount_schema`], or `null`.
pub fn nullable_amount(currency: Currency) -> Value {
    json!({"anyOf": [amount_schema(currency), {"type": "null"}]})
}

/// One limit of a plan and its use (`Window`, and inline in `Usage`).
fn window(currency: Currency) -> Value {
    let amount = amount_schema(currency);
    json!({
        "type": "object",
        "required": ["policy", "limit", "window_secs", "used", "remaining"],
        "properties": {
            "policy": {"type": "string"},
            "limit": amount,
            "window_secs": {"type": "integer"},
            "used": amount,
            "remaining": amount,
            "reset_after_secs": {"type": ["integer", "null"]},
            "period": {"type": "string", "enum": ["day", "week", "month"], "description": "A calendar period's limit (absent: a trailing window)."},
            "period_start": {"type": "string", "format": "date-time"},
            "resets_at": {"type": "string", "format": "date-time", "description": "When the current period ends and its total resets."},
            "model": {"type": "string", "description": "A model limit's (`model_limits`): the pattern of the models it counts (absent: one of the plan's own limits)."},
        },
    })
}

/// The prepaid credits' schemas (`/admin/users/{user}/credits`).
fn credit_schemas(currency: Currency) -> Value {
    let amount = amount_schema(currency);
    let money_code = json!({"type": "string", "description": "A money deployment's ISO 4217 code, in which the amounts are decimal strings (absent for tokens: integers)."});
    json!({
        "Grant": {"type": "object", "required": ["amount", "idempotency_key"], "additionalProperties": false, "properties": {
            "amount": limit_input(currency),
            "expires_at": {"type": ["string", "null"], "format": "date-time", "maxLength": 64, "description": "When the grant stops counting (RFC 3339 with its offset, after now); absent or null: never."},
            "idempotency_key": {"type": "string", "minLength": 1, "maxLength": tollgate_core::credits::MAX_KEY_LEN, "pattern": "^[A-Za-z0-9._-]+$",
                "description": "The same key with the same amount and expiry is the same grant (200, nothing added); with another, 409."},
        }},
        "Credits": credits_schema(currency),
        "Granted": {"type": "object", "required": ["outcome", "grant", "credits"], "properties": {
            "outcome": {"type": "string", "enum": ["granted", "existing"]},
            "grant": {"type": "integer", "minimum": 1, "description": "The grant's number (from 1, per user)."},
            "credits": credits_schema(currency),
        }},
        "CreditsHistory": {"type": "object", "required": ["user", "entries"], "properties": {
            "user": {"type": "string"},
            "currency": money_code,
            "entries": {"type": "array", "description": "Oldest first, the first 1000; empty without [export].", "items": {"type": "object",
                "required": ["id", "kind", "grant", "amount", "request_id"], "properties": {
                    "id": {"type": "string", "description": "The export entry's id (`<ms>-<seq>`)."},
                    "kind": {"type": "string", "enum": ["credit_grant", "credit_draw", "credit_return", "credit_expire", "credit_uncovered"]},
                    "grant": {"type": "integer", "minimum": 0, "description": "The grant (0: an uncovered cost)."},
                    "amount": amount.clone(),
                    "request_id": {"type": "string", "description": "The charge's request id; a grant's or an expiry's: the grant's key."},
                    "at_ms": {"type": "integer", "minimum": 0},
                    "expires_at_ms": {"type": "integer", "minimum": 0},
                }}},
        }},
    })
}

/// A user's prepaid balance (`GET /admin/users/{user}/credits`).
fn credits_schema(currency: Currency) -> Value {
    let amount = amount_schema(currency);
    json!({"type": "object", "required": ["user", "balance", "grants", "now_ms"], "properties": {
        "user": {"type": "string"},
        "currency": {"type": "string"},
        "balance": amount.clone(),
        "grants": {"type": "array", "description": "Live grants with something left, in the order charges draw them: earliest expiry first, one that never expires last.",
            "items": {"type": "object", "required": ["id", "remaining", "expires_at", "expires_at_ms"], "properties": {
                "id": {"type": "integer", "minimum": 1},
                "remaining": amount,
                "expires_at": {"type": ["string", "null"], "format": "date-time"},
                "expires_at_ms": {"type": ["integer", "null"]},
            }}},
        "now_ms": {"type": "integer"},
    }})
}

/// A list of limits as the admin views show them.
fn limit_list(currency: Currency) -> Value {
    json!({"type": "array", "description": "Longest window first.", "items": {"type": "object",
    "required": ["limit", "window", "window_ms"], "properties": {
        "limit": amount_schema(currency),
        "window": {"type": "string"},
        "window_ms": {"type": "integer"},
    }}})
}

/// `{"$ref": "#/components/schemas/<name>"}`
pub fn schema(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

/// `GET /admin/spend`'s JSON page.
fn spend_page_schema(amount: Value) -> Value {
    json!({"type": "object", "required": ["by", "step", "from", "to", "currency", "rows", "total"], "properties": {
        "by": {"type": "string", "enum": ["user", "org", "model", "operation", "provider"]},
        "step": {"type": "string", "enum": ["1h", "1d"]},
        "from": {"type": "string", "format": "date-time"},
        "to": {"type": "string", "format": "date-time"},
        "currency": {"type": "string", "description": "`tokens` or an ISO 4217 code: amounts as every answer writes them (tokens: integers; money: exact decimal strings)."},
        "rows": {"type": "array", "items": {"type": "object", "required": ["key", "start", "start_ms", "amount"], "properties": {
            "key": {"type": "string", "description": "The user, organisation, sheet entry, operation or provider; \"\" for charges without one (no organisation, an unpriced call)."},
            "start": {"type": "string", "format": "date-time", "description": "The bucket's start."},
            "start_ms": {"type": "integer", "minimum": 0},
            "amount": amount.clone(),
        }}},
        "total": amount,
        "next_cursor": {"type": "string", "description": "Pass it as `cursor` for the next page; absent on the last page."},
    }})
}
