"""A small FastAPI service whose logged-in users ask for summaries. Each
summary is one tollgate call, charged to the user who asked: the app holds a
tollgate *service* key and names the user on every call (``Tollgate-User``).

Without a service key (``TOLLGATE_SERVICE_KEY`` unset) it runs with one user
key (``TOLLGATE_API_KEY``): then every user of the app spends that one
tollgate user's budget.

What a user sees, by tollgate's outcome:

- ``Done``: 200 and the summary;
- ``BudgetExhausted``: 429 "You are out of budget until <time>", with
  ``Retry-After``;
- ``ProviderBusy``: the client already retried (each retry is logged as
  "provider busy, retrying in ..."); 503 "try again in N s", with ``Retry-After``;
- ``Pending``: 202 and where to ask again (``GET /summaries/{job_id}``);
- ``Rejected``: 422 with tollgate's detail (never the upstream's raw body);
- anything else: 502/503, nothing about tollgate's internals.

Run it: ``TOLLGATE_URL=http://127.0.0.1:8080 TOLLGATE_API_KEY=tg_user_...
uvicorn app:app`` (``tollgate all`` prints such a key at start).
"""

from __future__ import annotations

import contextvars
import logging
import os
import secrets
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from typing import Dict, List, Optional

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import tollgate

log = logging.getLogger("fastapi-app")

# The demo's users and passwords; a real app has its own user store.
DEMO_USERS = {"alice": "alice-password", "bob": "bob-password"}

# The retries of the request being served (the client's on_retry runs in its task).
_retries: contextvars.ContextVar[Optional[List[tollgate.RetryEvent]]] = contextvars.ContextVar(
    "retries", default=None
)


def _on_retry(event: tollgate.RetryEvent) -> None:
    what = "provider busy" if event.reason in ("502", "504", "refunded") else f"tollgate answered {event.reason}"
    log.warning("%s, retrying in %.1f s (retry %d, same Idempotency-Key)", what, event.pause, event.retry)
    seen = _retries.get()
    if seen is not None:
        seen.append(event)


class Login(BaseModel):
    user: str
    password: str


class SummaryRequest(BaseModel):
    text: str


def _until(seconds: float) -> str:
    at = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    return at.isoformat(timespec="seconds")


def _answer(outcome: tollgate.Outcome, retries: int) -> JSONResponse:
    if isinstance(outcome, tollgate.Done):
        return JSONResponse({"summary": outcome.result, "job_id": outcome.job_id, "retries": retries})
    if isinstance(outcome, tollgate.Pending):
        return JSONResponse(
            {"status": outcome.status, "job_id": outcome.job_id, "poll": f"/summaries/{outcome.job_id}"},
            status_code=202,
        )
    if isinstance(outcome, tollgate.BudgetExhausted):
        until = _until(outcome.retry_after)
        return JSONResponse(
            {"error": "out_of_budget", "message": f"You are out of budget until {until}.", "until": until},
            status_code=429,
            headers={"Retry-After": str(max(int(outcome.retry_after + 0.999), 1))},
        )
    if isinstance(outcome, tollgate.ProviderBusy):
        wait = max(int(outcome.retry_after + 0.999), 1)
        return JSONResponse(
            {
                "error": "provider_busy",
                "message": f"The provider is busy (retried {retries} times): try again in {wait} s.",
                "retries": retries,
            },
            status_code=503,
            headers={"Retry-After": str(wait)},
        )
    if isinstance(outcome, tollgate.Rejected):
        return JSONResponse({"error": "rejected", "message": outcome.detail or "the input was rejected"}, status_code=422)
    if isinstance(outcome, tollgate.StoredBytesExceeded):
        return JSONResponse({"error": "too_many_pending", "message": "Too many summaries in progress."}, status_code=429)
    return JSONResponse({"error": "failed", "message": "The summary failed; try again later."}, status_code=502)


