"""A KV backend: what it declares about its server (its command line's part, its tier folders, how a variant
is made, its role) and the registry users extend. Each built-in backend is a module of serve/builtin/; the
full command line is serve/command_line.py's job, starting it serve/server.py's, measuring it the suites'.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pytest_kvoffload.serve.companion import CompanionSpec
from pytest_kvoffload.core import machine
from pytest_kvoffload.core.settings import Settings


class BackendConfigError(ValueError):
    """A backend's server command that cannot work here; the message is one line for the user."""


@dataclass(frozen=True)
class LaunchContext:
    """What a backend may use to build its server: the run's settings and a scratch folder of its own."""

    settings: Settings
    scratch: Path


@dataclass(frozen=True)
class ServerSpec:
    """What a backend adds to vLLM's command line and environment, and the process it needs beside vLLM."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    companion: CompanionSpec | None = None
    # The folders its disk tier keeps files in (none: no disk tier), and whether it asks to read them with
    # O_DIRECT: a buffered tier's files are dropped from the page cache before each tier read (page_cache.py).
    tier_folders: tuple[Path, ...] = ()
    direct_io: bool = True


@dataclass(frozen=True)
class Launch:
    """A server's full command line and environment, its companion's (None: vLLM alone) and its tier's folders."""

    argv: list[str]
    env: dict[str, str]
    companion: CompanionSpec | None = None
    tier_folders: tuple[Path, ...] = ()
    direct_io: bool = True


def _no_extra(ctx: LaunchContext) -> ServerSpec:
    return ServerSpec()


@dataclass(frozen=True)
class Backend:
    """One way of serving with (or without) a KV offload tier.

    `tier` is the `source` label under which vLLM counts this backend's tier hits
    (vllm:prompt_tokens_cached_by_source); None means the backend has no tier below the engine's cache.
    `tier_granularity` is the token multiple in which the tier stores prefixes (None: one KV block).
    `reset_tier` empties a tier that outlives vLLM's reset_external (LMCache's and vLLM's file tiers);
    it runs before the backend's server starts, because LMCache indexes its files in memory.
    Tier-only state (a prefix resident in the tier and nowhere above it): prime `prime_requests` times,
    then reset the engine's cache, and with `evict_connector` the connector's memory tier as well (for a
    file tier behind a CPU tier, which vLLM's reset drains but leaves the files of).
    """

    name: str
    description: str
    tier: str | None = None
    needs_cuda: bool = False
    cuda_reason: str = ""
    configure: Callable[[LaunchContext], ServerSpec] = _no_extra
    tier_granularity: Callable[[Settings], int] | None = None
    reset_tier: Callable[[LaunchContext], None] | None = None
    prime_requests: int = 1
    evict_connector: bool = False
    # Proof that a tier hit was a load, from the connector's own counters: (counter deltas of the request,
    # tokens expected from the tier, KV bytes per token) -> None, or what is wrong. vLLM's per-source
    # counter moves when the scheduler accepts external tokens, even when every load then fails.
    load_proof: Callable[[dict, int, int], str | None] | None = None
    # Whether the tier holds what was stored and nothing above it does yet, from the server's counters (totals):
    # a tier whose stores complete after the request returns (LMCache's server) is waited for before a tier
    # hit is measured (measure/runner.place_in_tier_only). None: the tier is settled when the request returns.
    tier_settled: Callable[[dict], bool] | None = None
    # The tier that serves a prompt's last KV block, which the engine's own cache never serves; None when
    # the backend's connector, like the engine, leaves it to be computed (prompts.expected_cached).
    last_block_source: str | None = None
    # How it counts a prompt it holds whole: False, vLLM's offloading and ours, every whole block (the
    # last one too; vLLM then recomputes one token); True, LMCache's MP connector, every token but the
    # last (it reports len(prompt) - 1: lmcache_mp_connector.py).
    serves_all_but_last_token: bool = False
    # Python modules the backend's processes import besides vLLM (LMCache's server: "lmcache").
    needs_modules: tuple[str, ...] = ()
    # Modules the server loads into vLLM that a build against another torch or vLLM breaks (compiled ops,
    # our connector), imported in the server's Python before it starts (serve/server_imports.py).
    server_imports: Callable[[], tuple[str, ...]] = lambda: ()
    # What a started server's log says of it, for run.json (which connector class vLLM loaded).
    started_facts: Callable[[Path], dict] | None = None
    # What differs on this platform from the backend as users deploy it, in one line (None: nothing).
    platform_note: Callable[[], str | None] = lambda: None
    # kv_connector_extra_config keys a variant (NAME[KEY=VALUE,...]) may set; empty: the backend has none.
    option_keys: frozenset[str] = frozenset()
    # How a variant is made: (the backend, its options, a suffix for its own store) -> the variant, or a
    # BackendConfigError naming a bad option. Its module builds it with `options_variant`; None: no options.
    variant: Callable[["Backend", dict, str], "Backend"] | None = None
    # What it is to the project: "ours" (pytest-kvoffload's connector, the side-by-side's subject), "baseline"
    # (no tier: the recompute every offload verdict is against) or "peer" (another project's tier).
    role: str = "peer"
    # The Python that runs this backend's server (--kv-backend-python); None: the one running pytest.
    python: str | None = None
    # Whether users deploy it as it is: registered backends and the variants a user names on the command
    # line are; emulated drives, planted rules, fault servers and A/B twins are not. Only user-facing
    # backends are gated from night to night (analysis/run_gate.py): the others are re-derived every run.
    user_facing: bool = True
    # Its server's KV block size where it differs from the session's --kv-block-size (the admission suite's
    # servers use finer blocks, to place frontier cells near the break-even); None: the session's.
    block_size: int | None = None

    def unavailable_reason(self) -> str | None:
        if self.needs_cuda and not machine.has_cuda():
            return f"{self.name} needs an NVIDIA GPU: {self.cuda_reason}"
        # Another interpreter (--kv-backend-python) brings its own packages: only this one is looked at.
        missing = [m for m in self.needs_modules if self.python is None and importlib.util.find_spec(m) is None]
        if missing:
            return (f"{self.name} needs the Python package {', '.join(missing)}, not installed here "
                    f"(make installs it; or --kv-backend-python {self.name}=PATH to a Python that has it)")
        return None

    def kv_block(self, settings: Settings) -> int:
        """Its server's KV block size in tokens."""
        return self.block_size or settings.block_size

    def granularity(self, settings: Settings) -> int:
        return self.tier_granularity(settings) if self.tier_granularity else self.kv_block(settings)


