"""The clients: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

Both run the same flows, written once as generators that yield what to do
(send a request, sleep) and receive what happened (a response, a transport
error); each client only carries those steps out with httpx."""

from __future__ import annotations

import json as _json
import random
from collections import OrderedDict
import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Generator, List, Mapping, Optional, Union

import httpx

from ._answer import Final, Retry, classify, job_outcome
from ._outcomes import (
    Amount,
    amount,
    BudgetExhausted,
    ConfigError,
    Done,
    Failed,
    Outcome,
    Pending,
    ProtocolError,
    ProviderBusy,
    TollgateError,
    TransportError,
)

USER_HEADER = "Tollgate-User"
_ID = re.compile(r"^[A-Za-z0-9._@+=~-]{1,255}$")
_KEY = re.compile(r"^[!-~]([ \t!-~]{0,253}[!-~])?$")
_MAX_POLL = 1.0
# Below this many seconds left, a sync call polls its pending job instead of
# asking the server to wait (in whole seconds) again.
_LONG_POLL_LEFT = 1.5
_SUBMIT_WAIT = 10
# How many submitted jobs' users a client remembers (see _Core._remember).
_JOB_USERS = 4096


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries. Which answers are retried is fixed (see the
    package docs); this says how long and how often.

    ``deadline``: the most one logical call takes, every attempt and wait
    included (seconds). ``max_retries``: retries after the first attempt.
    ``base``/``max_backoff``: the exponential backoff without a server hint.
    ``wait_for_budget``: wait out a budget 429 when it fits in this many
    seconds (and the deadline); ``None``: return ``BudgetExhausted`` at once."""

    deadline: float = 60.0
    max_retries: int = 8
    base: float = 0.2
    max_backoff: float = 5.0
    wait_for_budget: Optional[float] = None

    def ceiling(self, retry: int) -> float:
        """The backoff before retry ``retry`` (1 for the first) without jitter."""
        return max(min(self.base * (2 ** min(max(retry - 1, 0), 20)), self.max_backoff), 0.001)

    def backoff(self, retry: int, hint: Optional[float]) -> float:
        """With a server hint: the hint plus up to a quarter of it more (at most
        1 s more), never less. Without: uniform in ``[b/2, b]``, ``b = ceiling(retry)``."""
        if hint is not None:
            return hint + random.random() * min(hint / 4, 1.0)
        b = self.ceiling(retry)
        return b / 2 + random.random() * b / 2


@dataclass(frozen=True)
class RetryEvent:
    """Given to ``on_retry`` before each pause: which call, which retry, how
    long the pause is, and why (``"503"``, ``"transport"``, ``"502"``,
    ``"504"``, ``"budget"``, ``"refunded"``)."""

    idempotency_key: str
    retry: int
    pause: float
    reason: str


@dataclass(frozen=True)
class Usage:
    """``GET /v1/usage``: the budget (of the window closest to exhaustion),
    every window of the plan, and one page of the spend events."""

    user: str
    plan: str
    # Amounts, exactly: ``int`` tokens, or ``decimal.Decimal`` of ``currency``
    # (the windows' and events' too).
    used: Amount
    limit: Amount
    remaining: Amount
    window_secs: int
    reset_after_secs: Optional[int]
    reset_at: Optional[str]
    windows: List[dict]
    events: List[dict]
    next_cursor: Optional[str]
    # True when an admin set this user's limits (``plan`` is then "custom").
    custom_limits: bool = False
    # What the amounts count: "tokens", or an ISO 4217 currency (amounts are
    # then ``decimal.Decimal`` of it: ``Decimal("0.00015")``).
    currency: str = "tokens"


@dataclass(frozen=True)
class _Send:
    method: str
    path: str
    headers: Dict[str, str]
    body: Optional[bytes]
    timeout: float


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Answer:
    status: int
    headers: Mapping[str, str]
    body: Any
    elapsed: float


Flow = Generator[Union[_Send, _Sleep], Union[_Answer, Exception, None], Any]


class _Progress:
    def __init__(self, budget: float) -> None:
        self.deadline = time.monotonic() + budget
        self.attempts = 0
        self.retries = 0

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)


def _stamp(outcome: Outcome, progress: _Progress, policy: RetryPolicy) -> Outcome:
    if isinstance(outcome, (Done, Pending, Failed)):
        return replace(outcome, attempts=progress.attempts)
    if isinstance(outcome, ProviderBusy) and outcome.retry_after == 0.0:
        return replace(outcome, retry_after=policy.ceiling(progress.retries + 1))
    return outcome


def _released(outcome: Outcome) -> bool:
    """A job that failed and gave its charge back: its key is free again, so a
    retry is a new attempt."""
    return isinstance(outcome, ProviderBusy) or (
        isinstance(outcome, Failed) and outcome.charged is False and outcome.status != 503
    )


def _end(result: Union[Outcome, TollgateError], progress: _Progress, policy: RetryPolicy) -> Outcome:
    if isinstance(result, TollgateError):
        raise result
    return _stamp(result, progress, policy)


class _Core:
    """What both clients share: settings, request building and the flows."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        on_behalf_of: Optional[str],
        retry: Optional[RetryPolicy],
        on_retry: Optional[Callable[[RetryEvent], None]],
    ) -> None:
        base = base_url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ConfigError(f"the base URL must start with http:// or https:// (got {base_url!r})")
        self.base = base
        self._auth = f"Bearer {api_key.strip()}"
        self.user = _check_user(on_behalf_of) if on_behalf_of is not None else None
        self.retry = retry or RetryPolicy()
        self.on_retry = on_retry
        # The user each job was submitted for (a service key's call names one):
        # job() and wait() of that job need not name it again. The newest
        # _JOB_USERS jobs are remembered.
        self._job_users: "OrderedDict[str, str]" = OrderedDict()

    def _remember(self, job_id: str, user: Optional[str]) -> None:
        u = user if user is not None else self.user
        if u is None:
            return
        self._job_users[job_id] = u
        self._job_users.move_to_end(job_id)
        while len(self._job_users) > _JOB_USERS:
            self._job_users.popitem(last=False)

    def _headers(self, user: Optional[str]) -> Dict[str, str]:
        h = {"Authorization": self._auth}
        u = user if user is not None else self.user
        if u is not None:
            h[USER_HEADER] = _check_user(u)
        return h

    def _pause(self, progress: _Progress, hint: Optional[float], key: str, reason: str) -> Optional[float]:
        """The pause before the next retry, or ``None`` when none is left."""
        progress.retries += 1
        pause = self.retry.backoff(progress.retries, hint)
        if progress.retries > self.retry.max_retries or pause >= progress.left():
            return None
        if self.on_retry is not None:
            self.on_retry(RetryEvent(key, progress.retries, pause, reason))
        return pause

    def _post_flow(
        self, operation: str, body: bytes, key: str, user: Optional[str], mode: str, wait: Optional[int], progress: _Progress
    ) -> Flow:
        """POSTs the call until it ends: retries, and (``mode == "sync"``) asks
        again with the same key while the job runs, until the deadline."""
        poll = 0.05
        while True:
            progress.attempts += 1
            left = progress.left()
            headers = self._headers(user)
            headers.update({"Idempotency-Key": key, "Content-Type": "application/json"})
            if mode == "sync":
                headers["Prefer"] = f"wait={max(int(left) - 1, 0)}"
            elif wait is None:
                headers["Prefer"] = "respond-async"
            else:
                headers["Prefer"] = f"respond-async, wait={wait}"
            got = yield _Send("POST", f"/v1/ops/{operation}", headers, body, max(left, 0.1))
            if isinstance(got, Exception):
                step: Union[Final, Retry] = Retry(None, TransportError(str(got) or type(got).__name__))
                reason = "transport"
            else:
                step = classify(got.status, got.headers, got.body)
                reason = str(got.status)
            if isinstance(step, Final):
                result = step.result
                budget = self.retry.wait_for_budget
                if mode == "sync" and isinstance(result, Pending) and isinstance(got, _Answer):
                    if progress.left() >= _LONG_POLL_LEFT:
                        if got.elapsed < 0.2:
                            yield _Sleep(poll)
                            poll = min(poll * 2, _MAX_POLL)
                        continue
                    # Too little time left for a server-side wait (whole
                    # seconds): poll the job until the deadline instead.
                    outcome = yield from self._wait_flow(result.job_id, user, progress)
                    if not _released(outcome):
                        return _stamp(outcome, progress, self.retry)
                    step = Retry(None, outcome)
                    reason = "refunded"
                elif isinstance(result, BudgetExhausted) and budget is not None and result.retry_after <= budget:
                    step = Retry(result.retry_after, result)
                    reason = "budget"
                else:
                    if isinstance(result, Pending):
                        self._remember(result.job_id, user)
                    return _end(result, progress, self.retry)
            pause = self._pause(progress, step.hint, key, reason)
            if pause is None:
                return _end(step.otherwise, progress, self.retry)
            yield _Sleep(pause)

    def _read_flow(self, path: str, user: Optional[str], progress: _Progress) -> Flow:
        """A GET answered 200 (its answer), retried on 503 and transport errors."""
        while True:
            progress.attempts += 1
            got = yield _Send("GET", path, self._headers(user), None, min(max(progress.left(), 0.1), 30.0))
            if isinstance(got, _Answer) and got.status == 200:
                return got
            if isinstance(got, Exception):
                step: Union[Final, Retry] = Retry(None, TransportError(str(got) or type(got).__name__))
            else:
                step = classify(got.status, got.headers, got.body, job_read=True)
            if isinstance(step, Final):
                if isinstance(step.result, TollgateError):
                    raise step.result
                raise ProtocolError(f"GET {path} answered {got.status}")  # type: ignore[union-attr]
            pause = self._pause(progress, step.hint, path, "transport" if isinstance(got, Exception) else "503")
            if pause is None:
                if isinstance(step.otherwise, TollgateError):
                    raise step.otherwise
                raise ProtocolError(f"GET {path}: no usable answer")
            yield _Sleep(pause)

    def _job_flow(self, job_id: str, user: Optional[str], progress: _Progress) -> Flow:
        if not _ID.match(job_id):
            raise ConfigError(f"{job_id!r} is not a job id")
        if user is None:
            user = self._job_users.get(job_id)
        got = yield from self._read_flow(f"/v1/jobs/{job_id}", user, progress)
        return _stamp(job_outcome(got.body), progress, self.retry)

    def _wait_flow(self, job_id: str, user: Optional[str], progress: _Progress) -> Flow:
        poll = 0.05
        while True:
            outcome = yield from self._job_flow(job_id, user, progress)
            if not isinstance(outcome, Pending) or poll >= progress.left():
                return outcome
            yield _Sleep(poll)
            poll = min(poll * 1.5, _MAX_POLL)

    def _submit_and_wait_flow(self, operation: str, body: bytes, key: str, user: Optional[str], progress: _Progress) -> Flow:
        while True:
            wait = min(max(int(progress.left()) - 1, 0), _SUBMIT_WAIT)
            outcome = yield from self._post_flow(operation, body, key, user, "async", wait, progress)
            if isinstance(outcome, Pending):
                outcome = yield from self._wait_flow(outcome.job_id, user, progress)
            if not _released(outcome):
                return outcome
            pause = self._pause(progress, None, key, "refunded")
            if pause is None:
                return _stamp(outcome, progress, self.retry)
            yield _Sleep(pause)

    def _prepare(
        self, operation: str, input: Any, idempotency_key: Optional[str], deadline: Optional[float]
    ) -> tuple:
        if not _ID.match(operation):
            raise ConfigError(f"{operation!r} is not an operation name")
        key = idempotency_key if idempotency_key is not None else f"tgc-{uuid.uuid4().hex}"
        if not _KEY.match(key):
            raise ConfigError("the Idempotency-Key must be 1 to 255 visible ASCII characters")
        body = _json.dumps(input, separators=(",", ":")).encode()
        return key, body, _Progress(self.retry.deadline if deadline is None else deadline)

    @staticmethod
    def _usage_path(cursor: Optional[str], limit: Optional[int]) -> str:
        query = []
        if cursor is not None:
            query.append(("cursor", cursor))
        if limit is not None:
            query.append(("limit", str(limit)))
        return "/v1/usage" + (("?" + httpx.QueryParams(query).__str__()) if query else "")

    @staticmethod
    def _usage(answer: _Answer) -> Usage:
        b = answer.body
        try:
            return Usage(
                user=b["user"],
                plan=b["plan"],
                used=amount(b["used"]),
                limit=amount(b["limit"]),
                remaining=amount(b["remaining"]),
                window_secs=b["window_secs"],
                reset_after_secs=b.get("reset_after_secs"),
                reset_at=b.get("reset_at"),
                windows=[_amounts(w, ("limit", "used", "remaining")) for w in b.get("windows", [])],
                events=[_amounts(e, ("cost", "estimate")) for e in b.get("events", [])],
                next_cursor=b.get("next_cursor"),
                custom_limits=bool(b.get("custom_limits", False)),
                currency=str(b.get("currency", "tokens")),
            )
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"a usage body that does not parse: {e}") from None


