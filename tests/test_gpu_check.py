"""scripts/gpu_check.py, the prepared script for a lent GPU, on this machine's CPU path: it must not rot."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_round_trips_are_byte_exact_without_vllm_in_both_of_vllms_layouts(tmp_path):
    out = tmp_path / "gpu_check.json"
    # As on the lent machine: vLLM cannot be imported, so the script stubs its two base classes.
    code = ("import runpy, sys; sys.modules['vllm'] = None; "
            f"sys.argv = ['gpu_check.py', '--out', {str(out)!r}, '--quick', '--device', 'cpu', '--store', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["vllm_stubbed"] and figures["device"] == "cpu" and not figures["skipped"]
    assert [t["layout"] for t in figures["round_trips"]] == ["layer-outermost", "block-outermost"]
    for trip in figures["round_trips"]:
        assert trip["byte_exact"] and trip["byte_exact_partial_chunk"] and trip["load_gbps"] > 0
        # Views into one allocation at a constant distance: the CPU path moves all layers in one copy.
        assert trip["one_copy_for_all_layers"]
    assert figures["drive"]["read_gbps"] > 0 and figures["copy"][str(figures["chunk_bytes"])] == {}
    assert "byte-exact yes" in result.stdout


def test_help_states_the_bytes_and_the_time_and_the_full_run_fits_the_lent_machine():
    help_text = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True).stdout
    for words in ("writes", "GB, reads", "on disk at once", "within 240 s", "--store", "full run in"):
        assert words in " ".join(help_text.split()), words
    full = load_script().FULL
    assert full.budget_s <= 240  # 4 minutes: a rerun fits in 15 minutes of device time
    assert full.most_on_disk() + full.cache_bytes() < 16 * 2**30 and full.bytes_written() < 20e9  # of 64 GiB
    assert {layout for layout, _, _ in full.runs} == {"layer-outermost", "block-outermost"}


def test_the_views_are_vllms_strides_into_one_allocation():
    import torch
    gpu_check = load_script()
    g = gpu_check.TINY
    page = g.kv_heads * g.block_size * 2 * g.head_size  # elements of one layer's block
    for layout, layer_step, block_step in (("layer-outermost", page * 10, page), ("block-outermost", page, page * g.layers)):
        views = list(gpu_check.kv_cache_views(g, 10, "cpu", layout).values())
        storage = {v.untyped_storage().data_ptr() for v in views}
        assert len(storage) == 1
        assert [v.storage_offset() for v in views] == [i * layer_step for i in range(g.layers)]
        assert views[0].stride()[0] == block_step and views[0].dtype == torch.bfloat16


def test_a_planted_wrong_byte_after_a_load_fails_the_check(tmp_path, monkeypatch):
    gpu_check = load_script()
    gpu_check.stub_vllm_if_missing()
    real = gpu_check.load_chunks

    def load_then_flip(worker, layers, loads):
        seconds = real(worker, layers, loads)
        key, blocks = loads[-1]
        layers[-1][blocks[-1][1]].view(torch.int16).view(-1)[-1] ^= 1  # one bit of the last layer's last block
        return seconds

    import torch
    monkeypatch.setattr(gpu_check, "load_chunks", load_then_flip)
    for layout in gpu_check.LAYOUTS:
        trip = gpu_check.round_trip(tmp_path / layout, gpu_check.TINY, "cpu", 2, 1, layout)
        assert not trip["byte_exact"] and not trip["byte_exact_partial_chunk"], layout
