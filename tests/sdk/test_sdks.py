"""The official ``openai`` and ``anthropic`` Python SDKs, unchanged, pointed at
tollgate's pass-through routes by ``base_url`` with a tollgate key, against
the real binary (``tollgate all`` embedded, and on a private redis-server) and
``tollgate mock-provider`` as the upstream.

Each answer is compared with the one the same SDK gets straight from the mock;
``used`` (``GET /v1/usage``) is checked against the usage the answer reported,
settled by the operation's rule; a user out of budget gets the SDK's own
``RateLimitError`` with the exact wait; a saturated provider makes the SDK wait
and retry, never fail with a 500."""

from __future__ import annotations

import os
from decimal import Decimal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tollgate.testing import MockProvider, Redis, Tollgate

WINDOW_MS = 12 * 3600 * 1000
SETTLE_MAX = 200

CONFIG = """
default_plan = "free"
[plans.free]
limit = 1000
window = "12h"
[plans.tiny]
limit = {max}
window = "12h"
[plans.blink]
limit = {max}
window = "2s"
[providers.openai]
rate = 100
burst = 20
max_wait = "10s"
url = "{mock}/v1"
retries = 0
[providers.anthropic]
rate = 100
burst = 20
max_wait = "10s"
url = "{mock}"
retries = 0
# One call a second, and a call waits 300 ms at most: saturated at once.
[providers.busy]
rate = 1
burst = 1
max_wait = "300ms"
url = "{mock}/v1"
retries = 0
[operations."openai.chat"]
cost = 2
provider = "openai"
path = "/chat/completions"
settle = {{ from = "/usage/total_tokens", per = 1, max = {max} }}
[operations."openai.embeddings"]
cost = 1
provider = "openai"
path = "/embeddings"
settle = {{ from = "/usage/total_tokens", per = 1, max = 50 }}
[operations."anthropic.messages"]
cost = 2
provider = "anthropic"
path = "/v1/messages"
settle = {{ from = "/usage/output_tokens", per = 1, max = {max} }}
[operations."busy.chat"]
cost = 2
provider = "busy"
path = "/chat/completions"
settle = {{ from = "/usage/total_tokens", per = 1, max = 50 }}
"""


class System:
    """The mock, tollgate in front of it, and an admin to make users."""

    def __init__(self, backend: str, mock_flags: tuple = (), flags: tuple = (), config: str = CONFIG) -> None:
        self.mock = MockProvider("--rate", "1000", "--burst", "100", "--token-interval-ms", "2", *mock_flags)
        self.redis = Redis() if backend == "redis" else None
        self.tollgate = Tollgate(
            config.format(mock=self.mock.url, max=SETTLE_MAX),
            self.redis.url if self.redis else None,
            flags=flags,
        )
        self.base = self.tollgate.base
        self.http = httpx.Client(timeout=30)
        self.users = 0

    def user(self, plan: str = "free") -> str:
        """A new user's API key."""
        self.users += 1
        r = self.http.post(
            f"{self.base}/admin/users",
            headers={"Authorization": f"Bearer {self.tollgate.admin_token}"},
            json={"user": f"sdk{self.users}-{os.urandom(3).hex()}", "plan": plan},
        )
        assert r.status_code == 201, r.text
        return r.json()["api_key"]

    def usage(self, key: str) -> dict:
        """``/v1/usage`` with its amounts as integers of the minor unit: with a
        currency the api writes them as exact decimal strings (``"0.000039"``
        USD), read here as micro-units (39), so the suites compare exactly."""
        r = self.http.get(f"{self.base}/v1/usage", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        body = r.json()
        if body.get("currency", "tokens") == "tokens":
            return body

        def micro(v):
            assert isinstance(v, str), f"a money amount is a decimal string: {v!r}"
            m = Decimal(v) * 1_000_000
            assert m == m.to_integral_value(), v
            return int(m)

        def read(item: dict, fields) -> dict:
            return {k: (micro(v) if k in fields and v is not None else v) for k, v in item.items()}

        body = read(body, ("used", "limit", "remaining"))
        body["windows"] = [read(w, ("used", "limit", "remaining")) for w in body["windows"]]
        body["events"] = [read(e, ("cost", "estimate")) for e in body["events"]]
        return body

    def used(self, key: str, want: int) -> int:
        """``used`` once it equals ``want`` (a settle lands just after the
        answer), or what it is after 10 s."""
        deadline = time.monotonic() + 10
        while True:
            used = self.usage(key)["used"]
            if used == want or time.monotonic() > deadline:
                return used
            time.sleep(0.02)

    def settled_used(self, key: str) -> int:
        """``used`` once the user's last job has ended (its charge settled,
        kept or released), within 10 s."""
        events = self.usage(key)["events"]
        assert events, "no charge"
        job = max(events, key=lambda e: e["at_ms"])["request_id"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = self.http.get(f"{self.base}/v1/jobs/{job}", headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 200 and r.json()["status"] in ("succeeded", "failed"):
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"job {job} did not end")
        time.sleep(0.1)  # A settle after the record: none, but a margin costs little.
        return self.usage(key)["used"]

    def mock_stats(self) -> dict:
        return self.http.get(f"{self.mock.url}/stats").json()

    def openai(self, key: str, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1/passthrough/openai", api_key=key, **kw)

    def anthropic(self, key: str, **kw) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=f"{self.base}/v1/passthrough/anthropic", api_key=key, **kw)

    def direct_openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.mock.url}/v1", api_key="upstream-secret")

    def direct_anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.mock.url, api_key="upstream-secret")

    def close(self) -> None:
        self.http.close()
        self.tollgate.stop()
        self.mock.stop()
        if self.redis:
            self.redis.close()


