"""Budgets in money through the official ``openai`` and ``anthropic`` SDKs,
unchanged: a deployment in USD whose operations a price sheet prices per
model. Each call, whole or streamed (with and without ``include_usage``),
and Anthropic's cache reads and writes, is charged exactly price × the usage
the upstream reported, in micro-dollars, embedded and on Redis; a model the
sheet does not price is the SDK's 422, charging nothing."""

from __future__ import annotations

import shutil
import time
import tempfile
from pathlib import Path

import anthropic
import openai
import pytest

from test_sdks import System

# Micro-dollars per token (the sheet's prices are per million tokens): whole
# numbers, so that each expected charge is an exact integer sum.
INPUT, CACHED, CACHE_WRITE, OUTPUT, REASONING = 100, 50, 125, 300, 400

SHEET = f"""
currency = "USD"
[models."m*"]
input = "{INPUT}"
cached_input = "{CACHED}"
output = "{OUTPUT}"
reasoning = "{REASONING}"
max_output = 4096
[models."c*"]
input = "{INPUT}"
cached_input = "{CACHED}"
cache_write = "{CACHE_WRITE}"
output = "{OUTPUT}"
max_output = 4096
"""

CONFIG = """
currency = "USD"
default_plan = "free"
[plans.free]
limit = "5"
window = "12h"
[plans.tiny]
limit = "1"
window = "12h"
[providers.openai]
rate = 100
burst = 20
max_wait = "10s"
url = "{mock}/v1"
retries = 0
prices = "{sheet}"
[providers.anthropic]
rate = 100
burst = 20
max_wait = "10s"
url = "{mock}"
retries = 0
prices = "{sheet}"
[operations."openai.chat"]
provider = "openai"
path = "/chat/completions"
[operations."anthropic.messages"]
provider = "anthropic"
path = "/v1/messages"
"""


class MoneySystem(System):
    """The SDK suite's system, in USD, its operations priced by ``SHEET``."""

    def __init__(self, backend: str) -> None:
        self.sheet_dir = Path(tempfile.mkdtemp(prefix="tollgate-sheet-"))
        sheet = self.sheet_dir / "prices.toml"
        sheet.write_text(SHEET)
        super().__init__(backend, config=CONFIG.replace("{sheet}", str(sheet)))

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.sheet_dir, ignore_errors=True)


@pytest.fixture(scope="module", params=["embedded", "redis"])
def money(request):
    sys = MoneySystem(request.param)
    yield sys
    sys.close()


def openai_cost(u) -> int:
    """OpenAI's usage priced: cached tokens are part of prompt_tokens,
    reasoning tokens part of completion_tokens; each priced once."""
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0
    cached, reasoning = cached or 0, reasoning or 0
    return (
        (u.prompt_tokens - cached) * INPUT
        + cached * CACHED
        + (u.completion_tokens - reasoning) * OUTPUT
        + reasoning * REASONING
    )


def anthropic_cost(u) -> int:
    """Anthropic's usage priced: cache reads and writes are beside input_tokens."""
    return (
        u.input_tokens * INPUT
        + (u.cache_read_input_tokens or 0) * CACHED
        + (u.cache_creation_input_tokens or 0) * CACHE_WRITE
        + u.output_tokens * OUTPUT
    )


WORDS = "one two three four five six seven eight nine ten"


@pytest.mark.parametrize("model", ["m", "m-cache", "m-reason", "m-cache-reason"])
def test_openai_whole_pays_exactly_its_usage(money, model):
    key = money.user()
    msgs = [{"role": "user", "content": WORDS}]
    answer = money.openai(key).chat.completions.create(model=model, messages=msgs)
    direct = money.direct_openai().chat.completions.create(model=model, messages=msgs)
    assert answer.usage == direct.usage
    want = openai_cost(answer.usage)
    assert want > 0
    assert money.used(key, want) == want
    # Its spend event says what it was charged, beside the worst case reserved.
    usage = money.usage(key)
    assert usage["currency"] == "USD"
    (event,) = usage["events"]
    assert event["cost"] == want < event["estimate"], event


def test_openai_streams_pay_exactly_their_usage_with_or_without_include_usage(money):
    key = money.user()
    ask = dict(model="m-cache-reason", messages=[{"role": "user", "content": WORDS}], stream=True)
    with_usage = dict(ask, stream_options={"include_usage": True})
    chunks = list(money.openai(key).chat.completions.create(**with_usage))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    one = openai_cost(usage)
    assert money.used(key, one) == one
    # Without include_usage the client sees no usage and pays the same:
    # tollgate asked the upstream for it.
    plain = list(money.openai(key).chat.completions.create(**ask))
    assert all(c.usage is None for c in plain)
    assert money.used(key, 2 * one) == 2 * one


def test_anthropic_whole_and_streamed_with_cache_reads_and_writes(money):
    key = money.user()
    ask = dict(model="c-cache", max_tokens=64, messages=[{"role": "user", "content": WORDS}])
    whole = money.anthropic(key).messages.create(**ask)
    assert whole.usage.cache_read_input_tokens > 0 and whole.usage.cache_creation_input_tokens > 0
    one = anthropic_cost(whole.usage)
    assert money.used(key, one) == one
    with money.anthropic(key).messages.stream(**ask) as stream:
        "".join(stream.text_stream)
        final = stream.get_final_message()
    assert anthropic_cost(final.usage) == one
    assert money.used(key, 2 * one) == 2 * one


def test_an_unpriced_model_is_the_sdks_422_and_charges_nothing(money):
    key = money.user()
    with pytest.raises(openai.UnprocessableEntityError) as e:
        money.openai(key, max_retries=0).chat.completions.create(
            model="x-gpt-unknown", messages=[{"role": "user", "content": "hi"}]
        )
    assert "x-gpt-unknown" in str(e.value)
    with pytest.raises(anthropic.UnprocessableEntityError):
        money.anthropic(key, max_retries=0).messages.create(
            model="x-unknown", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert money.usage(key)["used"] == 0


def test_a_call_whose_worst_case_passes_the_limit_is_refused_before_the_upstream(money):
    """A 1 USD budget: a call with no max_tokens reserves its model's whole
    output (4,096 tokens at 300 µUSD: about 1.23 USD), more than the limit,
    so it is refused up front; one bounded by max_tokens fits."""
    key = money.user("tiny")
    before = money.mock_stats()["requests"]
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.UnprocessableEntityError):
        money.openai(key, max_retries=0).chat.completions.create(model="m", messages=msgs)
    assert money.mock_stats()["requests"] == before, "refused before the upstream"
    answer = money.openai(key).chat.completions.create(model="m", messages=msgs, max_tokens=100)
    want = openai_cost(answer.usage)
    assert money.used(key, want) == want


def spend_metric(money, labels: str) -> int:
    """The value of ``tollgate_spend_total{labels}`` on /metrics (0 when absent)."""
    text = money.http.get(f"{money.base}/metrics").text
    for line in text.splitlines():
        if line.startswith("tollgate_spend_total{") and labels in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_spend_is_counted_by_provider_operation_and_sheet_entry(money):
    labels = 'provider="openai",operation="openai.chat",model="m*"'
    before = spend_metric(money, labels)
    key = money.user()
    answer = money.openai(key).chat.completions.create(
        model="m-cache-reason", messages=[{"role": "user", "content": WORDS}]
    )
    want = openai_cost(answer.usage)
    assert money.used(key, want) == want
    deadline = time.monotonic() + 5
    while spend_metric(money, labels) - before != want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert spend_metric(money, labels) - before == want
