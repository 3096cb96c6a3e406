import pytest

from pytest_kvoffload.harness.options import OptionError

from pytest_kvoffload.harness.option_parsing import check_fits_model, parse_backends, parse_fractions, parse_lengths, parse_disk_opts, parse_model, parse_positive_int, parse_server_args, parse_server_url
KNOWN = ["gpu-only", "native-cpu", "lmcache-disk", "kvoffload-disk"]


def test_backends_all_expands_in_registry_order():
    assert parse_backends("all", KNOWN) == tuple(KNOWN)


def test_backends_comma_list_keeps_order_and_drops_repeats():
    assert parse_backends("kvoffload-disk, gpu-only,kvoffload-disk", KNOWN) == ("kvoffload-disk", "gpu-only")


def test_unknown_backend_names_it_and_lists_valid_ones():
    with pytest.raises(OptionError, match=r"--kv-backend: unknown backend 'nvme'.*valid: all, gpu-only"):
        parse_backends("gpu-only,nvme", KNOWN)


def test_lengths_sorted_and_deduplicated():
    assert parse_lengths("1024,256,1024", 128) == (256, 1024)


@pytest.mark.parametrize("value", ["128", "64,1024"])
def test_length_not_above_one_block_is_refused(value):
    with pytest.raises(OptionError, match="--kv-lengths: .* not above one KV block \\(128 tokens\\)"):
        parse_lengths(value, 128)


def test_lengths_must_be_numbers():
    with pytest.raises(OptionError, match="--kv-lengths '1k'"):
        parse_lengths("1k", 16)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "0.5,0"])
def test_fraction_outside_unit_interval_is_refused(value):
    with pytest.raises(OptionError, match=r"--kv-fractions: .* outside \(0, 1\]"):
        parse_fractions(value)


def test_fractions_parse():
    assert parse_fractions("0.9,0.1,1") == (0.1, 0.9, 1.0)


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_rounds_must_be_positive(value):
    with pytest.raises(OptionError, match="--kv-rounds"):
        parse_positive_int("--kv-rounds", value)


def test_server_url_needs_scheme_and_host():
    assert parse_server_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert parse_server_url("") is None
    with pytest.raises(OptionError, match="--kv-server-url 'localhost:8000'"):
        parse_server_url("localhost:8000")


def test_server_args_split_like_a_shell():
    assert parse_server_args(["--max-num-seqs 4", "--kv-transfer-config '{\"a\": 1}'"]) == (
        "--max-num-seqs", "4", "--kv-transfer-config", '{"a": 1}')
    with pytest.raises(OptionError, match="--kv-server-arg"):
        parse_server_args(["'unclosed"])


def test_missing_model_folder_names_shipped_models(tmp_path):
    with pytest.raises(OptionError, match=r"--kv-model '.*nope'.*tiny-llama.*folder with an HF config.json"):
        parse_model(str(tmp_path / "nope"))


def test_model_folder_without_config(tmp_path):
    with pytest.raises(OptionError, match="has no config.json"):
        parse_model(str(tmp_path))


def test_model_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(OptionError, match="config.json is not valid JSON"):
        parse_model(str(tmp_path))


def test_length_beyond_model_context():
    model = parse_model("tiny-llama")
    with pytest.raises(OptionError, match="not below the model's context of 16384"):
        check_fits_model((1024, 20000), model)


def test_disk_options_are_typed_and_checked():
    assert parse_disk_opts(["read_gbps=6", "store_dir=/nvme/kv", "load_mode=sync"], 128) == {
        "read_gbps": 6, "store_dir": "/nvme/kv", "load_mode": "sync"}
    with pytest.raises(OptionError, match="--kv-disk-opt 'read_gbps': expected KEY=VALUE"):
        parse_disk_opts(["read_gbps"], 128)
    with pytest.raises(OptionError, match="--kv-disk-opt: unknown option"):
        parse_disk_opts(["speed=1"], 128)
    with pytest.raises(OptionError, match="--kv-disk-opt: chunk_tokens 100 must be a positive multiple"):
        parse_disk_opts(["chunk_tokens=100"], 128)


# ---- every declared option and every connector key has a bad value that ends in one line naming it ----

from pytest_kvoffload.serve.builtin import default_registry# noqa: E402
from pytest_kvoffload.connector.config import OPTIONS as CONNECTOR_OPTIONS, RIGGED_OPTIONS  # noqa: E402
from pytest_kvoffload.harness.options import OPTIONS, OptionValues, read_options  # noqa: E402

TRACE = {"kv_trace": "{trace}"}

