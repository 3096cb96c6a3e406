"""The first-order model (prefill FLOPs over peak times MFU): the bandwidth at which loading a prefix ties recomputing it.

t_prefill(n) = (2 P n + layers x 2 n^2 x q_heads x head_dim) / (peak FLOP/s x MFU)
required_bw(n) = kv_bytes_per_token x n / t_prefill(n)
No fixed overhead, so it is a lower bound on what a real tier needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvoffload.core.models import ModelInfo

H100_SXM_BF16_TFLOPS = 989.0
DEFAULT_MFU = 0.5


@dataclass(frozen=True)
class Estimate:
    tokens: int
    prefill_s: float
    kv_bytes: int
    required_gbps: float


def prefill_seconds(params: float, layers: int, q_heads: int, head_dim: int, tokens: int, flops: float) -> float:
    matmul = 2 * params * tokens
    attention = layers * 2 * tokens ** 2 * q_heads * head_dim  # causal QK^T and AV
    return (matmul + attention) / flops


def estimate(model: ModelInfo, tokens: int, peak_tflops: float = H100_SXM_BF16_TFLOPS, mfu: float = DEFAULT_MFU,
             kv_dtype_bytes: int | None = None, params: float | None = None) -> Estimate:
    flops = peak_tflops * 1e12 * mfu
    p = params if params is not None else model.parameter_count()
    t = prefill_seconds(p, model.num_layers, model.num_q_heads, model.head_dim, tokens, flops)
    kv = model.kv_bytes_per_token(kv_dtype_bytes) * tokens
    return Estimate(tokens, t, kv, kv / t / 1e9)


def first_order_at_measured_speed(model: ModelInfo, cold_seconds: dict[int, float], kv_dtype_bytes: int | None = None) -> dict:
    """The first-order formula at the prefill FLOP/s this run achieved on its longest cold prompt.

    Side by side with the measured break-even, it shows what the first-order model leaves out (fixed
    costs, the attention kernels' real speed at each length) without a guess of peak FLOP/s and MFU.
    """
    n = max(cold_seconds)
    work = prefill_seconds(model.parameter_count(), model.num_layers, model.num_q_heads, model.head_dim, n, 1.0)
    flops = work / cold_seconds[n]
    return {"tflops": flops / 1e12, "from_tokens": n,
            "gbps": {str(length): estimate(model, length, peak_tflops=flops / 1e12, mfu=1.0,
                                           kv_dtype_bytes=kv_dtype_bytes).required_gbps
                     for length in sorted(cold_seconds)}}
