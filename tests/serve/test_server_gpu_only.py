"""A real vLLM CPU server with the engine's own prefix cache (shared with suites/ in the same session)."""

import pytest

from pytest_kvoffload.serve.client import measure
from pytest_kvoffload.measure.prompts import make_prompt

pytestmark = [pytest.mark.server, pytest.mark.parametrize("kv_backend", ["gpu-only"], indirect=True, scope="session")]


def prompt(kv_session, name, length=1000):
    return make_prompt(length, 1.0, salt=f"{kv_session.salt}|{name}", vocab_size=kv_session.settings.model.vocab_size)


def test_cold_request_reports_no_cached_tokens(kv_session, kv_server):
    result = measure(kv_server, prompt(kv_session, "cold").tokens)
    assert result.prompt_tokens == 1000
    assert result.cached_tokens == 0
    assert sum(result.cached_by_source.values()) == 0
    assert 0 < result.client_ttft_s <= result.total_s
    assert result.server_ttft_s is not None and 0 < result.server_ttft_s <= result.client_ttft_s


def test_immediate_repeat_is_a_device_hit_over_whole_blocks(kv_session, kv_server):
    tokens = prompt(kv_session, "repeat").tokens
    measure(kv_server, tokens)
    again = measure(kv_server, tokens)
    # 1,000 tokens in 128-token blocks: 7 whole blocks, the last token always computed.
    assert again.cached_by_source == {"device": 896}
    assert again.cached_tokens == 896


def test_reset_evicts_the_engine_cache(kv_session, kv_server):
    tokens = prompt(kv_session, "reset").tokens
    measure(kv_server, tokens)
    kv_server.reset_prefix_cache(external=False)
    assert sum(measure(kv_server, tokens).cached_by_source.values()) == 0
