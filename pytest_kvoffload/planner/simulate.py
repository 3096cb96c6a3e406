"""Will offload pay on my traffic? An offline planner: a trace's prefix reuse through an engine cache and
CPU/disk tiers, priced with a measured (calibration.json) or first-order hardware profile. No server.

The cache model, stated so it can be checked against a replay (suites/test_plan_vs_replay.py):
- Blocks of `block_size` tokens; a block is shared by two requests exactly when the prompt tokens up to
  its end are (traces.build_prompt keeps a trace's prefix sharing, so that is its hash-id chain).
- Every cacheable block of every request (whole blocks leaving one token to compute) is written to the
  engine cache and to every tier, each an LRU of its own capacity (store on first sight, as vLLM's
  OffloadingConnector and kvoffload-disk do). So each cache's content depends only on the trace and its
  capacity, and one pass serves every configuration and every size of the capacity curve.
- A request takes the longest prefix of blocks in the engine cache; after that, the longest run of
  blocks each found in a tier (host before disk). It loads the part of that run that saves the most
  time (the admission rule, analysis.load_and_recompute's definition of "pays"), possibly nothing.
- TTFT is service time: recompute(N) - recompute(cached) + base, plus each used tier's fixed cost and
  bytes / bandwidth. Queueing is not modelled: compare it with a closed-loop replay at concurrency 1.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass

from pytest_kvoffload.core.costs import RecomputeFit
from pytest_kvoffload.core.first_order import prefill_seconds
from pytest_kvoffload.traces.prefix_trees import block_keys, leading
from pytest_kvoffload.traces.read import Scaling, TraceRequest
# The configuration without a tier, named as the backend it models (every gain is against it).
from pytest_kvoffload.serve.builtin.gpu_only import NAME as BASELINE

TIERS = ("host", "disk")  # lookup order: the faster tier first


class PlanError(ValueError):
    """A planner input that cannot be used; the message is one line naming the argument."""


# --- profiles -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tier:
    name: str
    bandwidth_bps: float  # math.inf: loads cost only their fixed part
    capacity_bytes: float
    fixed_s: float = 0.0  # per load: a device's latency, or (calibrated) a tier hit's whole fixed cost
    # Whether fixed_s holds the recompute fit's base `a`, as a calibration.json tier's fixed cost does (a
    # tier hit's fitted intercept); a hand-given latency (--tier ...:0.1ms) comes on top of it.
    includes_base: bool = False
    # A calibrated tier's admission margin (calibration.json): the connector takes a load only when it is
    # predicted to beat (1 - margin) of the recompute it replaces; the planner decides and prints the same.
    margin: float = 0.0

    def describe(self) -> str:
        bw = "unmeasurably fast" if math.isinf(self.bandwidth_bps) else f"{self.bandwidth_bps / 1e9:g} GB/s"
        return f"{self.name} {bw}, {self.capacity_bytes / 1e9:,.3g} GB, {self.fixed_s * 1e3:.3g} ms a load"


@dataclass(frozen=True)
class Profile:
    recompute: RecomputeFit
    kv_bytes_per_token: int
    engine_bytes: float
    tiers: dict[str, Tier]
    source: str  # where the figures come from, for the report
    # What an engine hit costs beyond computing its suffix (analysis/fits.py's hit_base_s); None: the fit's
    # base `a`, as for a cold prompt. A tier's fixed cost already holds it.
    hit_base_s: float | None = None

    def load_seconds(self, tokens_by_tier: dict[str, int]) -> float:
        total = 0.0
        for name, tokens in tokens_by_tier.items():
            if tokens:
                tier = self.tiers[name]
                total += self.tier_load_seconds(tier, tokens)
        return total

    def tier_load_seconds(self, tier: Tier, tokens: int) -> float:
        """What loading `tokens` from `tier` adds to a request's TTFT: never less than its transfer time.
        A calibrated fixed cost below the fit's base (noise in two fitted intercepts) counts as none."""
        transfer = 0.0 if math.isinf(tier.bandwidth_bps) else tokens * self.kv_bytes_per_token / tier.bandwidth_bps
        fixed = max(0.0, tier.fixed_s - self.recompute.a) if tier.includes_base else tier.fixed_s
        return fixed + transfer

    def ttft(self, prompt: int, cached: int, loaded: dict[str, int]) -> float:
        r = self.recompute
        engine_only = cached and not any(loaded.values()) and self.hit_base_s is not None
        return r(prompt) - r(cached) + (self.hit_base_s if engine_only else r.a) + self.load_seconds(loaded)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str, what: str) -> float:
    match = _QUANTITY.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise PlanError(f"{what} {text!r}: expected a size such as 256GiB, 1TB or 64GB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PlanError(f"{what} {text!r}: a capacity must be above zero")
    return value


def parse_bandwidth(text: str, what: str) -> float:
    if not text.lower().endswith("/s"):
        raise PlanError(f"{what} {text!r}: expected a bandwidth such as 6GB/s or 500MB/s")
    return parse_bytes(text[:-2], what)


def parse_seconds(text: str, what: str) -> float:
    match = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|us|s)\s*$", text)
    if not match:
        raise PlanError(f"{what} {text!r}: expected a latency such as 0.2ms, 50us or 0.001s")
    return float(match.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[match.group(2)]


def parse_tier(text: str) -> Tier:
    """NAME=BANDWIDTH:CAPACITY[:LATENCY], e.g. host=55GB/s:256GiB or disk=6GB/s:2TB:0.1ms; BANDWIDTH may be
    `cal` to take it (and the fixed cost) from --calibration."""
    usage = f"--tier {text!r}: expected NAME=BANDWIDTH:CAPACITY[:LATENCY] with NAME host or disk, e.g. disk=6GB/s:1TB"
    name, _, spec = text.partition("=")
    parts = spec.split(":")
    if name not in TIERS or len(parts) not in (2, 3):
        raise PlanError(usage)
    bandwidth = math.nan if parts[0] == "cal" else parse_bandwidth(parts[0], f"--tier {name}")
    capacity = parse_bytes(parts[1], f"--tier {name} capacity")
    fixed = parse_seconds(parts[2], f"--tier {name} latency") if len(parts) == 3 else 0.0
    return Tier(name, bandwidth, capacity, fixed)


def parse_engine(text: str, kv_bytes_per_token: int) -> float:
    """The engine's KV capacity: a size (40GiB) or a token count (200000 or 200000tok)."""
    digits = text[:-3] if text.lower().endswith("tok") else text
    if digits.strip().isdigit():
        tokens = int(digits)
        if tokens <= 0:
            raise PlanError(f"--engine-kv {text!r}: a capacity must be above zero")
        return float(tokens * kv_bytes_per_token)
    return parse_bytes(text, "--engine-kv")


def first_order_profile(model, peak_tflops: float, mfu: float, tiers: list[Tier], engine_bytes: float,
                        kv_bytes_per_token: int) -> Profile:
    """The first-order model (prefill FLOPs over peak times MFU): t(n) = (2 P n + layers 2 n^2 q_heads head_dim) / (peak x MFU), no fixed costs."""
    if peak_tflops <= 0 or not 0 < mfu <= 1:
        raise PlanError(f"--peak-tflops {peak_tflops:g} / --mfu {mfu:g}: expected a peak above 0 and an MFU in (0, 1]")
    if any(math.isnan(t.bandwidth_bps) for t in tiers):
        raise PlanError("--tier ...=cal: a calibrated bandwidth needs --calibration")
    flops = peak_tflops * 1e12 * mfu
    params = model.parameter_count()
    b = prefill_seconds(params, model.num_layers, model.num_q_heads, model.head_dim, 1, flops) - \
        prefill_seconds(0, model.num_layers, model.num_q_heads, model.head_dim, 1, flops)
    c = prefill_seconds(0, model.num_layers, model.num_q_heads, model.head_dim, 1, flops)
    return Profile(RecomputeFit(0.0, b, c), kv_bytes_per_token, engine_bytes, {t.name: t for t in tiers},
                   f"first-order: {peak_tflops:g} TFLOP/s x {mfu:g} MFU, no fixed costs")


def calibration_profile(calibration: dict, tiers: list[Tier], engine_bytes: float) -> Profile:
    """Measured figures: the recompute fit and, per tier source, the bandwidth and fixed cost of a run's
    calibration.json. Capacities come from --tier (NAME=cal:CAPACITY)."""
    measured = {entry["source"]: entry for entry in calibration["tiers"].values() if entry.get("source") in TIERS}
    if not measured:
        raise PlanError("--calibration: the file has no host or disk tier; run the sweep with a tier backend")
    recompute = RecomputeFit(**next(iter(measured.values()))["recompute"])
    chosen = {}
    for tier in tiers:
        if not math.isnan(tier.bandwidth_bps):
            chosen[tier.name] = tier
            continue
        if tier.name not in measured:
            raise PlanError(f"--tier {tier.name}=cal: the calibration measured only {', '.join(sorted(measured))}")
        entry = measured[tier.name]
        bandwidth = entry["bandwidth_gbps"] * 1e9 if entry.get("bandwidth_gbps") else math.inf
        chosen[tier.name] = Tier(tier.name, bandwidth, tier.capacity_bytes, max(0.0, entry["fixed_s"]), includes_base=True,
                                 margin=float(entry.get("margin") or 0.0))
    kv = int(calibration["fingerprint"]["kv_bytes_per_token"])
    return Profile(recompute, kv, engine_bytes, chosen,
                   f"measured: {calibration['fingerprint'].get('model')} on {calibration['fingerprint'].get('device')}")


# --- blocks -----------------------------------------------------------------------------------------

class LRU:
    """Block keys under a capacity in blocks; `touch` marks the most recent use, evicting the least."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def touch(self, keys: list[int]) -> None:
        store = self.keys
        for key in keys:
            if key in store:
                store.move_to_end(key)
            else:
                store[key] = None
        while len(store) > self.capacity:
            store.popitem(last=False)


# --- simulation -------------------------------------------------------------------------------------

@dataclass
class Served:
    """One request under one configuration."""

    prompt: int
    engine: int  # tokens from the engine cache
    found: dict[str, int]  # tier tokens found after the engine prefix
    loaded: dict[str, int]  # of those, tokens the admission rule loaded
    ttft_s: float
    shared: int  # tokens of the prompt some earlier request had (any capacity): the reusable prefix


@dataclass
class Sizes:
    """Capacities in blocks of the engine and each configured tier."""

    engine: int
    tiers: dict[str, int]


def configurations(profile: Profile) -> list[tuple[str, tuple[str, ...]]]:
    names = [t for t in TIERS if t in profile.tiers]
    configs = [(BASELINE, ())] + [(f"+{t}", (t,)) for t in names]
    if len(names) == 2:
        configs.append(("+host+disk", tuple(names)))
    return configs


def choose_load(profile: Profile, prompt: int, engine: int, run: list[str], block_size: int,
                admission: bool) -> dict[str, int]:
    """Tokens to load from each tier: the prefix of the tier run (one tier name per block) that saves the
    most against recomputing it, or the whole run without admission."""
    best_k, best_gain = (len(run), None) if not admission else (0, 0.0)
    if admission:
        counts = dict.fromkeys(TIERS, 0)
        for k, tier in enumerate(run, start=1):
            counts[tier] += block_size
            cost = profile.load_seconds(counts)
            keep = 1.0 - max(profile.tiers[t].margin for t, n in counts.items() if n)
            gain = keep * (profile.recompute(engine + k * block_size) - profile.recompute(engine)) - cost
            if gain > best_gain:
                best_k, best_gain = k, gain
    loaded = dict.fromkeys(TIERS, 0)
    for tier in run[:best_k]:
        loaded[tier] += block_size
    return {t: n for t, n in loaded.items() if n}


def serve(profile: Profile, prompt: int, keys: list[int], engine: LRU, tiers: dict[str, LRU],
          block_size: int, admission: bool, shared: int) -> Served:
    hit = leading(keys, engine)
    run = []
    for key in keys[hit:]:
        tier = next((name for name in TIERS if name in tiers and key in tiers[name]), None)
        if tier is None:
            break
        run.append(tier)
    found = {t: run.count(t) * block_size for t in TIERS if t in run}
    loaded = choose_load(profile, prompt, hit * block_size, run, block_size, admission)
    cached = hit * block_size + sum(loaded.values())
    return Served(prompt, hit * block_size, found, loaded, profile.ttft(prompt, cached, loaded), shared)


def capacity_in_blocks(capacity_bytes: float, profile: Profile, block_size: int) -> int:
    return int(capacity_bytes // (block_size * profile.kv_bytes_per_token))


def simulate(requests: list[TraceRequest], fmt: str, scaling: Scaling, profile: Profile, block_size: int,
             admission: bool = True, curve_points: int = 0, warm: bool = False) -> dict:
    """Every configuration (and, with curve_points, each tier alone at that many sizes) in one pass.
    `warm`: after a warming pass of the same requests that left them in the tiers and not in the engine
    (the trace replay's, suite_machinery/trace_replay.py:warm_pass)."""
    sizes = Sizes(capacity_in_blocks(profile.engine_bytes, profile, block_size),
                  {name: capacity_in_blocks(t.capacity_bytes, profile, block_size) for name, t in profile.tiers.items()})
    if sizes.engine < 1:
        raise PlanError("--engine-kv: holds less than one block; give a larger capacity")
    for name, blocks in sizes.tiers.items():
        if blocks < 1:
            raise PlanError(f"--tier {name}: its capacity holds less than one block of {block_size} tokens")
    engine = LRU(sizes.engine)
    tiers = {name: LRU(blocks) for name, blocks in sizes.tiers.items()}
    seen: set[int] = set()
    curve = {name: [LRU(max(1, round(blocks * f))) for f in curve_fractions(curve_points)]
             for name, blocks in sizes.tiers.items()} if curve_points else {}
    configs = configurations(profile)
    served: dict[str, list[Served]] = {name: [] for name, _ in configs}
    curve_served: dict[str, list[list[Served]]] = {name: [[] for _ in lrus] for name, lrus in curve.items()}
    keyed = [block_keys(request, fmt, scaling, block_size) for request in requests]
    if warm:
        for _, keys in keyed:
            for lru in [*tiers.values(), *(lru for lrus in curve.values() for lru in lrus)]:
                lru.touch(keys)
            seen.update(keys)
    for prompt, keys in keyed:
        shared = leading(keys, seen) * block_size
        for name, used in configs:
            served[name].append(serve(profile, prompt, keys, engine, {t: tiers[t] for t in used}, block_size,
                                      admission, shared))
        for name, lrus in curve.items():
            for i, lru in enumerate(lrus):
                curve_served[name][i].append(serve(profile, prompt, keys, engine, {name: lru}, block_size,
                                                   admission, shared))
                lru.touch(keys)
        engine.touch(keys)
        for lru in tiers.values():
            lru.touch(keys)
        seen.update(keys)
    return {"configs": served, "curve": curve_served, "sizes": sizes, "curve_fractions": curve_fractions(curve_points)}


def curve_fractions(points: int) -> list[float]:
    """Tier sizes of the capacity curve as fractions of the configured size: 1/4^k up to 1, then 4x."""
    if not points:
        return []
    return [4.0 ** -k for k in range(points - 2, -1, -1)] + [4.0]


# --- slices -----------------------------------------------------------------------------------------

# --- summaries --------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def summarize(served: list[Served], baseline: list[Served]) -> dict:
    """Hit ratios by source (requests and tokens), the tier hits that paid, and TTFT against gpu-only."""
    prompt_tokens = sum(s.prompt for s in served) or 1
    n = len(served) or 1
    found = [s for s in served if s.found]
    summary = {
        "requests": len(served),
        "engine_requests": sum(1 for s in served if s.engine) / n,
        "engine_tokens": sum(s.engine for s in served) / prompt_tokens,
        "tier_requests": {t: sum(1 for s in served if s.loaded.get(t)) / n for t in TIERS},
        "tier_tokens": {t: sum(s.loaded.get(t, 0) for s in served) / prompt_tokens for t in TIERS},
        "found_requests": len(found) / n,
        "paying_share": (sum(1 for s in found if s.loaded) / len(found)) if found else math.nan,
        "ttft": {q: percentile([s.ttft_s for s in served], q) for q in (50, 90, 99)},
        "mean_ttft": sum(s.ttft_s for s in served) / n,
    }
    base_mean = sum(s.ttft_s for s in baseline) / (len(baseline) or 1)
    summary["vs_gpu_only"] = summary["mean_ttft"] / base_mean if base_mean else math.nan
    return summary


def break_even_prefix_tokens(profile: Profile, tier: str) -> float:
    from pytest_kvoffload.core.costs import TierFit, break_even_prefix
    t = profile.tiers[tier]
    # A tier hit's whole fixed cost: calibration.json's holds the base every request pays; a hand-given
    # latency comes on top of it (the first-order profile's base is 0).
    fit = TierFit(t.bandwidth_bps, t.fixed_s if t.includes_base else profile.recompute.a + t.fixed_s, 0)
    # With a calibrated margin, the prefix the connector's rule enforces (calibration.json's enforced one).
    return break_even_prefix(fit, profile.recompute, profile.kv_bytes_per_token, t.margin)


def above_break_even(served: list[Served], p_star: float) -> dict:
    """Requests, and their prompt tokens, whose reusable prefix is at least the break-even prefix."""
    above = [s for s in served if s.shared >= p_star]
    total = sum(s.prompt for s in served) or 1
    return {"requests": len(above) / (len(served) or 1), "tokens": sum(s.prompt for s in above) / total}
