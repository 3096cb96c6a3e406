"""Machine-derived choices: the dtype by CPU flags, lengths by measured prefill, the admission suite's drive."""

import pytest

from pytest_kvoffload.core import machine
from pytest_kvoffload.core.costs import RecomputeFit, load_and_recompute
from pytest_kvoffload.admission.slow_drive import SlowDriveError, loadable_prefixes, slow_drive, step_tokens
from pytest_kvoffload.measure.prefill_speed import PrefillSpeed, lengths_within, probe_lengths

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


@pytest.mark.parametrize("recompute,fixed", [
    (RecomputeFit(0.02, 1.8e-4, 0.0), 0.05),     # this VM in bf16: nearly linear, fixed costs visible
    (RecomputeFit(0.01, 1e-4, 2e-8), 0.03),      # quadratic attention
    (RecomputeFit(0.3, 1.2e-3, 8e-8), 0.32),     # an AVX2-only CPU in float32: prefill dwarfs fixed costs
    (RecomputeFit(0.02, 1.8e-4, 0.0), 0.3),      # a tier whose own fixed cost is large: no latency added
])
def test_the_emulated_drive_makes_the_smallest_load_dear_and_the_largest_pay(recompute, fixed):
    prefixes = loadable_prefixes((512, 1024, 2048, 4096), (0.5, 1.0), 128, 256)
    assert prefixes == (256, 384, 512, 896, 1024, 1920, 2048, 3968)
    drive = slow_drive(prefixes, recompute, fixed, 4096)
    per_token = 4096 / (drive.gbps * 1e9)

    def share(p):  # what a load costs, as a share of recomputing it (the rule's definition)
        load, saved = load_and_recompute(p, 0, recompute, fixed + drive.latency_s, per_token)
        return load / saved

    assert share(256) == pytest.approx(2.0, rel=1e-6) or (drive.latency_s == 0 and share(256) > 2.0)
    assert share(3968) == pytest.approx(0.5, rel=1e-6)
    assert 256 < drive.break_even_prefix < 3968
    assert drive.options() == {"read_gbps": drive.gbps, "read_latency_ms": round(drive.latency_s * 1e3, 3)}


def test_no_drive_when_the_grid_cannot_show_both_kinds_of_cell():
    with pytest.raises(SlowDriveError, match="span too little"):
        slow_drive((256, 384), RecomputeFit(0.01, 1e-4, 0.0), 0.02, 4096)
    with pytest.raises(SlowDriveError, match="no drive makes loads pay here"):
        slow_drive((256, 3968), RecomputeFit(0.01, 1e-5, 0.0), 0.5, 4096)
    with pytest.raises(SlowDriveError, match="needs two or more"):
        slow_drive((512,), RecomputeFit(0.01, 1e-4, 0.0), 0.02, 4096)


def test_step_tokens_half_the_longest_prompt_in_whole_blocks():
    assert step_tokens((512, 1536), 128) == 768
    assert step_tokens((256,), 128) == 256