def create_app(
    tollgate_url: Optional[str] = None,
    service_key: Optional[str] = None,
    api_key: Optional[str] = None,
    operation: Optional[str] = None,
    deadline: Optional[float] = None,
) -> FastAPI:
    """The app; every argument defaults to its environment variable
    (``TOLLGATE_URL``, ``TOLLGATE_SERVICE_KEY``, ``TOLLGATE_API_KEY``,
    ``SUMMARY_OPERATION`` = ``llm.structured``, ``TOLLGATE_DEADLINE`` = 20 s)."""
    url = tollgate_url or os.environ.get("TOLLGATE_URL", "http://127.0.0.1:8080")
    service_key = service_key or os.environ.get("TOLLGATE_SERVICE_KEY")
    key = service_key or api_key or os.environ.get("TOLLGATE_API_KEY")
    if not key:
        raise RuntimeError("set TOLLGATE_SERVICE_KEY (or, for one shared tollgate user, TOLLGATE_API_KEY)")
    op = operation or os.environ.get("SUMMARY_OPERATION", "llm.structured")
    policy = tollgate.RetryPolicy(deadline=deadline or float(os.environ.get("TOLLGATE_DEADLINE", "20")))
    acts_for_users = service_key is not None
    sessions: Dict[str, str] = {}
    state: Dict[str, tollgate.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state["tollgate"] = tollgate.AsyncClient(url, key, retry=policy, on_retry=_on_retry)
        yield
        await state["tollgate"].aclose()

    app = FastAPI(title="summaries (a tollgate example)", lifespan=lifespan)

    def current_user(authorization: str = Header(default="")) -> str:
        token = authorization.removeprefix("Bearer ").strip()
        user = sessions.get(token)
        if user is None:
            raise HTTPException(status_code=401, detail="log in first: POST /login")
        return user

    def as_user(user: str) -> Optional[str]:
        """Whom tollgate charges: the user (service key), or nobody named (user key)."""
        return user if acts_for_users else None

    @app.post("/login")
    def login(body: Login) -> dict:
        if DEMO_USERS.get(body.user) != body.password:
            raise HTTPException(status_code=401, detail="unknown user or wrong password")
        token = secrets.token_urlsafe(24)
        sessions[token] = body.user
        return {"token": token}

    @app.post("/summaries")
    async def summarize(body: SummaryRequest, user: str = Depends(current_user)) -> JSONResponse:
        retries: List[tollgate.RetryEvent] = []
        _retries.set(retries)
        try:
            outcome = await state["tollgate"].call(op, {"prompt": f"Summarize: {body.text}"}, on_behalf_of=as_user(user))
        except tollgate.Unavailable as e:
            return JSONResponse({"error": "unavailable", "message": "Try again shortly."}, status_code=503,
                                headers={"Retry-After": str(int(e.retry_after or 1))})
        except tollgate.TransportError:
            return JSONResponse({"error": "unavailable", "message": "Try again shortly."}, status_code=503)
        return _answer(outcome, len(retries))

    @app.get("/summaries/{job_id}")
    async def summary(job_id: str, user: str = Depends(current_user)) -> JSONResponse:
        try:
            outcome = await state["tollgate"].job(job_id, on_behalf_of=as_user(user))
        except tollgate.InvalidRequest:
            raise HTTPException(status_code=404, detail="no such summary") from None
        return _answer(outcome, 0)

    @app.get("/me/budget")
    async def budget(user: str = Depends(current_user)) -> dict:
        usage = await state["tollgate"].usage(limit=1, on_behalf_of=as_user(user))
        return {
            "user": user,
            "used": usage.used,
            "limit": usage.limit,
            "remaining": usage.remaining,
            "resets_at": usage.reset_at,
        }

    return app


if os.environ.get("TOLLGATE_SERVICE_KEY") or os.environ.get("TOLLGATE_API_KEY"):
    app = create_app()
