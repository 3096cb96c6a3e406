"""Model configurations: the shipped ones and any HF config.json, and what follows from them.

Only the config is needed: vLLM serves it with dummy weights, and the break-even analysis needs just
the KV bytes per token and the parameter count, both of which the config fixes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The shipped configs stay at the package root (package data in pyproject.toml).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "model_configs"

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1, "float8": 1}


class ModelError(ValueError):
    """A model name or folder that cannot be used; the message is meant for the user."""


def shipped_models() -> list[str]:
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file())


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    config: dict
    # Seeded random weights planned for `path`, written before a server starts (serve/weights.py); None: none.
    weights_seed: int | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def num_q_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_q_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden_size // self.num_q_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_model_len(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)

    @property
    def dtype(self) -> str:
        return str(self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16")

    @property
    def has_weights(self) -> bool:
        return (self.weights_seed is not None or any(self.path.glob("*.safetensors"))
                or any(self.path.glob("*.bin")))

    def kv_bytes_per_token(self, kv_dtype_bytes: int | None = None) -> int:
        """layers x (K and V) x KV heads x head dim x bytes per element."""
        nbytes = kv_dtype_bytes if kv_dtype_bytes is not None else DTYPE_BYTES.get(self.dtype, 2)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * nbytes

    def parameter_count(self) -> int:
        """Dense decoder parameters: embeddings, attention, gated MLP and norms."""
        h, hd = self.hidden_size, self.head_dim
        inter = int(self.config["intermediate_size"])
        attn = h * self.num_q_heads * hd * 2 + h * self.num_kv_heads * hd * 2
        per_layer = attn + 3 * h * inter + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.config.get("tie_word_embeddings") else embed
        return embed + head + self.num_layers * per_layer + h


def load_model(name_or_path: str) -> ModelInfo:
    """A shipped model name, or a folder holding an HF config.json (weights optional)."""
    shipped = SHIPPED_DIR / name_or_path
    if "/" not in name_or_path and (shipped / "config.json").is_file():
        folder = shipped
    else:
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir():
            raise ModelError(
                f"--kv-model {name_or_path!r}: no such folder and not a shipped model; "
                f"use one of {', '.join(shipped_models())} or a folder with an HF config.json"
            )
        if not (folder / "config.json").is_file():
            raise ModelError(f"--kv-model {name_or_path!r}: the folder has no config.json")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"--kv-model {name_or_path!r}: config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(f"--kv-model {name_or_path!r}: config.json must hold a JSON object")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise ModelError(f"--kv-model {name_or_path!r}: config.json lacks {', '.join(missing)}")
    # A folder's model is named by the folder (an absolute path joined to SHIPPED_DIR is that path itself).
    name = name_or_path if folder == shipped and "/" not in name_or_path else folder.resolve().name
    return ModelInfo(name=name, path=folder.resolve(), config=config)