@pytest.fixture(scope="module", params=["embedded", "redis"])
def system(request):
    sys = System(request.param)
    yield sys
    sys.close()


MESSAGES = [{"role": "user", "content": "hello there"}]


def test_chat_completions_whole(system):
    key = system.user()
    answer = system.openai(key).chat.completions.create(model="m", messages=MESSAGES)
    direct = system.direct_openai().chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content == direct.choices[0].message.content
    assert answer.choices[0].message.content == "mock answer to: hello there"
    assert answer.usage == direct.usage
    # The upstream's request id, as the SDK exposes it.
    assert answer._request_id.startswith("req_mock_")
    assert system.used(key, answer.usage.total_tokens) == answer.usage.total_tokens == 7


def test_chat_completions_streamed(system):
    key = system.user()
    ask = dict(model="m", messages=[{"role": "user", "content": "one two three"}], stream=True)
    with_usage = dict(ask, stream_options={"include_usage": True})

    chunks = list(system.openai(key).chat.completions.create(**with_usage))
    direct = list(system.direct_openai().chat.completions.create(**with_usage))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(c.choices[0].delta.content or "" for c in direct if c.choices)
    assert text == "mock answer to: one two three"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage == direct[-1].usage
    assert system.used(key, usage.total_tokens) == usage.total_tokens == 9

    # Without include_usage the client sees no usage, and pays the same:
    # tollgate asked the upstream for it.
    chunks = list(system.openai(key).chat.completions.create(**ask))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert all(c.usage is None for c in chunks)
    assert system.used(key, 9 + 9) == 9 + 9


def sse_events(response: httpx.Response) -> list:
    """The events of a streamed answer, the mock's per-call id and time
    taken out (they differ between two calls)."""
    import re

    text = "".join(response.iter_text())
    text = re.sub(r"chatcmpl-mock-\d+", "chatcmpl-mock-N", text)
    text = re.sub(r'"created":\d+', '"created":0', text)
    return [e for e in text.split("\n\n") if e.strip()]


def test_a_plain_stream_is_relayed_byte_for_byte_and_pays_its_usage(system):
    key = system.user()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "six seven eight"}]}
    with system.http.stream(
        "POST", f"{system.base}/v1/passthrough/openai/chat/completions",
        headers={"Authorization": f"Bearer {key}"}, json=body,
    ) as r:
        assert r.status_code == 200
        relayed = sse_events(r)
    with system.http.stream("POST", f"{system.mock.url}/v1/chat/completions", json=body) as r:
        direct = sse_events(r)
    assert relayed == direct
    assert all('"usage"' not in e for e in relayed)
    # What the same call pays when the client asks for usage itself.
    asked = dict(body, stream_options={"include_usage": True})
    chunks = list(system.openai(key).chat.completions.create(**asked))
    total = chunks[-1].usage.total_tokens
    assert system.used(key, 2 * total) == 2 * total


