"""The plugin's options, usage errors, skip reasons and backend hook, through pytester (no servers)."""

import pytest

USES_BACKEND = """
def test_backend(kv_backend):
    assert kv_backend.name
"""


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_DEVICE", "cpu")


@pytest.mark.parametrize("args,message", [
    (["--kv-backend=nvme"], "--kv-backend: unknown backend 'nvme'; valid: all, gpu-only, native-cpu"),
    (["--kv-fractions=0"], "--kv-fractions: 0.0 outside (0, 1]"),
    (["--kv-fractions=1.5"], "--kv-fractions: 1.5 outside (0, 1]"),
    (["--kv-lengths=64"], "--kv-lengths: 64 not above one KV block (128 tokens)"),
    (["--kv-model=/no/such/model"], "--kv-model '/no/such/model': no such folder"),
    (["--kv-rounds=0"], "--kv-rounds '0': expected a whole number of at least 1"),
    (["--kv-server-url=localhost"], "--kv-server-url 'localhost'"),
    (["--kv-gpu-memory-utilization=1.5"], "--kv-gpu-memory-utilization '1.5': expected a number above 0 and at most 1"),
    (["--kv-cpu-gib=lots"], "--kv-cpu-gib 'lots': expected a number above 0"),
    (["--kv-disk-gb=-1"], "--kv-disk-gb '-1': expected a number above 0"),
    (["--kv-tensor-parallel=0"], "--kv-tensor-parallel '0': expected a whole number of at least 1"),
    (["--kv-dtype=fp8"], "--kv-dtype 'fp8': expected auto or one of bfloat16, float16, float32"),
    (["--kv-admission=maybe"], "--kv-admission 'maybe': expected one of queue, static, online, always, never"),
    (["--kv-max-prefill=soon"], "--kv-max-prefill 'soon': expected a number above 0"),
    (["--kv-disk-opt", "io_threads=abc"], "--kv-disk-opt: io_threads 'abc' must be a whole number of threads"),
    (["--kv-disk-opt", "read_gbps=fast"], "--kv-disk-opt: read_gbps 'fast' must be a number of GB/s"),
    (["--kv-backend=kvoffload-disk[io_thread=4]"], "--kv-backend 'kvoffload-disk[io_thread=4]': kvoffload-disk has "
                                                   "no option 'io_thread'; valid: admission,"),
    (["--kv-backend=kvoffload-disk[io_threads]"], "expected NAME[KEY=VALUE,...], e.g. kvoffload-disk[io_threads=4]"),
    (["--kv-backend=gpu-only[x=1]"], "gpu-only has no option 'x'; valid: none (it has no connector)"),
    (["--kv-backend=kvoffload-disk[io_threads=abc]"], "io_threads 'abc' must be a whole number of threads"),
    (["--kv-backend-python=gpu-only=/nope/python"], "--kv-backend-python 'gpu-only=/nope/python': /nope/python is "
                                                    "not an executable file"),
    (["--kv-backend-python=gpu-only"], "--kv-backend-python 'gpu-only': expected NAME=/path/to/venv/bin/python"),
    (["--kv-backend-python=nvme=/usr/bin/python3"], "--kv-backend-python 'nvme=/usr/bin/python3': unknown backend"),
])
def test_bad_option_is_a_usage_error_before_any_server(pytester, args, message):
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message.replace('[', '[[]')}*"])  # a bracket opens a class in fnmatch
    assert not (pytester.path / "results").exists()


def test_ini_values_are_read(pytester):
    pytester.makeini("[pytest]\nkv_backend = nvme\n")
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess()
    result.stderr.fnmatch_lines(["*--kv-backend: unknown backend 'nvme'*"])


def test_command_line_overrides_ini(pytester):
    pytester.makeini("[pytest]\nkv_lengths = 64\n")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--kv-lengths=512")
    result.assert_outcomes(passed=1)


def test_cuda_backends_skip_with_one_line_reason_on_a_cpu(pytester):
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess("--kv-backend=lmcache-inproc-disk", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*lmcache-inproc-disk needs an NVIDIA GPU: LMCache 0.5.6's in-process "
                                 "connector has no CPU path*"])
    # Skipped backends are never silently dropped from the report.
    result.stdout.fnmatch_lines(["*lmcache-inproc-disk: skipped (lmcache-inproc-disk needs an NVIDIA GPU*"])


def test_grid_parametrizes_cells_and_drops_tier_cells_without_a_tier(pytester):
    pytester.makepyfile("def test_cell(kv_backend, kv_cell):\n    pass\n")
    result = pytester.runpytest_subprocess("--kv-backend=gpu-only,native-cpu", "--kv-lengths=256,512",
                                           "--kv-fractions=1.0", "--collect-only", "-q")
    out = result.stdout.str()
    assert "test_cell[gpu-only-256-cold]" in out and "test_cell[gpu-only-512-f1-engine-hit]" in out
    assert "test_cell[gpu-only-256-f1-tier-hit]" not in out
    assert "test_cell[native-cpu-512-f1-tier-hit]" in out
    assert "2 deselected" in out


