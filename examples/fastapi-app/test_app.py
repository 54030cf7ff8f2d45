"""The example app against the real tollgate (``tollgate all`` on a free port,
embedded), through FastAPI's TestClient: a user's summaries until the budget
runs out ("out of budget until ..."), and a saturated provider that the client
retries before the app says "provider busy"."""

import logging
from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from app import create_app
from tollgate.testing import Tollgate

# llm.structured costs 8 of a 16-token plan: two summaries. busy.op's provider
# holds one call, then grants one more every 100 s, and a call waits 200 ms at most.
CONFIG = """
default_plan = "small"
[plans.small]
limit = 16
window = "12h"
[providers.llm]
rate = 1000
burst = 100
max_wait = "10s"
[providers.busy]
rate = 0.01
burst = 1
max_wait = "200ms"
[operations."llm.structured"]
cost = 8
provider = "llm"
[operations."busy.op"]
cost = 1
provider = "busy"
"""


@pytest.fixture
def tollgate_all():
    tg = Tollgate(CONFIG)
    yield tg
    tg.stop()


def login(client: TestClient, user: str) -> dict:
    r = client.post("/login", json={"user": user, "password": f"{user}-password"})
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def test_summaries_until_the_budget_runs_out(tollgate_all):
    # No service key on this tollgate: the app runs with the development user's key.
    app = create_app(tollgate_all.base, api_key=tollgate_all.key)
    with TestClient(app) as client:
        assert client.post("/summaries", json={"text": "x"}).status_code == 401
        alice = login(client, "alice")
        for i in range(2):
            r = client.post("/summaries", json={"text": f"report {i}"}, headers=alice)
            assert r.status_code == 200, r.text
            assert r.json()["summary"]["echo"]["prompt"] == f"Summarize: report {i}"
        budget = client.get("/me/budget", headers=alice).json()
        assert (budget["used"], budget["remaining"]) == (16, 0), budget

        r = client.post("/summaries", json={"text": "one more"}, headers=alice)
        assert r.status_code == 429, r.text
        body = r.json()
        assert body["error"] == "out_of_budget"
        assert body["message"].startswith("You are out of budget until ")
        until = datetime.fromisoformat(body["until"])
        expected = datetime.now(timezone.utc) + timedelta(hours=12)
        assert abs((until - expected).total_seconds()) < 60, until
        assert 12 * 3600 - 60 < int(r.headers["retry-after"]) <= 12 * 3600


def test_a_busy_provider_is_retried_then_reported(tollgate_all, caplog):
    app = create_app(tollgate_all.base, api_key=tollgate_all.key, operation="busy.op", deadline=2.5)
    with TestClient(app) as client:
        bob = login(client, "bob")
        first = client.post("/summaries", json={"text": "a"}, headers=bob)
        assert first.status_code == 200, first.text
        with caplog.at_level(logging.WARNING, logger="fastapi-app"):
            r = client.post("/summaries", json={"text": "b"}, headers=bob)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["error"] == "provider_busy"
        assert body["retries"] >= 1, body
        assert int(r.headers["retry-after"]) >= 1
        assert any("provider busy, retrying" in m for m in caplog.messages), caplog.messages


def test_a_service_key_gives_each_logged_in_user_their_own_budget(tollgate_all):
    # The app's own credential: a service key, acting for whoever is logged in.
    import httpx

    r = httpx.post(
        f"{tollgate_all.base}/admin/users",
        headers={"Authorization": f"Bearer {tollgate_all.admin_token}"},
        json={"user": "summaries-app", "kind": "service"},
    )
    assert r.status_code in (200, 201), r.text
    service_key = r.json()["api_key"]
    assert service_key.startswith("tg_svc_")
    app = create_app(tollgate_all.base, service_key=service_key)
    with TestClient(app) as client:
        alice, bob = login(client, "alice"), login(client, "bob")
        for i in range(2):
            r = client.post("/summaries", json={"text": f"a{i}"}, headers=alice)
            assert r.status_code == 200, r.text
        assert client.post("/summaries", json={"text": "a2"}, headers=alice).status_code == 429
        # Alice's spend is hers: Bob's budget is whole.
        budget = client.get("/me/budget", headers=bob).json()
        assert (budget["used"], budget["remaining"]) == (0, 16), budget
        r = client.post("/summaries", json={"text": "b0"}, headers=bob)
        assert r.status_code == 200, r.text
        assert client.get("/me/budget", headers=alice).json()["used"] == 16
    # The audit trail names both: the end user's event, made by the service key.
    usage = httpx.get(
        f"{tollgate_all.base}/v1/usage",
        headers={"Authorization": f"Bearer {service_key}", "Tollgate-User": "bob"},
    ).json()
    assert len(usage["events"]) == 1, usage
    assert usage["events"][0].get("service_key", "").startswith("kid_"), usage
