"""The admission suite's measurements: the emulated drive, the frontier cells, the control and the guarded rule.

1. The drive: the unthrottled kvoffload-disk server's grid (two rounds, kept out of the run's cells) fits the
   recompute curve and the tier's own costs; slow_drive.frontier_drive adds the per-load latency that puts the
   break-even at half the longest length (slow_drive.py says why latency and not bandwidth). Where that fit
   refuses the machine, more rounds are measured before the refusal stands (measured_or_refused).
2. Calibration: the control server (every load taken) runs frontier cells around that target; its hit/cold
   ratios, interpolated, give the measured p*, and its fits the calibration the rule reads, with the queue
   overlap from its probes behind a queue.
3. Judged: the frontier re-placed around the measured p* (0.5 to 2 p*), the control and the guarded server
   (the rule under test) interleaved round by round, every decision judged (judge.py); then probes behind a
   queue on both servers, judged the same way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from pytest_kvoffload.suite_machinery.admission import judge
from pytest_kvoffload.suite_machinery.admission.queue_probe import burst_table, measured_overlap
from pytest_kvoffload.suite_machinery.admission.queue_cells import judge_queue, queue_bursts
from pytest_kvoffload.suite_machinery.admission import counterfactual
from pytest_kvoffload.suite_machinery.admission.derived_drive import (FRONTIER, FRONTIER_FAR, SlowDrive, SlowDriveError,  # noqa: F401
                                                   design_target, frontier_drive, frontier_prefixes,
                                                   interpolated_break_even, planted_break_even, ratio,
                                                   seconds_per_token, step_tokens, telling_multiples)
from pytest_kvoffload.core.calibration import build_calibration, write_calibration
from pytest_kvoffload.core.costs import RecomputeFit, TierFit
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.measure.context import Recorder, Servers
from pytest_kvoffload.measure.runner import CellRunner
from pytest_kvoffload.analysis.fits import analyse
from pytest_kvoffload.serve.backend import Backend, with_connector_options
from pytest_kvoffload.serve.server import settle

# Paired rounds per frontier cell in the judged phase, and of the probes behind a queue: five is the fewest
# for which two wrong rounds are more than noise at a few percent explains (judge.Noise.allowed).
JUDGED_ROUNDS = 5
CALIBRATION_ROUNDS = 2
# Probe rounds added before a machine is refused. A cell's figure is its rounds' median, so one disturbed
# round of two can flatten the fitted curve (docs/notes/2026-12-04-verdicts-and-report.md).
MORE_PROBE_ROUNDS = 3
# The queue cell: below p*, where a rule crediting the queue wrongly would admit (above p* every rule
# worth judging admits, and the frontier judges that already).
QUEUE_MULTIPLES = (0.6,)
# The finest KV block vLLM's CPU attention takes (admission_block).
FINE_BLOCK = 32


@dataclass
class Round:
    hit_s: float
    cold_s: float
    tier_tokens: int
    admitted: bool
    declined: bool

    @property
    def ratio(self) -> float:
        return self.hit_s / self.cold_s


@dataclass
class Frontier:
    """One server's rounds per prefix (prompts of prefix + 1 tokens, all shared), and failed verifications."""
    backend: str
    cells: dict[int, list[Round]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def median_ratios(self) -> dict[int, float]:
        return {p: float(np.median([r.ratio for r in rs])) for p, rs in self.cells.items() if rs}


def measure_round(recorder: Recorder, backend: Backend, endpoint, prefix: int, r: int, frontier: Frontier) -> None:
    """A cold request and a tier-only hit of one (prefix + 1)-token prompt: the cold request is the hit's prime
    (the prompt is all prefix), so each round pays one prefill, not two, and the pair shares its tokens."""
    # Every round's hit output is compared with its cold twin's (no extra prefill): a rule that loads wrong
    # KV must fail here, whatever its timing.
    runner = CellRunner(recorder, backend, endpoint, Cell(prefix + 1, 1.0, State.TIER_HIT), r, "measure",
                        cold_prime=True)
    hit, cold = runner.run(1), runner.colds
    frontier.failures += [f"{c.cell.id}: {f}" for c in (cold, hit) for f in c.failures]
    result = hit.results[0]
    frontier.cells.setdefault(prefix, []).append(Round(
        hit_s=result.client_ttft_s, cold_s=cold.results[0].client_ttft_s,
        tier_tokens=result.cached_by_source.get(backend.tier or "", 0),
        admitted=bool(result.connector.get("kvoffload:loads_admitted_total")),
        declined=bool(result.connector.get("kvoffload:loads_declined_total"))))


def admission_block(settings) -> int:
    """The admission servers' KV block: the frontier's unit. vLLM's CPU attention takes any multiple of 32
    tokens (vllm/v1/attention/backends/cpu_attn.py), so 32 where the session's blocks are larger: 128-token
    units put no cell between 0.9 and 1.25 p* with p* near 700 tokens (docs/admission.md)."""
    return min(FINE_BLOCK, settings.block_size)


def block_variant(backend: Backend, suffix: str, block: int, **options) -> Backend:
    """A variant with KV blocks of `block` tokens, writing one block a chunk file. The connector matches
    block by block at any chunk size, but a prefix ending inside a larger file reads that file whole: with
    one block a file, every frontier prefix reads exactly its own bytes."""
    variant = with_connector_options(backend, suffix, chunk_tokens=block, **options)
    return dataclasses.replace(variant, block_size=block)


def grid_figures(r: Round) -> tuple[bool, float, float]:
    return r.admitted, r.ratio, r.cold_s


@dataclass
class AdmissionRun:
    drive: SlowDrive
    probe: Frontier
    step_tokens: int
    design_p_star: int
    measured_p_star: float
    calibration: dict
    calibration_pass: Frontier
    control: Frontier
    guarded: Frontier
    multiples: dict[int, float]
    verdicts: list[judge.CellVerdict]
    control_bursts: dict
    bursts: dict
    queue_verdicts: list[judge.CellVerdict]
    mode: str
    noise: judge.Noise
    too_noisy: str | None = None

    @property
    def failures(self) -> list[str]:
        return self.probe.failures + self.calibration_pass.failures + self.control.failures + self.guarded.failures

    @property
    def tier(self) -> dict:
        return next(iter(self.calibration["tiers"].values()))


def probe_drive(recorder: Recorder, servers: Servers, backend: Backend,
                cap: float) -> tuple[SlowDrive, int, Frontier]:
    """The unthrottled server's grid, fitted, and the drive that puts the break-even at the design target; the
    probe's rounds carry its failed verifications."""
    settings = recorder.settings
    # The first server's start decides the grid's lengths from its prefill speed (measure/grid_lengths.py):
    # read them after it, or a slow CPU's admission frontier runs at lengths the grid left out.
    endpoint = servers.endpoint(backend)
    lengths, kv_bytes = recorder.lengths(), settings.kv_bytes_per_token
    recorder.progress(f"admission: measuring {backend.name} unthrottled to choose the emulated drive")
    probe = Frontier(backend.name)
    target = design_target(lengths, settings.block_size)

    def measure(first: int, end: int) -> None:
        for r in range(first, end):
            for length in lengths:  # the cold request is the hit's prime (measure_round)
                runner = CellRunner(recorder, backend, endpoint, Cell(length, 1.0, State.TIER_HIT), r, "drive-probe",
                                    False, cold_prime=True)
                probe.failures += runner.run(1).failures + runner.colds.failures

    def fit() -> SlowDrive:
        entry = analyse(recorder.cells(backend.name, purpose="drive-probe"), kv_bytes,
                        {backend.name: backend.tier})[backend.name]
        tier = entry.get("tier") or {}
        return frontier_drive(target, RecomputeFit(**entry["recompute"]), tier.get("fixed_s", 0.0),
                              seconds_per_token(tier.get("bandwidth_gbps"), kv_bytes), cap)

    # A curve needs three points: two rounds of two lengths.
    drive = measured_or_refused(measure, fit, 2 if len(lengths) < 3 else 1, recorder.progress)
    recorder.progress(f"admission: {drive.describe()}")
    return drive, target, probe


def measured_or_refused(measure, fit, rounds: int, progress) -> SlowDrive:
    """The drive fitted from `rounds` probe rounds (measure(first, end) runs them), or, where that fit refuses
    the machine, from MORE_PROBE_ROUNDS more: the refusal is a claim about the machine, made from medians
    one outlier cannot move."""
    measure(0, rounds)
    try:
        return fit()
    except SlowDriveError as exc:
        progress(f"admission: {exc}; measuring {MORE_PROBE_ROUNDS} more probe rounds before refusing this machine")
    measure(rounds, rounds + MORE_PROBE_ROUNDS)
    return fit()


def calibrate(recorder: Recorder, servers: Servers, slow: Backend, target: int, step: int,
              tier_name: str) -> tuple[Frontier, float, dict, dict]:
    """The control's calibration pass: its frontier around the target, the measured p*, the calibration."""
    settings = recorder.settings
    block = slow.kv_block(settings)
    endpoint = servers.endpoint(slow)
    placed = frontier_prefixes(target, block, FRONTIER)
    recorder.progress(f"admission: calibration pass on {slow.name} at {', '.join(map(str, placed))} tokens")
    frontier = Frontier(slow.name)
    for r in range(CALIBRATION_ROUNDS):
        for prefix in placed:
            measure_round(recorder, slow, endpoint, prefix, r, frontier)
    measured = interpolated_break_even(frontier.median_ratios())
    if measured is None:
        raise SlowDriveError(f"the control's hit/cold ratios never cross 1 around {target:,} tokens "
                             f"({frontier.median_ratios()}): no break-even to place the frontier on")
    queue_cells = sorted(frontier_prefixes(measured, block, QUEUE_MULTIPLES))
    control_bursts = {}
    queue_bursts(recorder, slow, endpoint, [(p + 1, 1.0) for p in queue_cells], range(JUDGED_ROUNDS), step,
                 control_bursts)
    analysis = analyse(recorder.cells(slow.name), settings.kv_bytes_per_token, {slow.name: tier_name})
    calibration = build_calibration(analysis, settings, recorder.environment())
    tier = calibration["tiers"][slow.name]
    tier["queue_overlap"] = measured_overlap(control_bursts, tier, settings.kv_bytes_per_token, step)
    return frontier, measured, calibration, control_bursts


def too_noisy(tier: dict, kv_bytes: int) -> str | None:
    """Whether the rule's margin makes it as conservative as the planted static:scale=1.5 (then the suite
    cannot tell the real rule from that near miss and says so). An unresolved bandwidth (loads too small
    to time their transfer) is decided too: the loads then cost their fixed part, which the 1.5x rule scales."""
    enforced = tier.get("enforced_break_even_prefix_tokens")
    if enforced is None:
        return None
    bandwidth = tier.get("bandwidth_gbps")
    fit = TierFit(bandwidth * 1e9 if bandwidth else math.inf, tier["fixed_s"], 0)
    planted = planted_break_even(fit, RecomputeFit(**tier["recompute"]), kv_bytes, 1.5)
    if enforced >= planted:
        return (f"the calibrated margin ({tier.get('margin', 0):.0%}) makes the rule take loads from {enforced:,.0f} "
                f"tokens, as late as a rule wrong by 1.5x ({planted:,.0f}): this machine is too noisy to tell them apart")
    return None


def run_admission(recorder: Recorder, servers: Servers, backend: Backend, mode: str, rounds: int) -> AdmissionRun:
    """Drive, calibration, judged frontier and queue (the module's doc)."""
    # The unthrottled server, the control and the guarded one up together: the first is reused by later
    # suites, and stopping it to make room would cost a start-up.
    servers.room(3)
    try:
        return judged_run(recorder, servers, backend, mode, rounds)
    finally:
        servers.room(None)


def judged_run(recorder: Recorder, servers: Servers, backend: Backend, mode: str, rounds: int) -> AdmissionRun:
    settings = recorder.settings
    block, kv_bytes = admission_block(settings), settings.kv_bytes_per_token
    drive, target, probe = probe_drive(recorder, servers, backend, judge.CAP)
    step = step_tokens(recorder.lengths(), block)
    budget = ("--max-num-batched-tokens", str(step))
    slow = block_variant(backend, "slow", block, server_args=budget, admission="always", **drive.options())
    calibration_pass, measured, calibration, control_bursts = calibrate(recorder, servers, slow, target, step,
                                                                        backend.tier)
    calibration["tiers"] = {backend.name: calibration["tiers"].pop(slow.name)}
    calibration["connector_tier"] = backend.name
    calibration["fingerprint"]["block_size"] = block  # the servers that measured it and read it (admission_block)
    path = recorder.run_dir() / "admission-calibration.json"
    write_calibration(path, calibration)
    guarded_backend = block_variant(backend, "admission", block, server_args=budget, calibration=str(path),
                                    admission=mode, **drive.options())
    tier = calibration["tiers"][backend.name]
    near = telling_multiples(measured, RecomputeFit(**tier["recompute"]), tier["fixed_s"],
                             seconds_per_token(tier.get("bandwidth_gbps"), kv_bytes), tier.get("margin") or 0.0,
                             judge.CAP, counterfactual.NEAR_MISS_SCALES)
    multiples = {p: p / measured for p in frontier_prefixes(measured, block, FRONTIER_FAR + near)}
    control, guarded = Frontier(slow.name), Frontier(guarded_backend.name)
    endpoints = (servers.endpoint(slow), servers.endpoint(guarded_backend))
    n = max(JUDGED_ROUNDS, rounds)
    recorder.progress(f"admission: {slow.name} and {guarded_backend.name} (rule {mode}) interleaved, {n} rounds "
                      f"of {', '.join(map(str, multiples))} tokens (measured p* {measured:,.0f})")
    # The guarded server has just started and warmed up (its saves may still be writing): its first round too
    # begins with both servers quiet (a control cold round beside a save ran five times slower).
    settle(endpoints)
    pair = ((slow, endpoints[0], control), (guarded_backend, endpoints[1], guarded))
    interleave(recorder, pair, list(multiples), 0, n, "admission frontier")
    so_far = SimpleNamespace(tier=tier, multiples=multiples, control=control, mode=mode)
    if added := counterfactual.telling_cells(so_far, kv_bytes, block):  # where a near miss would part (its doc)
        recorder.progress(f"admission: no cell tells a near miss apart; {n} rounds at {', '.join(map(str, added))} tokens")
        interleave(recorder, pair, added, 0, n, "admission, near-miss cells")
        multiples = dict(sorted({**multiples, **{p: p / measured for p in added}}.items()))

    def measure_more(prefixes: list[int], more: int) -> dict[int, list[judge.Decision]]:
        recorder.progress(f"admission: {len(prefixes)} cell(s) undecided ({', '.join(map(str, prefixes))} tokens); "
                          f"{more} more interleaved rounds of them")
        interleave(recorder, pair, prefixes, n, more, "admission, undecided cells")
        return judge.decisions(control.cells, guarded.cells, grid_figures)
    margin = calibration["tiers"][backend.name].get("margin", 0.0)
    verdicts, noise = judge.until_decided(judge.decisions(control.cells, guarded.cells, grid_figures), multiples, margin,
                                          measure_more)
    bursts = {}
    queue_bursts(recorder, guarded_backend, endpoints[1], list(control_bursts), range(JUDGED_ROUNDS), step, bursts)
    queue = judge_queue(recorder, pair, control_bursts, bursts, step, measured, margin, noise, mode, JUDGED_ROUNDS)
    servers.release(guarded_backend.name)
    servers.release(slow.name)
    run = AdmissionRun(drive, probe, step, target, measured, calibration, calibration_pass, control, guarded, multiples,
                       verdicts, control_bursts, bursts, queue, mode, noise,
                       too_noisy(calibration["tiers"][backend.name], kv_bytes))
    recorder.add_benchmark("admission", summary(run), benchmark_data(run))
    return run


def interleave(recorder: Recorder, pair: tuple, prefixes: list[int], first: int, rounds: int, label: str) -> None:
    """`rounds` rounds of each prefix on the control and the guarded server, (backend, endpoint, Frontier)
    each, the server that goes first alternating, so a round's second server is the next round's first: one
    switch a round, each once both servers are quiet (serve/server.settle), since a vLLM worker busy-polls
    for a second after its last request on the core the other server computes on (a control cold of 257
    tokens took 508 and 892 ms instead of 40 right after a switch)."""
    tracker = Tracker(recorder.progress, label, rounds, "rounds")
    last = None
    for r in range(first, first + rounds):
        for b, e, f in (pair if r % 2 == 0 else pair[::-1]):
            if last is not None and last != b.name:
                settle([x[1] for x in pair])
            last = b.name
            for prefix in prefixes:
                measure_round(recorder, b, e, prefix, CALIBRATION_ROUNDS + r, f)
        tracker.step(f"round {r + 1}")
    if last != pair[1][0].name:
        settle([x[1] for x in pair])


def frontier_table(run: AdmissionRun) -> str:
    tier = run.tier
    recompute = RecomputeFit(**tier["recompute"])
    spt = seconds_per_token(tier.get("bandwidth_gbps"), run.calibration["fingerprint"]["kv_bytes_per_token"])
    rows = ["prefix  x p*   predicted  control  guarded  admitted  wrong  noise allows  detects from"]
    for v in run.verdicts:
        predicted = ratio(v.prefix, recompute, tier["fixed_s"], spt)
        control = np.median([d.control_ratio for d in v.decisions]) if v.decisions else math.nan
        guarded = np.median([d.guarded_ratio for d in v.decisions]) if v.decisions else math.nan
        rows.append(f"{v.prefix:<7,} {v.multiple:<6.2f} {predicted:<10.2f} {control:<8.2f} {guarded:<8.2f} "
                    f"{v.admitted}/{len(v.decisions):<7} {v.wrong:<6} {v.allowed:<13} {v.detectable:.0%}")
    return "\n".join(rows)


def summary(run: AdmissionRun) -> str:
    tier = run.tier
    wrong = judge.failures(run.verdicts)
    queue_wrong = judge.failures(run.queue_verdicts)
    unsure = judge.undecided(run.verdicts + run.queue_verdicts)
    lines = [
        run.drive.describe(),
        f"break-even prefix p*: designed {run.design_p_star:,}, interpolated from the control's hit/cold ratios "
        f"{run.measured_p_star:,.0f}; the calibration's {tier.get('break_even_prefix_tokens') or 0:,.0f} (hits pay "
        f"from), the rule enforces {tier.get('enforced_break_even_prefix_tokens') or 0:,.0f} (margin "
        f"{tier.get('margin', 0):.0%}, queue overlap {tier.get('queue_overlap') or 0:.2f})",
        f"frontier (rule {run.mode}, {judge.LOOKS[0]:.0%} confidence, {judge.LOOKS[1]:.0%} at a second look, cap "
        f"{judge.CAP:.0%}; ratios are hit/cold "
        "medians; wrong: admitted and slower than the cap, or declined where the control's load paid by more "
        "than margin + cap):",
        frontier_table(run),
        noise_line(run.noise),
        f"wrong decisions beyond noise: {len(wrong)} cells" + (": " + "; ".join(wrong) if wrong else ""),
        f"undecided after a second look (not a pass): {len(unsure)} cells"
        + (": " + "; ".join(unsure) if unsure else ""),
        "behind a queue (control, then guarded):",
        burst_table(run.bursts) if run.bursts else "(no probes)",
        f"queue decisions judged in {len(run.queue_verdicts)} cells, wrong beyond noise in {len(queue_wrong)}"
        + (": " + "; ".join(queue_wrong) if queue_wrong else ""),
    ]
    if run.too_noisy:
        lines.append(f"FAILS: {run.too_noisy}")
    return "\n".join(lines)


def noise_line(noise: judge.Noise) -> str:
    return (f"noise, over {noise.rounds} rounds (Laplace estimates): {noise.up:.1%} lie above their cell's median "
            f"by more than the cap (an admitted round looks wrong), {noise.down:.1%} below it by more than a "
            f"decline's threshold; spread {noise.sigma:.1%} (log sd); a cell fails beyond the wrong rounds that "
            f"explains at {judge.LOOKS[0]:.0%}, and is undecided where that leaves it blind to a miss of "
            f"twice the cap (read from the same strays); an undecided cell is measured again and judged at "
            f"{judge.LOOKS[1]:.0%} on all its rounds")


def benchmark_data(run: AdmissionRun) -> dict:
    def cells(verdicts):
        return [{"prefix": v.prefix, "multiple": round(v.multiple, 3), "rounds": len(v.decisions),
                 "admitted": v.admitted, "wrong": v.wrong, "noise_allows": v.allowed, "outcome": v.outcome,
                 "looks": v.looks,
                 "detectable_slowdown": v.detectable if math.isfinite(v.detectable) else None,
                 "decisions": [dataclasses.asdict(d) for d in v.decisions]} for v in verdicts]
    return {"drive": {**run.drive.options(), "target_p_star": run.design_p_star, "early_cost": run.drive.early_cost,
                      "late_cost": run.drive.late_cost},
            "mode": run.mode, "measured_p_star": run.measured_p_star, "calibration": run.calibration,
            "frontier": cells(run.verdicts), "queue": cells(run.queue_verdicts), "too_noisy": run.too_noisy,
            "noise": dataclasses.asdict(run.noise)}
