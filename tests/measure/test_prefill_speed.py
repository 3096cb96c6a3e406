"""Machine-derived choices: the dtype by CPU flags, lengths by measured prefill, the admission suite's drive."""

import pytest

from pytest_kvoffload.core import machine
from pytest_kvoffload.measure.grid_lengths import lengths_within
from pytest_kvoffload.measure.prefill_speed import PrefillSpeed, probe_lengths

AVX2_ONLY = "fpu sse4_2 avx avx2 fma"
AVX512_BF16 = AVX2_ONLY + " avx512f avx512_bf16 avx512_vnni"


@pytest.fixture
def cpu(monkeypatch):
    def pretend(flags: str):
        monkeypatch.setenv("KVOFFLOAD_CPU_FLAGS", flags)
        monkeypatch.setenv("KVOFFLOAD_DEVICE", "cpu")
        machine.cpu_flags.cache_clear()
        machine.device_kind.cache_clear()
    yield pretend
    machine.cpu_flags.cache_clear()
    machine.device_kind.cache_clear()


def test_float32_on_a_cpu_without_native_bf16(cpu):
    cpu(AVX2_ONLY)
    dtype, reason = machine.native_dtype("bfloat16")
    assert dtype == "float32" and "lacks avx512_bf16 and amx_bf16" in reason
    assert machine.describe()["cpu_flags"] == ["avx2"]


@pytest.mark.parametrize("flags", [AVX512_BF16, AVX2_ONLY + " amx_bf16 amx_tile"])
def test_bf16_where_the_cpu_computes_it(cpu, flags):
    cpu(flags)
    assert machine.native_dtype("bfloat16")[0] == "bfloat16"


def test_a_gpu_keeps_the_models_dtype(monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_DEVICE", "cuda")
    machine.device_kind.cache_clear()
    try:
        assert machine.native_dtype("bfloat16")[0] == "bfloat16"
    finally:
        machine.device_kind.cache_clear()


def test_probe_lengths_double_up_to_the_grids_longest():
    assert probe_lengths(4096, 16384) == [256, 512, 1024, 2048, 4096]
    assert probe_lengths(1536, 16384) == [256, 512, 1024, 1536]
    assert probe_lengths(4096, 3000) == [256, 512, 1024, 2048]


def test_lengths_beyond_the_prefill_budget_are_left_out():
    # As measured on an AVX2-only EPYC in float32 with one core: 1.2 s at 1,024, 2.7 s at 2,048 tokens.
    slow = PrefillSpeed([(256, 0.3), (512, 0.55), (1024, 1.2), (2048, 2.7), (4096, 7.4)])
    assert lengths_within((512, 1024, 2048, 4096), slow, 3.0) == (512, 1024, 2048)
    fast = PrefillSpeed([(256, 0.03), (512, 0.06), (1024, 0.15), (2048, 0.39), (4096, 0.8)])
    assert lengths_within((512, 1024, 2048, 4096), fast, 3.0) == (512, 1024, 2048, 4096)
    # The probe stops at the first length over budget; longer ones are extrapolated, never shorter.
    stopped = PrefillSpeed([(256, 1.0), (512, 2.5), (1024, 6.0)])
    assert stopped.predict(4096) > 6.0 * 4
    assert lengths_within((512, 1024, 2048, 4096), stopped, 3.0) == (512, 1024, 2048)  # three kept for the fit
    assert lengths_within((512, 4096), slow, None) == (512, 4096)




def test_a_server_started_after_the_grid_is_fixed_times_only_the_longest(monkeypatch):
    from pytest_kvoffload.measure import prefill_speed
    from pytest_kvoffload.serve.client import RequestResult

    sent, logprobs = [], []

    def complete(ep, tokens, max_tokens=1, logprobs=None):
        sent.append(len(tokens))
        asked.append(logprobs)
        return RequestResult(len(tokens), len(tokens) / 1e4, 0)

    asked = logprobs
    monkeypatch.setattr(prefill_speed, "stream_completion", complete)
    full = prefill_speed.measure_prefill(None, 4096, 16384, None, "s", 32000)
    assert sent == [256, 256] + [n for n in (256, 512, 1024, 2048, 4096) for _ in range(2)]
    # One warm-up takes the output checks' path (logprobs), whose first use is slow; timed requests do not.
    assert asked[:2] == [None, prefill_speed.TIE_CANDIDATES] and not any(asked[2:])
    assert [n for n, _ in full.points] == [256, 512, 1024, 2048, 4096]
    sent.clear()
    later = prefill_speed.measure_prefill(None, 4096, 16384, None, "s", 32000, curve=False)
    assert sent == [256, 256, 4096, 4096] and later.points == [(4096, 0.4096)]
