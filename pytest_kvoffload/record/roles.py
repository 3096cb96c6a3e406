"""What each backend of a recorded run is to the project (run.json backends.NAME.role, from its backend's
declaration: serve/backend.py): "ours", "baseline" or "peer". A run recorded before roles were gets them from
the registry of whoever reads it (the kvoffload command: with_roles)."""

from __future__ import annotations


def with_roles(run: dict, roles: dict[str, str]) -> dict:
    """`run` with a role for each backend entry that has none, from `roles` (name -> role); a variant
    (NAME[...]) or an A/B twin takes its base's."""
    backends = {}
    for name, entry in (run.get("backends") or {}).items():
        base = name.partition("[")[0].removesuffix("~b")
        role = entry.get("role") or roles.get(name) or roles.get(base)
        backends[name] = {**entry, "role": role} if role else entry
    return {**run, "backends": backends}


def _role(run: dict, role: str) -> str | None:
    return next((n for n, e in (run.get("backends") or {}).items() if e.get("role") == role and "[" not in n), None)


def ours(run: dict) -> str | None:
    """The backend of pytest-kvoffload's own connector in this run (None: not recorded, or not run)."""
    return _role(run, "ours")


def baseline(run: dict) -> str | None:
    """The run's backend without a tier that offload verdicts are against."""
    return _role(run, "baseline")
