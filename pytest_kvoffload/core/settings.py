"""The run's settings: what harness/options.py parsed from the command line and ini file, before any server starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pytest_kvoffload.core.models import DTYPE_BYTES, ModelInfo


@dataclass(frozen=True)
class Settings:
    backends: tuple[str, ...]
    model: ModelInfo
    lengths: tuple[int, ...]
    fractions: tuple[float, ...]
    rounds: int
    results_dir: Path
    block_size: int
    server_url: str | None = None
    server_args: tuple[str, ...] = ()
    server_timeout: float = 600.0
    # --kv-random-seed: prompts' token draws and vLLM's --seed (sampling), so reruns send the same prompts.
    random_seed: int = 0
    # --kv-disk-opt: kvoffload-disk connector options (connector/config.py), checked as the connector will.
    disk_opts: dict = field(default_factory=dict)
    # Sizes of the tiers and of the engine: --kv-cpu-gib, --kv-disk-gb, --kv-gpu-memory-utilization.
    cpu_gib: float = 16.0
    disk_gb: float = 64.0
    gpu_memory_utilization: float = 0.9
    # --kv-engine-tokens: the engine's own KV cache in tokens (None: what vLLM sizes from memory).
    engine_tokens: int | None = None
    tensor_parallel: int = 1
    # The dtype vLLM computes and stores KV in (--kv-dtype), and why it was chosen.
    dtype: str = "bfloat16"
    dtype_reason: str = ""
    # Default lengths whose cold prefill, measured at server start, exceeds this many seconds are left
    # out (measure/prefill_speed.py); None keeps every length, as do lengths the user gave (lengths_given).
    max_prefill_s: float | None = None
    lengths_given: bool = False
    # The rule the admission suite's guarded server runs (--kv-admission; connector/admission_rule.py).
    admission: str = "queue"
    # A buffered disk tier's files before each tier-only round: "cold" (dropped from the page cache, so the
    # hit reads the disk) or "warm" (left there: the figures are served from memory, and say so).
    page_cache: str = "cold"
    # How a CPU server runs its engine (--kv-engine; serve/cpu_engine.py): "vllm" (vLLM's own executor) or
    # "one-process" (its uniprocess executor, no worker process).
    engine: str = "vllm"
    # --kv-ab: the two backends an A/B run compares, both up at once (suites/test_ab.py); None: no A/B.
    ab: tuple[str, str] | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(DTYPE_BYTES[self.dtype])

    @property
    def max_model_len(self) -> int:
        # Room for the longest prompt plus output, at least 8k so that tests of multi-step prefills fit,
        # never past what the model supports.
        return min(self.model.max_model_len, max(max(self.lengths), 8192) + self.block_size)