# flag -> (values by option name, the start of the message); "{trace}" and "{file}" are filled in per test.
BAD_VALUES = {
    "--kv-backend": ({"kv_backend": "nvme"}, "--kv-backend: unknown backend 'nvme'; valid: all, gpu-only"),
    "--kv-ab": ({"kv_ab": "gpu-only"}, "--kv-ab 'gpu-only': expected two backends A,B"),
    "--kv-model": ({"kv_model": "/no/such/model"}, "--kv-model '/no/such/model': no such folder"),
    "--kv-lengths": ({"kv_lengths": "1k"}, "--kv-lengths '1k': expected a comma list of whole token counts"),
    "--kv-fractions": ({"kv_fractions": "half"}, "--kv-fractions 'half': expected a comma list of numbers in (0, 1]"),
    "--kv-rounds": ({"kv_rounds": "0"}, "--kv-rounds '0': expected a whole number of at least 1"),
    "--kv-random-seed": ({"kv_random_seed": "-1"}, "--kv-random-seed '-1': expected a whole number of at least 0"),
    "--kv-max-prefill": ({"kv_max_prefill": "soon"}, "--kv-max-prefill 'soon': expected a number above 0"),
    "--kv-results-dir": ({"kv_results_dir": "{file}"}, "--kv-results-dir '{file}': a file; expected a folder"),
    "--kv-server-url": ({"kv_server_url": "localhost"}, "--kv-server-url 'localhost': expected an http(s) URL"),
    "--kv-server-timeout": ({"kv_server_timeout": "0"}, "--kv-server-timeout '0': expected a number above 0"),
    "--kv-server-arg": ({"kv_server_args": ["'unclosed"]}, "--kv-server-arg \"'unclosed\": cannot split it"),
    "--kv-backend-python": ({"kv_backend_python": ["gpu-only"]},
                            "--kv-backend-python 'gpu-only': expected NAME=/path/to/venv/bin/python"),
    "--kv-weights": ({"kv_weights": "heavy"}, "--kv-weights 'heavy': expected auto, random or dummy"),
    "--kv-dtype": ({"kv_dtype": "fp8"}, "--kv-dtype 'fp8': expected auto or one of bfloat16, float16, float32"),
    "--kv-admission": ({"kv_admission": "maybe"}, "--kv-admission 'maybe': expected one of queue, static"),
    "--kv-page-cache": ({"kv_page_cache": "hot"}, "--kv-page-cache 'hot': expected cold (the default"),
    "--kv-engine": ({"kv_engine": "two-process"}, "--kv-engine 'two-process': expected vllm (the default"),
    "--kv-engine-tokens": ({"kv_engine_tokens": "4096"},
                           "--kv-engine-tokens 4096: expected at least 8320 (the servers' --max-model-len"),
    "--kv-block-size": ({"kv_block_size": "big"}, "--kv-block-size 'big': expected a whole number of at least 1"),
    "--kv-cpu-gib": ({"kv_cpu_gib": "lots"}, "--kv-cpu-gib 'lots': expected a number above 0"),
    "--kv-disk-gb": ({"kv_disk_gb": "-1"}, "--kv-disk-gb '-1': expected a number above 0"),
    "--kv-disk-opt": ({"kv_disk_opts": ["read_gbps"]}, "--kv-disk-opt 'read_gbps': expected KEY=VALUE"),
    "--kv-gpu-memory-utilization": ({"kv_gpu_memory_utilization": "1.5"},
                                    "--kv-gpu-memory-utilization '1.5': expected a number above 0 and at most 1"),
    "--kv-tensor-parallel": ({"kv_tensor_parallel": "0"}, "--kv-tensor-parallel '0': expected a whole number"),
    "--kv-trace": ({"kv_trace": "/no/such/trace.jsonl"}, "--kv-trace: "),
    "--kv-trace-format": ({**TRACE, "kv_trace_format": "csv"}, "--kv-trace-format 'csv': expected one of"),
    "--kv-trace-tokens-per-block": ({**TRACE, "kv_trace_tokens_per_block": "0"},
                                    "--kv-trace-tokens-per-block '0': expected a whole number of at least 1"),
    "--kv-trace-time-scale": ({**TRACE, "kv_trace_time_scale": "-1"},
                              "--kv-trace-time-scale '-1': expected a number above 0"),
    "--kv-trace-limit": ({**TRACE, "kv_trace_limit": "x"}, "--kv-trace-limit 'x': expected a whole number"),
    "--kv-trace-window": ({**TRACE, "kv_trace_window": "5:1"}, "--kv-trace-window '5:1': END must be after START"),
    "--kv-trace-mode": ({**TRACE, "kv_trace_mode": "burst"}, "--kv-trace-mode 'burst': expected open or closed"),
    "--kv-trace-concurrency": ({**TRACE, "kv_trace_concurrency": "0"},
                               "--kv-trace-concurrency '0': expected a whole number of at least 1"),
    "--kv-trace-max-output": ({**TRACE, "kv_trace_max_output": "none"},
                              "--kv-trace-max-output 'none': expected a whole number of at least 1"),
    "--kv-trace-slice": ({**TRACE, "kv_trace_slice": "some"},
                         "--kv-trace-slice 'some': expected a whole number of at least 1"),
    "--kv-trace-repeats": ({**TRACE, "kv_trace_repeats": "0"},
                           "--kv-trace-repeats '0': expected a whole number of at least 1"),
}

