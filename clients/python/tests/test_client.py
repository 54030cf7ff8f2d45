"""The Python client against the real binary: ``tollgate all`` on a free port,
embedded and on a private Redis. The same three cases as the Rust client's
(tests/it/client.rs): a budget refusal is typed with the server's exact
``retry_after``; an async submission is waited for; a 503 while Redis
restarts under a running call is retried with the call's key, charged once."""

import asyncio
import hashlib
import threading
import time

import httpx
import pytest

import tollgate
from tollgate import (
    AsyncClient,
    BudgetExhausted,
    BudgetExhaustedError,
    ConfigError,
    Client,
    Done,
    Pending,
    RetryPolicy,
    unwrap,
)
from tollgate.testing import MockProvider, Redis, Tollgate

COST = 8
LIMIT = 16
WINDOW_MS = 12 * 3600 * 1000

CONFIG = f"""
default_plan = "small"
[plans.small]
limit = {LIMIT}
window = "12h"
[providers.mock]
rate = 1000
burst = 100
max_wait = "10s"
[operations."echo.op"]
cost = {COST}
provider = "mock"
"""


def job_id_of(user: str, key: str) -> str:
    """The job id tollgate makes of a user's Idempotency-Key."""
    return "idem-" + hashlib.sha256(user.encode() + b"\0" + key.encode()).digest()[:16].hex()


@pytest.fixture(params=["embedded", "redis"])
def server(request):
    redis = Redis() if request.param == "redis" else None
    tg = Tollgate(CONFIG, redis.url if redis else None)
    yield tg
    tg.stop()
    if redis:
        redis.close()


def test_budget_exhaustion_is_typed_with_the_exact_retry_after(server):
    with Client(server.base, server.key) as client:
        for i in range(2):
            done = client.call("echo.op", {"i": i})
            assert isinstance(done, Done), done
            assert (done.attempts, done.cost) == (1, COST)
            assert done.result["echo"] == {"i": i}
        usage = client.usage()
        assert (usage.used, usage.limit) == (LIMIT, LIMIT)
        first_at = min(e["at_ms"] for e in usage.events)

        before = int(time.time() * 1000)
        outcome = client.call("echo.op", {"i": 2})
        after = int(time.time() * 1000)
        assert isinstance(outcome, BudgetExhausted), outcome
        ms = round(outcome.retry_after * 1000)
        least, most = first_at + WINDOW_MS - after, first_at + WINDOW_MS - before
        assert least - 1 <= ms <= most + 1, (ms, least, most)
        assert [(w.limit, w.window, w.remaining) for w in outcome.windows] == [(LIMIT, WINDOW_MS / 1000, 0)]
        with pytest.raises(BudgetExhaustedError) as raised:
            unwrap(outcome)
        assert raised.value.retry_after == outcome.retry_after
        assert client.usage().used == LIMIT


def test_an_async_submission_is_waited_for(server):
    async def run():
        async with AsyncClient(server.base, server.key) as client:
            key = "order-1"
            pending = await client.submit("echo.op", {"q": "async"}, idempotency_key=key)
            assert isinstance(pending, Pending), pending
            assert pending.job_id == job_id_of("dev", key)
            done = await client.wait(pending.job_id, timeout=30)
            assert isinstance(done, Done), done
            assert done.job_id == pending.job_id
            assert done.result["echo"] == {"q": "async"}

            both = await client.submit_and_wait("echo.op", {"q": "both"}, idempotency_key="order-2")
            assert isinstance(both, Done), both
            assert both.result["echo"] == {"q": "both"}
            again = await client.submit_and_wait("echo.op", {"q": "both"}, idempotency_key="order-2")
            assert again.job_id == both.job_id
            assert (await client.usage()).used == 2 * COST

    asyncio.run(run())
    # The blocking client waits the same way; the same key is the same job.
    with Client(server.base, server.key) as client:
        done = client.submit_and_wait("echo.op", {"q": "both"}, idempotency_key="order-2")
        assert isinstance(done, Done) and done.result["echo"] == {"q": "both"}, done
        assert client.usage().used == 2 * COST


def test_a_service_keys_job_is_waited_for_without_naming_its_user_again(server):
    """A service key submits for an end user; wait() and job() of that job
    find it without the user named again (the client remembers it)."""
    http = httpx.Client(timeout=10)
    r = http.post(
        f"{server.base}/admin/users",
        headers={"Authorization": f"Bearer {server.admin_token}"},
        json={"user": "backend", "kind": "service"},
    )
    assert r.status_code == 201, r.text
    service_key = r.json()["api_key"]
    http.close()
    with Client(server.base, service_key) as client:
        pending = client.submit("echo.op", {"q": "for carol"}, on_behalf_of="carol")
        assert isinstance(pending, Pending), pending
        done = client.wait(pending.job_id, timeout=30)
        assert isinstance(done, Done), done
        assert done.result["echo"] == {"q": "for carol"}
        assert isinstance(client.job(pending.job_id), Done)
        with pytest.raises(ConfigError):
            client.submit("echo.op", {}, on_behalf_of="..")


