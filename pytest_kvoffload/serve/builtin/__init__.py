"""The built-in backends (docs/backends.md), one module each: gpu_only, native_cpu, native_disk, lmcache_disk,
kvoffload_disk and lmcache_inproc_disk (CUDA only); and the registry that holds them."""

from __future__ import annotations

from pytest_kvoffload.serve.backend import Backend, BackendRegistry
from pytest_kvoffload.serve.builtin import (gpu_only, kvoffload_disk, lmcache_disk, lmcache_inproc_disk, native_cpu,
                                            native_disk)

# The registry's order is --kv-backend=all's.
MODULES = (gpu_only, native_cpu, lmcache_disk, native_disk, kvoffload_disk, lmcache_inproc_disk)


def builtin_backends() -> list[Backend]:
    return [module.backend() for module in MODULES]


def default_registry() -> BackendRegistry:
    registry = BackendRegistry()
    for backend in builtin_backends():
        registry.register(backend)
    return registry