# connector key -> (bad value, the start of the message after "--kv-disk-opt: ")
BAD_DISK_OPTS = {
    "store_dir": ("", "store_dir is required"),
    "capacity_gb": ("0", "capacity_gb 0.0 must be above 0"),
    "chunk_tokens": ("100", "chunk_tokens 100 must be a positive multiple of the block size 128"),
    "io_threads": ("abc", "io_threads 'abc' must be a whole number of threads"),
    "io_slice_us": ("50", "io_slice_us 50 must be 0 (the kernel's default) or 100 to 100000"),
    "idle_wait_ms": ("-1", "idle_wait_ms -1.0 must be 0 (never wait) to 1000"),
    "load_io": ("uring", "load_io 'uring' must be 'aio' (native AIO, one thread) or 'threads' (load_threads threads)"),
    "load_cpus": ("some", "load_cpus 'some' must be 'worker' (the worker's CPUs) or 'all' (every CPU)"),
    "save_cpus": ("both", "save_cpus 'both' must be 'worker' (the worker's CPUs) or 'all' (every CPU)"),
    "load_threads": ("1", "load_threads 1 must be at least io_threads (2): that many read at once"),
    "direct_io": ("maybe", "direct_io 'maybe' must be true or false"),
    "huge_pages": ("some", "huge_pages 'some' must be true or false"),
    "read_ahead_mb": ("-1", "read_ahead_mb -1.0 must be 0 (off) or more"),
    "timeline": ("/no/such/folder/t.jsonl", "timeline '/no/such/folder/t.jsonl' must be a file in a folder that exists"),
    "read_gbps": ("fast", "read_gbps 'fast' must be a number of GB/s"),
    "read_latency_ms": ("-5", "read_latency_ms -5 must be a number of milliseconds, 0 or more"),
    "calibration": ("/no/such.json", "calibration /no/such.json: no such file"),
    "calibration_mismatch": ("maybe", "calibration_mismatch 'maybe' must be 'refuse' or 'accept'"),
    "load_mode": ("lazy", "load_mode 'lazy' must be 'async' or 'sync'"),
    "admission": ("maybe", "admission 'maybe' must be one of queue, static"),
    "fault": ("melt", "fault 'melt' must be one of zero, shift, alternate, stale"),
}


def test_every_option_and_connector_key_has_a_bad_value_test():
    assert set(BAD_VALUES) == {option.flag for option in OPTIONS if not option.switch}
    assert set(BAD_DISK_OPTS) == set(CONNECTOR_OPTIONS) | set(RIGGED_OPTIONS)


def fill(value, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]}\n')
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    if isinstance(value, list):
        return [fill(v, tmp_path) for v in value]
    return value.replace("{trace}", str(trace)).replace("{file}", str(a_file))


def read(values: dict, tmp_path):
    # Dummy weights and one length keep the good parts of each case cheap; the bad value is what is checked.
    base = {"kv_weights": "dummy", "kv_lengths": "512", "kv_results_dir": str(tmp_path / "results")}
    return read_options(OptionValues.from_mapping({**base, **values}, tmp_path), default_registry())


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_DEVICE", "cpu")


@pytest.mark.parametrize("flag", list(BAD_VALUES))
def test_bad_value_is_one_line_naming_the_option(flag, tmp_path, cpu_machine):
    values, message = BAD_VALUES[flag]
    values = {name: fill(value, tmp_path) for name, value in values.items()}
    with pytest.raises(OptionError) as caught:
        read(values, tmp_path)
    text = str(caught.value)
    assert text.startswith(fill(message, tmp_path)), text
    assert "\n" not in text and flag in text


@pytest.mark.parametrize("key", list(BAD_DISK_OPTS))
def test_bad_connector_key_is_one_line_naming_the_key(key, tmp_path, cpu_machine):
    value, message = BAD_DISK_OPTS[key]
    with pytest.raises(OptionError) as caught:
        read({"kv_disk_opts": [f"{key}={value}"]}, tmp_path)
    text = str(caught.value)
    assert text.startswith(f"--kv-disk-opt: {message}"), text
    assert "\n" not in text