def test_conftest_can_register_its_own_backend(pytester):
    pytester.makeconftest("""
from pytest_kvoffload.serve.backend import Backend, ServerSpec

def pytest_kvoffload_register_backends(registry):
    registry.register(Backend(name="my-connector", description="ours", tier="disk", needs_cuda=True,
                              cuda_reason="it is CUDA-only",
                              configure=lambda ctx: ServerSpec(args=["--foo"])))
""")
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess("--kv-backend=my-connector", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*my-connector needs an NVIDIA GPU: it is CUDA-only*"])


def test_report_header_names_the_grid(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--kv-lengths=256,2048", "--kv-model=llama-3.2-3b", "--kv-dtype=bfloat16")
    result.stdout.fnmatch_lines(["kvoffload: backends *; model llama-3.2-3b (114,688 KV bytes/token); lengths 256,2048*",
                                 "kvoffload: dtype bfloat16: chosen with --kv-dtype; CPU *"])


@pytest.mark.parametrize("flags,dtype,kv_bytes,why", [
    ("avx avx2 fma", "float32", "8,192", "the CPU lacks avx512_bf16 and amx_bf16*"),
    ("avx avx2 avx512f avx512_bf16", "bfloat16", "4,096", "the CPU computes bf16 natively (avx512_bf16);*"),
])
def test_dtype_follows_the_cpus_flags_and_says_why(pytester, monkeypatch, flags, dtype, kv_bytes, why):
    monkeypatch.setenv("KVOFFLOAD_CPU_FLAGS", flags)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines([f"*model tiny-llama ({kv_bytes} KV bytes/token)*", f"kvoffload: dtype {dtype}: {why}"])


def test_bad_trace_is_a_usage_error_naming_the_line(pytester):
    trace = pytester.path / "t.jsonl"
    trace.write_text('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                     '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess(f"--kv-trace={trace}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-trace: trace *t.jsonl, line 2: timestamp goes backwards*"])


@pytest.mark.parametrize("args,message", [
    (["--kv-trace-mode=burst"], "--kv-trace-mode 'burst': expected open or closed"),
    (["--kv-trace-window=9:1"], "--kv-trace-window '9:1': END must be after START"),
    (["--kv-trace-format=azure"], "--kv-trace-format 'azure': expected one of mooncake, bailian"),
])
def test_bad_trace_options(pytester, args, message):
    trace = pytester.path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess(f"--kv-trace={trace}", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_environment_and_run_finished_hooks(pytester):
    """A conftest adds to the recorded environment and is handed the finished run (a skipped backend is
    enough for a record: no server starts)."""
    pytester.makeconftest("""
import json

def pytest_kvoffload_environment(environment):
    environment["lab"] = "rack-7"

def pytest_kvoffload_run_finished(run, run_dir):
    (run_dir / "seen.json").write_text(json.dumps({"status": run["status"], "lab": run["environment"]["lab"],
                                                   "summary": (run_dir / "summary.txt").is_file()}))
""")
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess("--kv-backend=lmcache-inproc-disk")
    result.assert_outcomes(skipped=1)
    (run_dir,) = (pytester.path / "results").iterdir()
    import json
    assert json.loads((run_dir / "seen.json").read_text()) == {"status": "complete", "lab": "rack-7", "summary": True}
    assert json.loads((run_dir / "run.json").read_text())["environment"]["lab"] == "rack-7"


def test_model_given_by_absolute_path_makes_one_folder_directly_under_results(pytester, tmp_path):
    """The run id takes the model folder's name, reduced to safe characters: no nested folders."""
    import json
    import shutil

    from pytest_kvoffload.core.models import load_model
    model_dir = tmp_path / "some dir" / "hm"
    shutil.copytree(load_model("tiny-llama").path, model_dir)
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess(f"--kv-model={model_dir}", "--kv-weights=dummy", "--kv-backend=lmcache-inproc-disk")
    result.assert_outcomes(skipped=1)
    (run_dir,) = (pytester.path / "results").iterdir()
    assert "-hm-" in run_dir.name and (run_dir / "run.json").is_file()
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == run_dir.name


def test_another_python_with_an_unsupported_vllm_stops_the_run_in_one_line(pytester, tmp_path):
    fake = tmp_path / "python"  # answers the version probe as a vLLM 0.30.0 environment would
    fake.write_text('#!/bin/sh\necho \'{"vllm": "0.30.0", "lmcache": null, "torch": "2.13.0+cpu"}\'\n')
    fake.chmod(0o755)
    pytester.makepyfile(USES_BACKEND)
    result = pytester.runpytest_subprocess(f"--kv-backend-python=gpu-only={fake}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if "0.30.0" in line]
    assert len(lines) == 1 and "outside the supported range 0.31 to 0.33" in lines[0], result.stderr.str()
    assert "Traceback" not in result.stderr.str() + result.stdout.str()
    assert not (pytester.path / "results").exists()
