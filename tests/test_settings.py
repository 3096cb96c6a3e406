import pytest

from pytest_kvoffload.settings import (OptionError, check_fits_model, parse_backends, parse_fractions, parse_lengths,
                                       parse_disk_opts, parse_model, parse_positive_int, parse_server_args, parse_server_url)

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