def test_a_503_during_a_redis_restart_is_retried_with_the_same_key_and_charged_once():
    """A sync call is charged and its job waits at the upstream (which answers
    after 4 s) when Redis is killed: the api answers 503 while Redis is down.
    The client retries with the same key; once Redis is back from its AOF, the
    retry finds the same job. A client that sent a new key would spend 16."""
    redis = Redis()
    with MockProvider("--latency-ms", "4000") as mock:
        config = CONFIG + (
            f'[providers.up]\nrate = 1000\nburst = 100\nmax_wait = "10s"\nurl = "{mock.url}"\n'
            f'timeout = "20s"\nretries = 0\n'
            f'[operations."slow.op"]\ncost = {COST}\nprovider = "up"\n'
        )
        with Tollgate(config, redis.url) as tg:
            retries = []
            client = Client(
                tg.base, tg.key, retry=RetryPolicy(deadline=60, max_retries=30), on_retry=retries.append
            )
            ended = {}
            thread = threading.Thread(target=lambda: ended.update(outcome=client.call("slow.op", {"q": 1})))
            thread.start()
            deadline = time.monotonic() + 20
            while httpx.get(mock.url + "/stats").json()["requests"] < 1:
                assert time.monotonic() < deadline, "the call never reached the upstream"
                time.sleep(0.02)
            redis.stop()
            time.sleep(2.5)  # the api reads the job every 500 ms: it fails meanwhile
            redis.start()
            thread.join(70)
            assert not thread.is_alive(), "the call outlived its deadline"
            done = ended["outcome"]
            assert isinstance(done, Done), done
            assert done.attempts >= 2 and retries, "no 503 was retried"
            keys = {r.idempotency_key for r in retries}
            assert len(keys) == 1, keys
            usage = client.usage()
            assert usage.used == COST, usage
            job = job_id_of("dev", keys.pop())
            assert [e["request_id"] for e in usage.events] == [job]
            assert done.job_id == job
            client.close()
    redis.close()


def test_the_retry_rules():
    """Which answers are retried, without a server (the same table as the Rust client's)."""
    from tollgate._answer import Final, Retry, classify

    def problem(status, slug, **extra):
        return {"type": f"/problems/{slug}", "title": "t", "status": status, **extra}

    h = {}
    assert isinstance(classify(503, h, problem(503, "backend-unavailable")), Retry)
    assert isinstance(classify(502, h, problem(502, "provider-failure", charged=False)), Retry)
    assert isinstance(classify(504, h, problem(504, "throttle-timeout", charged=False)), Retry)
    assert isinstance(classify(504, h, problem(504, "upstream-unanswered", charged=True)), Final)
    assert isinstance(classify(502, h, "<html>bad gateway</html>"), Retry)
    assert isinstance(classify(429, h, problem(429, "quota-exceeded", retry_after_ms=1)), Final)
    rejected = classify(422, h, problem(422, "upstream-rejected", upstream_status=400, upstream_body={"e": 1}))
    assert rejected.result == tollgate.Rejected(upstream_status=400, body={"e": 1})
    assert isinstance(classify(401, h, problem(401, "unauthorized")).result, tollgate.AuthError)
    busy = RetryPolicy()
    for _ in range(100):
        assert 1.0 <= busy.backoff(1, 1.0) <= 1.25
        assert 0.1 <= busy.backoff(1, None) <= 0.2


def test_amounts_are_exact_in_both_forms():
    """Tokens are ints, money decimal strings read as ``Decimal``; a float or
    a malformed amount is a protocol error, never a rounded number."""
    from decimal import Decimal

    from tollgate._answer import job_outcome
    from tollgate._client import Client as _C

    assert tollgate.amount(40) == 40 and isinstance(tollgate.amount(40), int)
    assert tollgate.amount("0.00015") == Decimal("0.00015")
    assert tollgate.amount("20") == Decimal(20)
    for bad in [0.5, "-1", "1e3", "NaN", "abc", "", None, True, " 1"]:
        with pytest.raises(tollgate.ProtocolError):
            tollgate.amount(bad)
    done = job_outcome(
        {"job_id": "j", "status": "succeeded", "cost": "0.000039", "reserved": "0.000077", "currency": "USD"}
    )
    assert done == Done(job_id="j", operation="", result=None, cost=Decimal("0.000039"), currency="USD")
    done = job_outcome({"job_id": "j", "status": "succeeded", "cost": 2, "reserved": 2})
    assert (done.cost, done.currency) == (2, "tokens")

    class _A:
        body = {
            "user": "ann", "plan": "paid", "currency": "USD",
            "used": "0.000039", "limit": "0.5", "remaining": "0.499961",
            "window_secs": 3600, "reset_after_secs": 3600, "reset_at": None,
            "windows": [{"policy": "budget", "limit": "0.5", "used": "0.000039", "remaining": "0.499961", "window_secs": 3600}],
            "events": [{"request_id": "r", "cost": "0.000039", "estimate": "0.000077", "at_ms": 1}, {"request_id": "s", "cost": "1", "estimate": None, "at_ms": 2}],
            "next_cursor": None,
        }

    u = _C._usage(_A())
    assert (u.used, u.limit, u.remaining) == (Decimal("0.000039"), Decimal("0.5"), Decimal("0.499961"))
    assert u.used + u.remaining == u.limit
    assert u.windows[0]["remaining"] == Decimal("0.499961")
    assert u.events[0]["estimate"] == Decimal("0.000077") and u.events[1]["estimate"] is None
