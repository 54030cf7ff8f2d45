"""One HTTP answer read into what the call does next. The rules for which
answers are retried with the same Idempotency-Key live here (the same as the
Rust client's ``answer.rs``):

- a transport error, or any 503: retry, after ``Retry-After`` when given;
- a 502/504 whose problem says ``"charged": false`` (refunded, so the key is
  free again): retry, a new attempt; ``"charged": true`` is final;
- a 502/503/504 that is not a problem body (a proxy's): retry;
- everything else is final, a budget 429 too (unless the policy waits for budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Union

from ._outcomes import (
    amount,
    AuthError,
    BudgetExhausted,
    Done,
    Failed,
    InvalidRequest,
    Outcome,
    Pending,
    Problem,
    ProblemError,
    ProtocolError,
    ProviderBusy,
    Rejected,
    ServerError,
    StoredBytesExceeded,
    TollgateError,
    Unavailable,
    Window,
)


@dataclass
class Final:
    """The call's end: an outcome, or an error to raise."""

    result: Union[Outcome, TollgateError]


@dataclass
class Retry:
    """Retry with the same key after ``hint`` seconds (the server's) or a
    backoff; ``otherwise`` is the end when no retry is left."""

    hint: Optional[float]
    otherwise: Union[Outcome, TollgateError]


Step = Union[Final, Retry]

_CAUSE_STATUS = {"unanswered": 504, "throttle_timeout": 504, "expired": 504, "abandoned": 503}


def retry_after(headers: Mapping[str, str]) -> Optional[float]:
    value = headers.get("retry-after")
    try:
        return float(int(value.strip())) if value is not None else None
    except ValueError:
        return None


def windows(headers: Mapping[str, str]) -> List[Window]:
    """The plan's windows from ``RateLimit-Policy`` and ``RateLimit``."""

    def items(text: str) -> List[tuple]:
        out = []
        for item in text.split(","):
            parts = item.split(";")
            name = parts[0].strip().strip('"')
            if not name:
                continue
            params = {}
            for p in parts[1:]:
                k, _, v = p.partition("=")
                try:
                    params[k.strip()] = int(v.strip())
                except ValueError:
                    pass
            out.append((name, params))
        return out

    state = dict(items(headers.get("ratelimit", "")))
    out = []
    for name, params in items(headers.get("ratelimit-policy", "")):
        if "q" not in params or "w" not in params:
            continue
        now = state.get(name, {})
        out.append(
            Window(
                policy=name,
                limit=params["q"],
                window=float(params["w"]),
                remaining=now.get("r"),
                reset_after=float(now["t"]) if "t" in now else None,
            )
        )
    return out


def job_outcome(view: Any) -> Outcome:
    """A job as ``POST /v1/ops/..`` (200/202) and ``GET /v1/jobs/{id}`` show it."""
    if not isinstance(view, dict) or "job_id" not in view or "status" not in view:
        raise ProtocolError(f"not a job: {str(view)[:200]}")
    status = view["status"]
    if status == "succeeded":
        return Done(
            job_id=view["job_id"],
            operation=view.get("operation", ""),
            result=view.get("result"),
            cost=amount(view.get("cost", 0)),
            currency=str(view.get("currency", "tokens")),
        )
    error = view.get("error")
    if status == "failed" and isinstance(error, dict):
        cause = error.get("cause", "")
        if error.get("upstream_status") is not None:
            return Rejected(
                upstream_status=error["upstream_status"],
                detail=error.get("message"),
                body=error.get("upstream_body"),
                job_id=view["job_id"],
            )
        if cause == "throttle_timeout":
            return ProviderBusy(retry_after=0.0, job_id=view["job_id"], detail=error.get("message"))
        return Failed(
            status=_CAUSE_STATUS.get(cause, 502),
            kind=cause.replace("_", "-"),
            cause=cause,
            charged=error.get("charged"),
            job_id=view["job_id"],
            detail=error.get("message"),
        )
    return Pending(job_id=view["job_id"], status=status, provider_queue=view.get("provider_queue"))


def _failed(status: int, p: Problem) -> Failed:
    return Failed(
        status=status,
        kind=p.slug,
        cause=p.cause,
        charged=p.charged,
        job_id=p.job_id,
        detail=p.detail,
    )


def classify(status: int, headers: Mapping[str, str], body: Any, job_read: bool = False) -> Step:
    """Reads the answer to an operation call (or to a job's status: ``job_read``)."""
    if status in (200, 202):
        try:
            outcome = job_outcome(body)
        except ProtocolError as e:
            return Final(e)
        if status == 200 and not job_read and not isinstance(outcome, Done):
            return Final(ProtocolError(f"HTTP 200 with a job that is not done: {str(body)[:200]}"))
        return Final(outcome)
    problem = Problem.parse(body)
    hint = retry_after(headers)
    if problem is None:
        err = ProtocolError(f"HTTP {status}: {str(body)[:200]}")
        if 502 <= status <= 504:
            return Retry(hint, err)
        return Final(err)
    slug = problem.slug
    if status == 429 and slug == "quota-exceeded":
        exact = problem.retry_after_ms / 1000.0 if problem.retry_after_ms is not None else None
        return Final(
            BudgetExhausted(
                retry_after=exact if exact is not None else (hint or 0.0),
                windows=windows(headers),
                detail=problem.detail,
            )
        )
    if status == 429 and slug == "stored-bytes-exceeded":
        return Final(
            StoredBytesExceeded(
                stored_bytes=problem.stored_bytes or 0,
                max_stored_bytes=problem.max_stored_bytes or 0,
            )
        )
    if status in (401, 403, 429):
        return Final(AuthError(problem, hint))
    if slug == "upstream-rejected":
        return Final(
            Rejected(
                upstream_status=problem.upstream_status or status,
                detail=problem.detail,
                body=problem.upstream_body,
                job_id=problem.job_id,
            )
        )
    if status == 503:
        return Retry(hint if hint is not None else 1.0, Unavailable(problem, hint))
    if status in (502, 504):
        if slug == "throttle-timeout":
            end: Union[Outcome, ProblemError] = ProviderBusy(
                retry_after=hint or 0.0, job_id=problem.job_id, detail=problem.detail
            )
        else:
            end = _failed(status, problem)
        return Retry(hint, end) if problem.charged is False else Final(end)
    if status == 410:
        return Final(_failed(status, problem))
    if status >= 500:
        return Final(ServerError(problem))
    return Final(InvalidRequest(problem))
