import json

import pytest

from pytest_kvoffload.core.models import ModelError, load_model, shipped_models


def test_shipped_models():
    assert set(shipped_models()) >= {"tiny-llama", "llama-3.2-3b", "qwen3-4b", "llama-3.1-8b", "llama-3.3-70b"}


@pytest.mark.parametrize("name,kv_bytes", [
    ("llama-3.2-3b", 114_688),
    ("llama-3.3-70b", 327_680),
    ("llama-3.1-8b", 131_072),
    ("qwen3-4b", 147_456),
    ("tiny-llama", 4_096),
])
def test_kv_bytes_per_token_from_config(name, kv_bytes):
    assert load_model(name).kv_bytes_per_token() == kv_bytes


def test_fp8_kv_halves_the_bytes():
    assert load_model("llama-3.2-3b").kv_bytes_per_token(kv_dtype_bytes=1) == 114_688 // 2


@pytest.mark.parametrize("name,params", [("llama-3.3-70b", 70.55e9), ("llama-3.1-8b", 8.03e9), ("llama-3.2-3b", 3.21e9)])
def test_parameter_count_matches_published_sizes(name, params):
    assert load_model(name).parameter_count() == pytest.approx(params, rel=0.01)


def test_any_folder_with_a_config(tmp_path):
    config = json.loads(load_model("tiny-llama").path.joinpath("config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(str(tmp_path))
    assert model.path == tmp_path.resolve()
    assert model.kv_bytes_per_token() == 4096
    assert not model.has_weights


def test_config_missing_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelError, match="lacks num_hidden_layers"):
        load_model(str(tmp_path))


def test_a_model_folder_is_named_by_the_folder_and_its_run_id_is_one_folder_name(tmp_path):
    import json

    from pytest_kvoffload.core.models import load_model
    from pytest_kvoffload.harness.session import make_run_id

    folder = tmp_path / "some dir" / "hm"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64,
                                                    "num_attention_heads": 2, "vocab_size": 100}))
    model = load_model(str(folder))
    assert model.name == "hm"
    assert "/" not in make_run_id(model.name) and "/" not in make_run_id("/odd/name with spaces")


def test_random_weights_for_a_gpu_are_bf16_in_a_folder_of_their_own(tmp_path):
    from safetensors import safe_open

    from pytest_kvoffload.core.models import ModelInfo
    from pytest_kvoffload.serve.weights import WEIGHTS_FILE, with_random_weights

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
              "num_hidden_layers": 2, "max_position_embeddings": 512}
    model = ModelInfo(name="mini", path=tmp_path / "cfg", config=config)
    cpu = with_random_weights(model, root=tmp_path)
    gpu = with_random_weights(model, root=tmp_path, on_gpu=True)  # drawn on the GPU where there is one
    assert cpu.path != gpu.path and "-bf16-" in gpu.path.name
    with safe_open(str(gpu.path / WEIGHTS_FILE), "pt") as f:
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"
    with safe_open(str(cpu.path / WEIGHTS_FILE), "pt") as f:
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.float32"