class BackendRegistry:
    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}

    def register(self, backend: Backend, replace: bool = False) -> None:
        if backend.name in self._backends and not replace:
            raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True to override it")
        # Commas separate backends in --kv-backend, except inside a variant's brackets.
        if backend.name == "all" or "," in backend.name.partition("[")[0] or not backend.name:
            raise ValueError(f"backend name {backend.name!r} is reserved or malformed")
        self._backends[backend.name] = backend

    def get(self, name: str) -> Backend:
        return self._backends[name]

    def names(self) -> list[str]:
        return list(self._backends)

    def __contains__(self, name: str) -> bool:
        return name in self._backends

    def ours(self) -> str | None:
        """The registered backend whose role is "ours" (pytest-kvoffload's connector), not a variant of it."""
        return next((n for n, b in self._backends.items() if b.role == "ours" and "[" not in n), None)

    def baseline(self) -> str | None:
        """The registered backend with no tier that offload verdicts are against (role "baseline")."""
        return next((n for n, b in self._backends.items() if b.role == "baseline" and "[" not in n), None)

    def tiers(self) -> dict[str, str]:
        """Each registered backend with a tier, and its tier's name (what the record layer fits)."""
        return {name: b.tier for name, b in self._backends.items() if b.tier}


def with_connector_options(backend: Backend, suffix: str, server_args: tuple[str, ...] = (),
                           user_facing: bool = False, **options) -> Backend:
    """A variant of a connector backend with extra connector options, made the way its module says.

    It gets its own name (`name[suffix]`), hence its own server in the session's pool. `server_args` go
    before the user's --kv-server-arg, which therefore still win. A suite's own variant (an emulated drive,
    a planted fault) is not user-facing; one a user names on the command line is.
    """
    if backend.variant is None:
        raise BackendConfigError(f"{backend.name} configures no KV connector to pass options to")
    variant = backend.variant(backend, options, suffix)
    if server_args:
        made = variant.configure

        def configure(ctx: LaunchContext) -> ServerSpec:
            spec = made(ctx)
            return dataclasses.replace(spec, args=list(spec.args) + list(server_args))

        variant = dataclasses.replace(variant, configure=configure)
    return dataclasses.replace(variant, name=f"{backend.name}[{suffix}]", user_facing=user_facing)


def options_variant(backend: Backend, options: dict, suffix: str,
                    configure_with: Callable[[LaunchContext, dict, str], ServerSpec]) -> Backend:
    """The variant a connector backend's module makes: its server configured with `options` (over those of
    the variant it is made from) and a store of its own (`suffix`)."""
    def configure(ctx: LaunchContext) -> ServerSpec:
        return configure_with(ctx, options, suffix)

    def again(base: Backend, more: dict, more_suffix: str) -> Backend:
        return options_variant(base, {**options, **more}, f"{suffix}-{more_suffix}", configure_with)

    return dataclasses.replace(backend, configure=configure, variant=again)


# B's suffix when --kv-ab compares a backend with itself (suite_machinery/ab.py).
SELF_SUFFIX = "~b"


def twin_name(name: str) -> str:
    """B's name when a backend is compared with itself: its own server and store, the same configuration."""
    return f"{name}{SELF_SUFFIX}"