def test_a_stream_closed_before_its_end_pays_at_least_the_whole(system):
    words = " ".join(f"w{i}" for i in range(60))
    ask = dict(model="m", messages=[{"role": "user", "content": words}], stream=True)
    whole = system.direct_openai().chat.completions.create(model="m", messages=ask["messages"])
    events = len(list(system.direct_openai().chat.completions.create(**ask)))
    for keep in (events * 99 // 100, events - 1):
        key = system.user()
        stream = system.openai(key).chat.completions.create(**ask)
        for i, _ in enumerate(stream):
            if i + 1 >= keep:
                break
        stream.close()
        used = system.settled_used(key)
        assert used >= whole.usage.total_tokens, (keep, events, used)

    # Anthropic, closed after its last content delta (before message_delta).
    key = system.user()
    ask = dict(model="c", max_tokens=150, messages=[{"role": "user", "content": words}])
    direct = system.direct_anthropic().messages.create(**ask)
    with system.anthropic(key).messages.create(stream=True, **ask) as stream:
        seen = []
        for event in stream:
            seen.append(event.type)
            if event.type == "content_block_stop":
                break
    used = system.settled_used(key)
    assert used >= direct.usage.output_tokens, (seen[-3:], used)


def test_embeddings(system):
    key = system.user()
    # The SDK's default (it asks for base64 and decodes it), then floats.
    for fmt in ({}, {"encoding_format": "float"}):
        got = system.openai(key).embeddings.create(model="e", input=["a b", "c"], **fmt)
        direct = system.direct_openai().embeddings.create(model="e", input=["a b", "c"], **fmt)
        assert [d.embedding for d in got.data] == [d.embedding for d in direct.data]
        assert len(got.data) == 2 and len(got.data[0].embedding) == 8
        assert got.usage.total_tokens == direct.usage.total_tokens == 3
    assert system.used(key, 6) == 6


def test_anthropic_messages_streamed_and_whole(system):
    key = system.user()
    ask = dict(model="c", max_tokens=64, messages=[{"role": "user", "content": "four five"}])
    with system.anthropic(key).messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    with system.direct_anthropic().messages.stream(**ask) as stream:
        direct = stream.get_final_message()
    assert text == final.content[0].text == direct.content[0].text == "mock answer to: four five"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == direct.usage.output_tokens == 5
    # Settled to output_tokens, the operation's rule.
    assert system.used(key, 5) == 5

    # The raw events, and a whole answer, through the same route.
    events = list(system.anthropic(key).messages.create(stream=True, **ask))
    assert [e.type for e in events][0] == "message_start"
    assert [e.type for e in events][-1] == "message_stop"
    whole = system.anthropic(key).messages.create(**ask)
    assert whole.content[0].text == text and whole.usage.output_tokens == 5
    assert whole._request_id.startswith("req_mock_")
    assert system.used(key, 15) == 15


def retry_after_is_exact(system, key: str, e, before_ms: int, after_ms: int) -> None:
    """The 429's wait is the moment the first event leaves the window."""
    assert e.status_code == 429
    first_at = min(ev["at_ms"] for ev in system.usage(key)["events"])
    ms = int(e.response.headers["retry-after-ms"])
    least, most = first_at + WINDOW_MS - after_ms, first_at + WINDOW_MS - before_ms
    assert least - 1 <= ms <= most + 1, (ms, least, most)
    assert int(e.response.headers["retry-after"]) == -(-ms // 1000)
    assert e.response.headers["x-should-retry"] == "false"


def test_out_of_budget_is_the_sdks_rate_limit_error(system):
    key = system.user("tiny")
    # The first call reserves the most (200, all of the plan) and settles to 7;
    # a second reserve of 200 does not fit for 12 h.
    system.openai(key).chat.completions.create(model="m", messages=MESSAGES)
    assert system.used(key, 7) == 7

    client = system.openai(key)  # Default retries: the SDK must not retry a 12 h wait.
    before = int(time.time() * 1000)
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model="m", messages=MESSAGES)
    after = int(time.time() * 1000)
    assert after - before < 2000, "the SDK waited for a refusal it cannot outwait"
    retry_after_is_exact(system, key, raised.value, before, after)
    assert raised.value.code == "quota_exceeded"

    before = int(time.time() * 1000)
    with pytest.raises(anthropic.RateLimitError) as raised:
        with system.anthropic(key).messages.stream(model="c", max_tokens=8, messages=MESSAGES) as s:
            s.until_done()
    after = int(time.time() * 1000)
    retry_after_is_exact(system, key, raised.value, before, after)
    assert raised.value.body["error"]["type"] == "rate_limit_error"
    assert system.usage(key)["used"] == 7


def test_out_of_budget_for_seconds_is_waited_out_by_the_sdk(system):
    key = system.user("blink")
    system.openai(key).chat.completions.create(model="m", messages=MESSAGES)
    # Full for 2 s: the SDK sleeps the exact retry-after-ms and its retry fits.
    started = time.monotonic()
    answer = system.openai(key, max_retries=2).chat.completions.create(model="m", messages=MESSAGES)
    waited = time.monotonic() - started
    assert answer.choices[0].message.content == "mock answer to: hello there"
    assert 1.0 < waited < 6.0, waited


def test_a_saturated_provider_makes_the_sdk_wait_never_a_500(system):
    key = system.user()
    before = system.mock_stats()
    seen: list = []

    def record(response: httpx.Response) -> None:
        seen.append(response.status_code)

    # Four calls at once on a provider that takes one a second, each waiting
    # 300 ms at most: the others get 503 + Retry-After and the SDK retries.
    # The SDK builds on httpx2 (``openai.DefaultHttpxClient``), not httpx.
    http = openai.DefaultHttpxClient(event_hooks={"response": [record]})
    client = openai.OpenAI(
        base_url=f"{system.base}/v1/passthrough/busy", api_key=key, max_retries=8, http_client=http,
    )
    results, errors = [], []

    def call(i: int) -> None:
        try:
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"n{i}"}])
            results.append(r)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [], errors
    assert sorted(r.choices[0].message.content for r in results) == [f"mock answer to: n{i}" for i in range(4)]
    assert 503 in seen, seen
    assert set(seen) <= {200, 503}, seen
    # Only the four answered calls reached the upstream; each refused wait
    # released its charge: used is the four answers' usage.
    after = system.mock_stats()
    assert after["requests"] - before["requests"] == 4
    assert after["rate_limited"] == before["rate_limited"]
    total = sum(r.usage.total_tokens for r in results)
    assert system.used(key, total) == total

    # With no retries left, the SDK's own error for a 503: never a 500.
    no_retry = openai.OpenAI(base_url=f"{system.base}/v1/passthrough/busy", api_key=key, max_retries=0)
    statuses = []
    for _ in range(3):
        try:
            no_retry.chat.completions.create(model="m", messages=MESSAGES)
            statuses.append(200)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)
            assert e.response.headers["retry-after"] == "1"
    assert 503 in statuses and set(statuses) <= {200, 503}, statuses


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_a_whole_call_outliving_the_sync_timeout_runs_once_with_the_sdks_retries(backend):
    """The upstream takes 3 s; tollgate's sync timeout is 1 s. The SDK, with
    its default retries, gets its answer from one upstream call, paid once;
    with a read timeout of 2.5 s it times out once and its retry joins the
    job its first attempt left running."""
    sys = System(backend, mock_flags=("--latency-ms", "3000"), flags=("--sync-timeout-ms", "1000"))
    try:
        for timeout in (None, 2.5):
            key = sys.user()
            before = sys.mock_stats()["requests"]
            kw = {} if timeout is None else {"timeout": timeout}
            started = time.monotonic()
            answer = sys.openai(key, **kw).chat.completions.create(model="m", messages=MESSAGES)
            took = time.monotonic() - started
            assert answer.choices[0].message.content == "mock answer to: hello there"
            assert sys.mock_stats()["requests"] - before == 1, timeout
            assert sys.used(key, answer.usage.total_tokens) == answer.usage.total_tokens
            assert 2.9 < took < 8, (timeout, took)
    finally:
        sys.close()


