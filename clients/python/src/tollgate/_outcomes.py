"""What a call ends in: one outcome class per answer an application acts on
differently, the errors for calls that could not be made or were refused as
they are, and the problem+json body behind every error answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, List, Optional, Union


@dataclass(frozen=True)
class Problem:
    """The ``application/problem+json`` body (RFC 9457) of an error answer."""

    type: str = ""
    title: str = ""
    status: int = 0
    detail: Optional[str] = None
    field: Optional[str] = None
    job_id: Optional[str] = None
    cause: Optional[str] = None
    charged: Optional[bool] = None
    retry_after_ms: Optional[int] = None
    waited_ms: Optional[int] = None
    stored_bytes: Optional[int] = None
    max_stored_bytes: Optional[int] = None
    upstream_status: Optional[int] = None
    upstream_body: Any = None

    @property
    def slug(self) -> str:
        """The type's last segment: ``quota-exceeded`` of ``/problems/quota-exceeded``."""
        return self.type.rsplit("/", 1)[-1]

    @classmethod
    def parse(cls, body: Any) -> Optional["Problem"]:
        if not isinstance(body, dict) or not isinstance(body.get("type"), str):
            return None
        known = {k: body.get(k) for k in cls.__dataclass_fields__ if k in body}
        return cls(**known)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.detail or self.title}"


@dataclass(frozen=True)
class Window:
    """One limit of a plan: ``limit`` tokens per ``window`` seconds; ``remaining``
    and ``reset_after`` for the window the ``RateLimit`` header names."""

    policy: str
    limit: int
    window: float
    remaining: Optional[int] = None
    reset_after: Optional[float] = None


# An amount as an answer gives it, read exactly: tokens are ``int``, money is
# ``decimal.Decimal`` (never a float).
Amount = Union[int, Decimal]


def amount(value: Any) -> Amount:
    """An amount of an answer, exactly: an integer (tokens) as ``int``, a
    decimal string (money: ``"0.00015"``) as ``decimal.Decimal``. Anything
    else (a float, a malformed string) is a ``ProtocolError``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            d = Decimal(value)
        except InvalidOperation:
            d = None
        if d is not None and d.is_finite() and d >= 0 and all(c.isdigit() or c == "." for c in value):
            return d
    raise ProtocolError(f"not an amount: {str(value)[:64]!r}")


@dataclass(frozen=True)
class Done:
    """The job succeeded."""

    job_id: str
    operation: str
    result: Any
    # What the job was charged, exactly: its settled charge once the upstream
    # reported usage, else its reservation. An ``int`` of tokens, or with a
    # currency a ``decimal.Decimal`` of it (``Decimal("0.00015")`` USD).
    cost: Amount
    attempts: int = 1
    # What ``cost`` counts: "tokens", or an ISO 4217 currency.
    currency: str = "tokens"


@dataclass(frozen=True)
class Pending:
    """Accepted, not finished (an async submission, or a call whose deadline
    passed while its job ran): ``Client.wait(job_id)`` or send the call again."""

    job_id: str
    status: str
    provider_queue: Optional[dict] = None
    attempts: int = 1


@dataclass(frozen=True)
class BudgetExhausted:
    """Over budget (429), nothing charged. ``retry_after`` (seconds) is exact:
    when the call's cost fits every window of the plan."""

    retry_after: float
    windows: List[Window] = field(default_factory=list)
    detail: Optional[str] = None


@dataclass(frozen=True)
class ProviderBusy:
    """The provider stayed saturated through the client's retries (504
    throttle-timeout, refunded): try again after ``retry_after`` seconds."""

    retry_after: float
    job_id: Optional[str] = None
    detail: Optional[str] = None


@dataclass(frozen=True)
class Rejected:
    """The upstream rejected the input (a 4xx, ``/problems/upstream-rejected``):
    resending it will not help. ``body`` is the upstream's answer when the
    operation exposes it."""

    upstream_status: int
    detail: Optional[str] = None
    body: Any = None
    job_id: Optional[str] = None


@dataclass(frozen=True)
class StoredBytesExceeded:
    """The user's jobs store as many bytes as the plan allows (429), nothing
    charged: retry once some finish or their results expire."""

    stored_bytes: int
    max_stored_bytes: int


@dataclass(frozen=True)
class Failed:
    """The job failed for good (or kept failing until the deadline).
    ``charged``: whether the charge stands (the upstream may have worked)."""

    status: int
    kind: str
    cause: Optional[str] = None
    charged: Optional[bool] = None
    job_id: Optional[str] = None
    detail: Optional[str] = None
    attempts: int = 1


Outcome = Union[Done, Pending, BudgetExhausted, ProviderBusy, Rejected, StoredBytesExceeded, Failed]


class TollgateError(Exception):
    """Every error this package raises."""


class TransportError(TollgateError):
    """No answer (refused, cut, timed out) through every retry the deadline allowed."""


class ConfigError(TollgateError):
    """A client setting or argument that cannot work."""


class ProtocolError(TollgateError):
    """An answer the client does not understand."""


class ProblemError(TollgateError):
    """tollgate answered with a problem the call cannot get past."""

    def __init__(self, problem: Problem, retry_after: Optional[float] = None) -> None:
        super().__init__(str(problem))
        self.problem = problem
        self.retry_after = retry_after


class AuthError(ProblemError):
    """Missing, unknown or revoked credentials (401), a credential that may not
    do this (403), or too many bad keys from this address (429)."""


class InvalidRequest(ProblemError):
    """tollgate refused the request as it is (400, 404, 409, 413, 415, 422)."""


class Unavailable(ProblemError):
    """503 through every retry the deadline allowed. The call may have been
    charged: send it again with the same Idempotency-Key."""


class ServerError(ProblemError):
    """tollgate failed (500)."""


class OutcomeError(TollgateError):
    """Raised by :func:`unwrap` for every outcome but ``Done``; ``outcome`` is it."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(f"{type(outcome).__name__}: {outcome}")
        self.outcome = outcome


class PendingError(OutcomeError):
    pass


class BudgetExhaustedError(OutcomeError):
    @property
    def retry_after(self) -> float:
        return self.outcome.retry_after  # type: ignore[union-attr]


class ProviderBusyError(OutcomeError):
    @property
    def retry_after(self) -> float:
        return self.outcome.retry_after  # type: ignore[union-attr]


class RejectedError(OutcomeError):
    pass


class StoredBytesExceededError(OutcomeError):
    pass


class FailedError(OutcomeError):
    pass


_ERRORS = {
    Pending: PendingError,
    BudgetExhausted: BudgetExhaustedError,
    ProviderBusy: ProviderBusyError,
    Rejected: RejectedError,
    StoredBytesExceeded: StoredBytesExceededError,
    Failed: FailedError,
}


def unwrap(outcome: Outcome) -> Any:
    """The result of a ``Done``; any other outcome raised as its ``OutcomeError``
    (``BudgetExhaustedError``, ``ProviderBusyError``, ...), for code that
    prefers exceptions to matching on results."""
    if isinstance(outcome, Done):
        return outcome.result
    raise _ERRORS[type(outcome)](outcome)