def test_good_values_make_settings(tmp_path, cpu_machine):
    """The control: the same reader accepts good values, so the bad-value cases fail on the value alone."""
    settings, plan = read({"kv_random_seed": "7", "kv_disk_opts": ["direct_io=off", "io_threads=4"],
                           "kv_trace": fill("{trace}", tmp_path), "kv_trace_window": "0:60"}, tmp_path)
    assert settings.random_seed == 7 and settings.disk_opts == {"direct_io": "off", "io_threads": 4}
    assert settings.results_dir == tmp_path / "results" and plan.scaling.window_s == (0.0, 60.0)


def test_mapping_with_an_unknown_option_name_is_refused():
    with pytest.raises(KeyError, match="kv_lenghts"):
        OptionValues.from_mapping({"kv_lenghts": "512"})


# ---- output checks with teeth on a GPU, and said to be blind where they are ----

def test_auto_weights_on_a_gpu_are_random_below_the_stated_size(monkeypatch, tmp_path):
    import pytest_kvoffload.serve.weights as weights
    from pytest_kvoffload.core.models import load_model
    from pytest_kvoffload.harness.option_parsing import AUTO_RANDOM_MAX_PARAMS_GPU, output_checks, parse_weights
    written = []
    monkeypatch.setattr(weights, "_write", lambda *a: written.append(a))
    monkeypatch.setenv("KVOFFLOAD_CACHE", str(tmp_path))
    for name in ("llama-3.2-3b", "llama-3.1-8b"):
        assert load_model(name).parameter_count() < AUTO_RANDOM_MAX_PARAMS_GPU
        planned = parse_weights("auto", load_model(name), on_gpu=True)
        assert planned.weights_seed == 0 and planned.has_weights and "-bf16-" in planned.path.name
    assert written == [] and not any(tmp_path.rglob("*.safetensors"))  # parsing writes nothing
    big = load_model("llama-3.3-70b")
    assert big.parameter_count() > AUTO_RANDOM_MAX_PARAMS_GPU
    served = parse_weights("auto", big, on_gpu=True)
    assert not served.has_weights and output_checks(served).startswith("blind: vLLM's dummy weights")
    assert parse_weights("dummy", load_model("llama-3.2-3b"), on_gpu=True).has_weights is False


def test_planned_weights_are_written_once_before_the_servers(monkeypatch, tmp_path):
    import pytest_kvoffload.serve.weights as weights
    from pytest_kvoffload.core.models import load_model
    from pytest_kvoffload.harness.option_parsing import OptionError, parse_weights, write_weights
    written = []
    monkeypatch.setattr(weights, "_write", lambda model, folder, seed, on_gpu: written.append(folder) or (
        folder.mkdir(parents=True, exist_ok=True), (folder / weights.WEIGHTS_FILE).write_bytes(b"x")))
    monkeypatch.setenv("KVOFFLOAD_CACHE", str(tmp_path))
    planned = parse_weights("random", load_model("tiny-llama"), on_gpu=False)
    write_weights(planned, on_gpu=False)
    write_weights(planned, on_gpu=False)
    assert written == [planned.path]
    monkeypatch.setattr(weights, "_write", lambda *a: (_ for _ in ()).throw(PermissionError("read-only")))
    other = parse_weights("random", load_model("llama-3.2-3b"), on_gpu=False)
    with pytest.raises(OptionError, match="--kv-weights random: cannot write the weights .*read-only"):
        write_weights(other, on_gpu=False)


def test_a_report_of_a_dummy_weight_run_says_its_output_checks_are_blind():
    from pytest_kvoffload.record.report import render

    blind = render({"options": {"output_checks": "blind: vLLM's dummy weights (+-1e-3)"}, "backends": {}, "cells": []})
    assert blind.startswith("output checks blind: vLLM's dummy weights")
    assert "blind" not in render({"options": {"output_checks": "seeded random weights"}, "backends": {}, "cells": []})


def test_an_engine_cache_of_exactly_one_longest_prompt_is_accepted_and_one_token_less_is_not(tmp_path, cpu_machine):
    # The near miss of the check: --max-model-len itself (8,320 with the default lengths) must start.
    assert read({"kv_engine_tokens": "8320"}, tmp_path)[0].engine_tokens == 8320
    with pytest.raises(OptionError, match="--kv-engine-tokens 8319: expected at least 8320"):
        read({"kv_engine_tokens": "8319"}, tmp_path)