def _amounts(item: dict, fields: tuple) -> dict:
    """``item`` with each of ``fields`` present (and not null) read by ``amount``."""
    return {k: (amount(v) if k in fields and v is not None else v) for k, v in item.items()}


def _check_user(user: str) -> str:
    if not _ID.match(user) or user in (".", ".."):
        raise ConfigError(f"{user!r} is not a valid user id")
    return user


def _answer(resp: httpx.Response, started: float) -> _Answer:
    try:
        body = resp.json() if resp.content else None
    except ValueError:
        body = resp.text[:200]
    return _Answer(resp.status_code, resp.headers, body, time.monotonic() - started)


class Client(_Core):
    """A blocking client of one tollgate api with one credential.

    ``on_behalf_of``: the user a service key acts for by default (the
    ``Tollgate-User`` header); each call may name another. ``on_retry`` is
    called before each retry's pause (e.g. to log "provider busy, retrying")."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        on_behalf_of: Optional[str] = None,
        retry: Optional[RetryPolicy] = None,
        on_retry: Optional[Callable[[RetryEvent], None]] = None,
        http: Optional[httpx.Client] = None,
    ) -> None:
        super().__init__(base_url, api_key, on_behalf_of, retry, on_retry)
        self._http = http or httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, flow: Flow) -> Any:
        try:
            action = next(flow)
            while True:
                if isinstance(action, _Sleep):
                    time.sleep(action.seconds)
                    action = flow.send(None)
                    continue
                started = time.monotonic()
                try:
                    resp = self._http.request(
                        action.method, self.base + action.path, headers=action.headers,
                        content=action.body, timeout=action.timeout,
                    )
                    got: Union[_Answer, Exception] = _answer(resp, started)
                except httpx.TransportError as e:
                    got = e
                action = flow.send(got)
        except StopIteration as stop:
            return stop.value

    def call(
        self, operation: str, input: Any, *, on_behalf_of: Optional[str] = None,
        idempotency_key: Optional[str] = None, deadline: Optional[float] = None,
    ) -> Outcome:
        """Calls ``operation`` with ``input`` (a JSON object) and waits for the
        result, retrying with one Idempotency-Key (fresh unless given) within
        the deadline; a job still running then is ``Pending``."""
        key, body, progress = self._prepare(operation, input, idempotency_key, deadline)
        return self._run(self._post_flow(operation, body, key, on_behalf_of, "sync", None, progress))

    def submit(
        self, operation: str, input: Any, *, on_behalf_of: Optional[str] = None,
        idempotency_key: Optional[str] = None, deadline: Optional[float] = None,
    ) -> Outcome:
        """Submits without waiting: ``Pending`` with the job's id once accepted."""
        key, body, progress = self._prepare(operation, input, idempotency_key, deadline)
        return self._run(self._post_flow(operation, body, key, on_behalf_of, "async", None, progress))

    def submit_and_wait(
        self, operation: str, input: Any, *, on_behalf_of: Optional[str] = None,
        idempotency_key: Optional[str] = None, deadline: Optional[float] = None,
    ) -> Outcome:
        """Submits asynchronously (with ``Prefer: wait``), then polls the job
        until it ends or the deadline passes; a refunded failure is submitted
        again with the same key while the policy allows."""
        key, body, progress = self._prepare(operation, input, idempotency_key, deadline)
        return self._run(self._submit_and_wait_flow(operation, body, key, on_behalf_of, progress))

    def job(self, job_id: str, *, on_behalf_of: Optional[str] = None) -> Outcome:
        """The job as it stands (``Pending`` unless final)."""
        return self._run(self._job_flow(job_id, on_behalf_of, _Progress(self.retry.deadline)))

    def wait(self, job_id: str, timeout: float = 30.0, *, on_behalf_of: Optional[str] = None) -> Outcome:
        """Polls the job until it ends, at most ``timeout`` seconds."""
        return self._run(self._wait_flow(job_id, on_behalf_of, _Progress(timeout)))

    def usage(self, *, cursor: Optional[str] = None, limit: Optional[int] = None, on_behalf_of: Optional[str] = None) -> Usage:
        """The budget and one page of the audit trail (follow ``next_cursor``)."""
        flow = self._read_flow(self._usage_path(cursor, limit), on_behalf_of, _Progress(self.retry.deadline))
        return self._usage(self._run(flow))


