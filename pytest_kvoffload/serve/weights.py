"""Seeded random weights for a model config, written once as safetensors: a model whose answers depend on its KV.

vLLM's `--load-format dummy` fills every weight uniformly in +-1e-3. Attention then adds about 1e-3 of the
residual stream, and greedy output stays the same whatever KV a cache hands back (zeros, another
prompt's, two blocks swapped), so comparing outputs on such a model proves nothing. Normal weights with a
larger scale (std 0.08; embeddings std 1, so tokens differ strongly) make attention sharp: wrong KV
changes the next tokens, correct KV keeps them. The geometry and the compute are those of the config, so
timings are the dummy model's.

The folder is made once per (config, seed) under the cache folder and reused: a 55M-parameter tiny
model is about 220 MB in float32 and takes a few seconds to write.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from pytest_kvoffload.core.models import ModelError, ModelInfo

STD = 0.08
EMBED_STD = 1.0
WEIGHTS_FILE = "model.safetensors"


def cache_dir() -> Path:
    """KVOFFLOAD_CACHE, else ~/.cache/pytest-kvoffload."""
    return Path(os.environ.get("KVOFFLOAD_CACHE") or Path.home() / ".cache" / "pytest-kvoffload")


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an HF LlamaForCausalLM checkpoint for this config."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, h),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": (h, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def with_random_weights(model: ModelInfo, seed: int = 0, root: Path | None = None, on_gpu: bool = False) -> ModelInfo:
    """`model` served from a folder holding its config and seeded random weights (made on first use). On a
    GPU they are drawn there and kept in bf16 (half the bytes; the served dtype on a GPU is the model's)."""
    return write_planned(random_weights_plan(model, seed, root, on_gpu), on_gpu)


def random_weights_plan(model: ModelInfo, seed: int = 0, root: Path | None = None, on_gpu: bool = False) -> ModelInfo:
    """The model as it will be served with seeded random weights: their folder, nothing written yet."""
    if model.config.get("model_type") != "llama":
        raise ModelError(f"--kv-weights random: only Llama-architecture configs are supported, not "
                         f"{model.config.get('model_type')!r} ({model.name}); use --kv-weights dummy")
    if model.has_weights:
        return model
    digest = hashlib.blake2b(json.dumps(model.config, sort_keys=True).encode(), digest_size=6).hexdigest()
    kind = "-bf16" if on_gpu else ""
    folder = (root or cache_dir()) / "models" / f"{model.name}-random{seed}{kind}-{digest}"
    return ModelInfo(name=model.name, path=folder.resolve(), config=model.config, weights_seed=seed)


def write_planned(model: ModelInfo, on_gpu: bool = False) -> ModelInfo:
    """Write the weights a plan names (random_weights_plan), unless written before; OSError where it cannot."""
    if model.weights_seed is not None and not (model.path / WEIGHTS_FILE).is_file():
        _write(model, model.path, model.weights_seed, on_gpu)
    return model


def _write(model: ModelInfo, folder: Path, seed: int, on_gpu: bool = False) -> None:
    import torch
    from safetensors.torch import save_file

    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in llama_shapes(model.config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            std = EMBED_STD if "embed_tokens" in name else STD
            drawn = torch.randn(shape, generator=generator, device=device) * std
            tensors[name] = drawn.to(dtype).cpu()
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = dict(model.config, torch_dtype="bfloat16" if on_gpu else "float32")
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    try:
        staging.rename(folder)  # atomic: a concurrent maker either wins or finds the folder complete
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / WEIGHTS_FILE).is_file():
            raise