def test_a_worker_killed_mid_stream_leaves_the_reservation_charged(tmp_path):
    """A split deployment on Redis (api, throttler and worker processes): the
    worker streaming an answer is SIGKILLed; the job is not run again (the
    client had part of the answer), the SDK raises, and the charge is the
    reservation: the upstream worked and its usage was never seen."""
    import signal
    import subprocess

    from tollgate.testing import binary, free_port

    mock = MockProvider("--rate", "1000", "--burst", "100", "--token-interval-ms", "40")
    redis = Redis()
    config = tmp_path / "tollgate.toml"
    config.write_text(CONFIG.format(mock=mock.url, max=SETTLE_MAX))
    admin = "sdk-admin-token-" + os.urandom(8).hex()
    env = {
        **os.environ,
        "TOLLGATE_REDIS_URL": redis.url,
        "TOLLGATE_KEY_PREFIX": "sdk" + os.urandom(4).hex(),
        "TOLLGATE_ADMIN_TOKEN": admin,
        "TOLLGATE_CONFIG": str(config),
        "RUST_LOG": "error",
    }
    port = free_port()

    def role(*args: str) -> subprocess.Popen:
        return subprocess.Popen([binary(), *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    procs = [role("api", "--listen", f"127.0.0.1:{port}"), role("throttler")]
    worker = role("worker", "--lease-ms", "1000")
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(timeout=30)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if http.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the api is not ready"
            time.sleep(0.05)

        words = " ".join(f"w{i}" for i in range(60))
        for kind in ("openai", "anthropic"):
            r = http.post(f"{base}/admin/users", headers={"Authorization": f"Bearer {admin}"},
                          json={"user": f"killed-{kind}"})
            assert r.status_code == 201, r.text
            key = r.json()["api_key"]
            if kind == "openai":
                client = openai.OpenAI(base_url=f"{base}/v1/passthrough/openai", api_key=key, max_retries=0)
                stream = client.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": words}])
            else:
                client = anthropic.Anthropic(base_url=f"{base}/v1/passthrough/anthropic", api_key=key, max_retries=0)
                stream = client.messages.create(
                    model="c", max_tokens=150, stream=True, messages=[{"role": "user", "content": words}])
            events = iter(stream)
            for _ in range(3):
                next(events)
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=10)
            worker = role("worker", "--lease-ms", "1000")
            with pytest.raises((openai.APIError, anthropic.APIError)):
                for _ in events:
                    pass
            # The job ends failed (charged) once the new worker takes it.
            events_of = http.get(f"{base}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["events"]
            job = events_of[0]["request_id"]
            deadline = time.monotonic() + 15
            while http.get(f"{base}/v1/jobs/{job}", headers={"Authorization": f"Bearer {key}"}).json()["status"] != "failed":
                assert time.monotonic() < deadline, "the job did not end"
                time.sleep(0.05)
            used = http.get(f"{base}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["used"]
            assert used == SETTLE_MAX, (kind, used)
    finally:
        http.close()
        for p in [*procs, worker]:
            p.kill()
            p.wait(timeout=10)
        mock.stop()
        redis.close()


def test_tollgate_all_with_no_config_streams_through_the_official_sdks():
    """A new user's first minute: `tollgate all`, no config file, and the
    official SDKs at the base URLs its banner prints: a streamed chat
    completion and an Anthropic message, on the built-in mock."""
    with Tollgate(None) as t:
        client = openai.OpenAI(base_url=f"{t.base}/v1/passthrough/openai", api_key=t.key)
        chunks = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hello there"}], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "mock answer to: hello there"
        claude = anthropic.Anthropic(base_url=f"{t.base}/v1/passthrough/anthropic", api_key=t.key)
        answer = claude.messages.create(model="claude", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
        assert answer.content[0].text == "mock answer to: hi"


def test_the_documented_pass_through_config_runs_as_written(monkeypatch):
    """docs/src/streaming.md's config, as written but for the two upstream
    urls (the mock's) and the secret variables it names (set to anything):
    a plan that holds a call, and both SDKs through it."""
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "src" / "streaming.md"
    config = re.search(r"```toml\n(.*?)```", page.read_text(), re.S).group(1)
    assert 'url = "https://api.openai.com/v1"' in config and 'url = "https://api.anthropic.com"' in config
    monkeypatch.setenv("OPENAI_AUTHORIZATION", "Bearer sk-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    with MockProvider() as mock:
        config = config.replace("https://api.openai.com/v1", f"{mock.url}/v1")
        config = config.replace("https://api.anthropic.com", mock.url)
        with Tollgate(config) as t:
            client = openai.OpenAI(base_url=f"{t.base}/v1/passthrough/openai", api_key=t.key)
            answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content == "mock answer to: hi"
            claude = anthropic.Anthropic(base_url=f"{t.base}/v1/passthrough/anthropic", api_key=t.key)
            message = claude.messages.create(model="c", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
            assert message.content[0].text == "mock answer to: hi"