class AsyncClient(_Core):
    """The asyncio twin of :class:`Client`: the same calls, awaited."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        on_behalf_of: Optional[str] = None,
        retry: Optional[RetryPolicy] = None,
        on_retry: Optional[Callable[[RetryEvent], None]] = None,
        http: Optional[httpx.AsyncClient] = None,
    ) -> None:
        super().__init__(base_url, api_key, on_behalf_of, retry, on_retry)
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, flow: Flow) -> Any:
        import asyncio

        try:
            action = next(flow)
            while True:
                if isinstance(action, _Sleep):
                    await asyncio.sleep(action.seconds)
                    action = flow.send(None)
                    continue
                started = time.monotonic()
                try:
                    resp = await self._http.request(
                        action.method, self.base + action.path, headers=action.headers,
                        content=action.body, timeout=action.timeout,
                    )
                    got: Union[_Answer, Exception] = _answer(resp, started)
                except httpx.TransportError as e:
                    got = e
                action = flow.send(got)
        except StopIteration as stop:
            return stop.value

    async def call(
        self, operation: str, input: Any, *, on_behalf_of: Optional[str] = None,
        idempotency_key: Optional[str] = None, deadline: Optional[float] = None,
    ) -> Outcome:
        key, body, progress = self._prepare(operation, input, idempotency_key, deadline)
        return await self._run(self._post_flow(operation, body, key, on_behalf_of, "sync", None, progress))

    async def submit(
        self, operation: str, input: Any, *, on_behalf_of: Optional[str] = None,
        idempotency_key: Optional[str] = None, deadline: Optional[float] = None,
    ) -> Outcome:
        key, body, progress = self._prepare(operation, input, idempotency_key, deadline)
        return await self._run(self._post_flow(operation, body, key, on_behalf_of, "async", None, progress))

    async def submit_and_wait(
        self, operation: str, input: Any, *, on_behalf_of: Optional[str] = None,
        idempotency_key: Optional[str] = None, deadline: Optional[float] = None,
    ) -> Outcome:
        key, body, progress = self._prepare(operation, input, idempotency_key, deadline)
        return await self._run(self._submit_and_wait_flow(operation, body, key, on_behalf_of, progress))

    async def job(self, job_id: str, *, on_behalf_of: Optional[str] = None) -> Outcome:
        return await self._run(self._job_flow(job_id, on_behalf_of, _Progress(self.retry.deadline)))

    async def wait(self, job_id: str, timeout: float = 30.0, *, on_behalf_of: Optional[str] = None) -> Outcome:
        return await self._run(self._wait_flow(job_id, on_behalf_of, _Progress(timeout)))

    async def usage(self, *, cursor: Optional[str] = None, limit: Optional[int] = None, on_behalf_of: Optional[str] = None) -> Usage:
        flow = self._read_flow(self._usage_path(cursor, limit), on_behalf_of, _Progress(self.retry.deadline))
        return self._usage(await self._run(flow))
