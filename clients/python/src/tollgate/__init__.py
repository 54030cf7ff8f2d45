"""A client of tollgate's HTTP api, for applications that call operations for
their users.

Each call is one logical call: it gets an ``Idempotency-Key`` when it is made
and sends that key on every attempt, so a retry after a lost answer, a 503 or
a refunded failure is the same request, charged at most once. A call returns
an outcome (``Done``, ``Pending``, ``BudgetExhausted``, ``ProviderBusy``,
``Rejected``, ``StoredBytesExceeded``, ``Failed``) or raises a
``TollgateError`` when it could not be made or was refused as it is;
``unwrap(outcome)`` turns every outcome but ``Done`` into an exception.
"""

from ._answer import classify
from ._client import AsyncClient, Client, RetryEvent, RetryPolicy, Usage, USER_HEADER
from ._outcomes import (
    Amount,
    amount,
    AuthError,
    BudgetExhausted,
    BudgetExhaustedError,
    ConfigError,
    Done,
    Failed,
    FailedError,
    InvalidRequest,
    Outcome,
    OutcomeError,
    Pending,
    PendingError,
    Problem,
    ProblemError,
    ProtocolError,
    ProviderBusy,
    ProviderBusyError,
    Rejected,
    RejectedError,
    ServerError,
    StoredBytesExceeded,
    StoredBytesExceededError,
    TollgateError,
    TransportError,
    Unavailable,
    Window,
    unwrap,
)

__all__ = [
    "Amount",
    "amount",
    "AsyncClient",
    "AuthError",
    "BudgetExhausted",
    "BudgetExhaustedError",
    "Client",
    "ConfigError",
    "Done",
    "Failed",
    "FailedError",
    "InvalidRequest",
    "Outcome",
    "OutcomeError",
    "Pending",
    "PendingError",
    "Problem",
    "ProblemError",
    "ProtocolError",
    "ProviderBusy",
    "ProviderBusyError",
    "Rejected",
    "RejectedError",
    "RetryEvent",
    "RetryPolicy",
    "ServerError",
    "StoredBytesExceeded",
    "StoredBytesExceededError",
    "TollgateError",
    "TransportError",
    "USER_HEADER",
    "Unavailable",
    "Usage",
    "Window",
    "classify",
    "unwrap",
]
