"""Reading the backend options: --kv-backend's list and its NAME[KEY=VALUE,...] variants, --kv-ab's pair and
--kv-backend-python's interpreters, each into the registry (serve/backend.py), with one-line errors."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pytest_kvoffload.core.vllm_releases import UnsupportedVllm
from pytest_kvoffload.serve.backend import Backend, BackendConfigError, BackendRegistry, twin_name, with_connector_options
from pytest_kvoffload.serve.command_line import server_release


def split_backends(value: str) -> list[str]:
    """A --kv-backend list split on the commas outside brackets: `a,b[x=1,y=2]` is two backends."""
    names, depth, current = [], 0, ""
    for char in value:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(current.strip())
            current = ""
        else:
            current += char
    names.append(current.strip())
    return [n for n in names if n]


def parse_variant(text: str, registry: BackendRegistry) -> Backend:
    """NAME[KEY=VALUE,...]: a registered backend with connector options, under that name. VALUE is read as
    JSON where it parses (numbers, true/false), else as a string. Raises BackendConfigError, one line."""
    usage = f"--kv-backend {text!r}: expected NAME[KEY=VALUE,...], e.g. {registry.ours()}[io_threads=4]"
    base, bracket, rest = text.partition("[")
    if not bracket or not rest.endswith("]") or not rest[:-1].strip():
        raise BackendConfigError(usage)
    if base not in registry:
        raise BackendConfigError(f"--kv-backend {text!r}: unknown backend {base!r}; valid: {', '.join(registry.names())}")
    backend = registry.get(base)
    options = {}
    for pair in rest[:-1].split(","):
        key, equals, value = (part.strip() for part in pair.partition("="))
        if not equals or not key or not value:
            raise BackendConfigError(usage)
        if key not in backend.option_keys:
            valid = ", ".join(sorted(backend.option_keys)) or "none (it has no connector)"
            raise BackendConfigError(f"--kv-backend {text!r}: {base} has no option {key!r}; valid: {valid}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    try:  # the backend's module checks its options and makes the variant (serve/builtin/)
        return with_connector_options(backend, text[len(base) + 1:-1], user_facing=True, **options)
    except BackendConfigError as exc:
        raise BackendConfigError(f"--kv-backend {text!r}: {exc}") from None


def register_variants(registry: BackendRegistry, names: list[str]) -> None:
    """Register every NAME[KEY=VALUE,...] of a --kv-backend list that is not registered yet."""
    for name in names:
        if "[" in name and name not in registry:
            registry.register(parse_variant(name, registry))


def register_ab(registry: BackendRegistry, value: str) -> tuple[str, str]:
    """--kv-ab A,B: the pair's names, variants registered; B compared with itself gets a twin of its own."""
    names = split_backends(value)
    if len(names) != 2:
        ours = registry.ours()
        raise BackendConfigError(f"--kv-ab {value!r}: expected two backends A,B, e.g. {ours},{ours}[read_gbps=0.05]")
    register_variants(registry, names)
    for name in names:
        if name not in registry:
            raise BackendConfigError(f"--kv-ab {value!r}: unknown backend {name!r}; valid: {', '.join(registry.names())}")
    a, b = names
    if a == b:
        b = twin_name(a)
        if b not in registry:
            registry.register(dataclasses.replace(registry.get(a), name=b, user_facing=False))
    return a, b


def use_python(registry: BackendRegistry, specs: list[str]) -> None:
    """--kv-backend-python NAME=PATH: run NAME's server with that interpreter (another vLLM or LMCache)."""
    for spec in specs:
        name, equals, path = spec.partition("=")
        if not equals or not name or not path:
            raise BackendConfigError(f"--kv-backend-python {spec!r}: expected NAME=/path/to/venv/bin/python")
        if name not in registry:
            raise BackendConfigError(f"--kv-backend-python {spec!r}: unknown backend {name!r}; valid: "
                                     f"{', '.join(registry.names())}")
        interpreter = Path(path).expanduser()
        if not interpreter.is_file() or not os.access(interpreter, os.X_OK):
            raise BackendConfigError(f"--kv-backend-python {spec!r}: {interpreter} is not an executable file")
        backend = dataclasses.replace(registry.get(name), python=str(interpreter))
        try:  # another vLLM must be one the harness and the connector know (core/vllm_releases.py)
            server_release(backend)
        except UnsupportedVllm as exc:
            raise BackendConfigError(f"--kv-backend-python {spec!r}: {exc}") from None
        registry.register(backend, replace=True)
