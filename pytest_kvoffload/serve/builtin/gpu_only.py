"""The gpu-only backend: the engine's own prefix cache and no tier below it, the recompute baseline."""

from __future__ import annotations

from pytest_kvoffload.serve.backend import Backend

NAME = "gpu-only"


def backend() -> Backend:
    return Backend(name=NAME, description="the engine's own prefix cache, no offload tier", role="baseline")
