"""Checking an admission rule against measurement: paired rounds, their verdicts, and both controls.

A cell's verdict comes from its rounds, each a tier hit and a cold request of the same length taken side
by side (paired, so the engine's drift between rounds cancels), as the ratio hit / cold (paired.verdict:
slower, paid, or no difference at 95%, with a hard 10% cap).

The suite's controls then say what a broken rule would show. The control grid (admission off, every
load taken) must contain slower cells, or the no-slower check has no teeth against a rule that admits
everything; and cells that paid, or the missed-gain check has no teeth against a rule that declines
everything. The guarded grid must have no slower cell and must not decline the cells that paid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pytest_kvoffload.record.analysis import analyse

from pytest_kvoffload.core.costs import RecomputeFit
from pytest_kvoffload.serve.backends import Backend, with_connector_options
from pytest_kvoffload.admission.queue_probe import burst_table, measured_overlap, run_bursts
from pytest_kvoffload.core.calibration import build_calibration, write_calibration
from pytest_kvoffload.measure.cells import Cell, State
from pytest_kvoffload.measure.runner import CellRunner
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.measure.context import Recorder, Servers
from pytest_kvoffload.measure.paired import CONFIDENCE, FLOOR, median_bound, verdict
from pytest_kvoffload.measure.prompts import expected_cached, prefix_length
from pytest_kvoffload.record.report import break_even_lines
from pytest_kvoffload.admission.slow_drive import SlowDrive, SlowDriveError, loadable_prefixes, slow_drive, step_tokens  # noqa: F401 (the suite catches SlowDriveError)

# Control runs at most: the first with the drive derived from the unthrottled probe, then one from its own cells.
CONTROL_ATTEMPTS = 2
# Paired rounds a guarded cell that looks slower may grow to before it is judged as it stands.
MAX_ROUNDS = 9


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
class Grid:
    """One server's paired rounds per (length, fraction), and the rounds that failed verification."""

    backend: str
    cells: dict[tuple[int, float], list[Round]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def admitted_cells(self) -> list[tuple[int, float]]:
        return sorted(k for k, rounds in self.cells.items() if _mostly(r.admitted for r in rounds))

    def declined_cells(self) -> list[tuple[int, float]]:
        return sorted(k for k, rounds in self.cells.items() if _mostly(r.declined for r in rounds))


def _mostly(flags) -> bool:
    flags = list(flags)
    return bool(flags) and sum(flags) * 2 > len(flags)


def _describe(key, rounds: list[Round]) -> str:
    length, fraction = key
    ratios = [r.ratio for r in rounds]
    low, high = median_bound(ratios, upper=False), median_bound(ratios, upper=True)
    bounds = f", {CONFIDENCE:.0%} bounds {low:.2f} to {high:.2f}" if low is not None else ""
    return (f"{length} tokens, {fraction:g} cached: tier hit {np.median([r.hit_s for r in rounds]) * 1e3:.0f} ms "
            f"vs cold {np.median([r.cold_s for r in rounds]) * 1e3:.0f} ms (median ratio {np.median(ratios):.2f}"
            f"{bounds}, {len(rounds)} rounds)")


def slower_hits(grid: Grid) -> list[str]:
    """Cells whose tier hits were slower than recomputing (see the module's doc for the statistic)."""
    return [_describe(k, rounds) for k, rounds in sorted(grid.cells.items())
            if verdict([r.ratio for r in rounds]) == "slower"]


def paid_cells(grid: Grid) -> list[tuple[int, float]]:
    return sorted(k for k, rounds in grid.cells.items() if verdict([r.ratio for r in rounds]) == "paid")


def missed_gains(control: Grid, guarded: Grid) -> list[str]:
    """Cells where loading paid with every load taken, yet the rule declined most of their loads."""
    out = []
    for key in paid_cells(control):
        rounds = guarded.cells.get(key, [])
        declined = sum(r.declined for r in rounds)
        if rounds and declined * 2 > len(rounds):
            out.append(f"{_describe(key, control.cells[key])} with every load taken, yet the rule declined "
                       f"{declined} of {len(rounds)} loads")
    return out


def run_grid(recorder: Recorder, backend: Backend, endpoint, lengths, fractions, rounds: int, purpose: str = "measure",
             first_round: int = 0) -> Grid:
    """Cold, engine-hit and tier-hit rounds interleaved per length, so each hit has a cold request beside it.

    Engine hits of the same cells let a calibration fit the tier by pairs (record/analysis.py). Cells whose shared
    prefix is shorter than one stored chunk load nothing, so leave the rule nothing to decide: left out.
    """
    settings = recorder.settings
    granularity = backend.granularity(settings)
    grid = Grid(backend.name)
    # A round's cost grows with its length: the time left is estimated from tokens done.
    tracker = Tracker(recorder.progress, f"{purpose} grid on {backend.name}", len(lengths) * rounds,
                      "lengths x rounds", total_work=sum(lengths) * rounds)
    for length in lengths:
        for r in range(first_round, first_round + rounds):
            check = r == 0  # outputs compared with a recompute once per cell
            cold = CellRunner(recorder, backend, endpoint, Cell(length, 0.0, State.COLD), r, purpose, check).run(1)
            grid.failures += [f"{length}-cold: {f}" for f in cold.failures]
            for fraction in fractions:
                engine = CellRunner(recorder, backend, endpoint, Cell(length, fraction, State.ENGINE_HIT), r,
                                    purpose, check).run(1)
                hit = CellRunner(recorder, backend, endpoint, Cell(length, fraction, State.TIER_HIT), r, purpose,
                                 check).run(1)
                grid.failures += [f"{c.cell.id}: {f}" for c in (engine, hit) for f in c.failures]
                if not expected_cached(prefix_length(length, fraction), length, settings.block_size, granularity):
                    continue
                result = hit.results[0]
                grid.cells.setdefault((length, fraction), []).append(Round(
                    hit_s=result.client_ttft_s, cold_s=cold.results[0].client_ttft_s,
                    tier_tokens=result.cached_by_source.get(backend.tier or "", 0),
                    admitted=bool(result.connector.get("kvoffload:loads_admitted_total")),
                    declined=bool(result.connector.get("kvoffload:loads_declined_total"))))
            tracker.step(f"{length} tokens, round {r + 1}", work=length)
    return grid


def undecided_slower(grid: Grid) -> list[tuple[int, float]]:
    """Cells whose median ratio looks slower than recompute (above 1 + FLOOR) without the confidence to say so."""
    return sorted(key for key, rounds in grid.cells.items()
                  if verdict([r.ratio for r in rounds]) == "same" and np.median([r.ratio for r in rounds]) > 1 + FLOOR)


def settle_undecided(recorder: Recorder, backend: Backend, endpoint, grid: Grid, max_rounds: int) -> None:
    """More paired rounds, up to max_rounds, for cells that look slower but are undecided: noise is met
    with evidence, never with a wider tolerance."""
    for length, fraction in undecided_slower(grid):
        rounds = grid.cells[(length, fraction)]
        while len(rounds) < max_rounds and verdict([r.ratio for r in rounds]) == "same":
            more = run_grid(recorder, backend, endpoint, [length], [fraction], 1, first_round=len(rounds))
            grid.failures += more.failures
            rounds += more.cells.get((length, fraction), [])


def grid_table(grid: Grid) -> str:
    rows = ["length  cached  rounds  admitted  declined  hit ms  cold ms  hit/cold  verdict"]
    for (length, fraction), rounds in sorted(grid.cells.items()):
        ratios = [r.ratio for r in rounds]
        rows.append(f"{length:<7} {fraction:<7g} {len(rounds):<7} {sum(r.admitted for r in rounds):<9} "
                    f"{sum(r.declined for r in rounds):<9} {np.median([r.hit_s for r in rounds]) * 1e3:<7.0f} "
                    f"{np.median([r.cold_s for r in rounds]) * 1e3:<8.0f} {np.median(ratios):<9.2f} {verdict(ratios)}")
    return "\n".join(rows)


@dataclass
class AdmissionRun:
    drive: SlowDrive
    step_tokens: int
    control: Grid
    guarded: Grid
    calibration: dict
    bursts: dict
    mode: str


def run_admission(recorder: Recorder, servers: Servers, backend: Backend, mode: str, rounds: int) -> AdmissionRun:
    """The admission suite's measurements: drive probe, control (every load taken), guarded (the rule)."""
    settings = recorder.settings
    lengths, fractions = recorder.lengths(), settings.fractions
    kv_bytes = settings.kv_bytes_per_token
    # 1. The drive: from the unthrottled backend's cells, two rounds each, kept out of the run's cells.
    endpoint = servers.endpoint(backend)
    recorder.progress(f"admission: measuring {backend.name} unthrottled to choose the slowed drive")
    run_grid(recorder, backend, endpoint, lengths, fractions, 2, purpose="drive-probe")
    probe = analyse(recorder.cells(backend.name, purpose="drive-probe"), kv_bytes, {backend.name: backend.tier})[backend.name]
    prefixes = loadable_prefixes(lengths, fractions, settings.block_size, backend.granularity(settings))
    drive = slow_drive(prefixes, RecomputeFit(**probe["recompute"]), probe["tier"]["fixed_s"], kv_bytes)
    recorder.progress(f"admission: {drive.describe()}")
    step = step_tokens(lengths, settings.block_size)
    budget = ("--max-num-batched-tokens", str(step))
    # 2. The control: every load taken. Its cells calibrate the rule; its probes behind a queue measure
    #    how much of a queue a load hides in. The probe above has two rounds and a noisy neighbour can
    #    skew it; when the control lacks either kind of cell (slower, paid), the drive is derived again
    #    from the control's own cells and the control run once more.
    for attempt in range(1, CONTROL_ATTEMPTS + 1):
        slow = with_connector_options(backend, f"slow{attempt}" if attempt > 1 else "slow", server_args=budget,
                                      admission="always", **drive.options())
        recorder.progress(f"admission: control grid on {slow.name} ({rounds} rounds, every load taken)")
        control = run_grid(recorder, slow, servers.endpoint(slow), lengths, fractions, rounds)
        if (slower_hits(control) and paid_cells(control)) or attempt == CONTROL_ATTEMPTS:
            break
        servers.release(slow.name)
        fit = analyse(recorder.cells(slow.name), kv_bytes, {slow.name: backend.tier})[slow.name]
        # The fitted fixed cost includes the latency this drive added: the tier's own is what is left.
        drive = slow_drive(prefixes, RecomputeFit(**fit["recompute"]), fit["tier"]["fixed_s"] - drive.latency_s, kv_bytes)
        recorder.progress(f"admission: the control lacked {'slower' if not slower_hits(control) else 'paying'} "
                         f"cells; from its own cells, {drive.describe()}")
    # Probes behind a queue cost a long prefill each: at the longest length only, where loads are largest.
    burst_lengths = lengths[-1:]
    overlap_probes = run_bursts(recorder, slow, servers.endpoint(slow), burst_lengths, fractions, step, 3)
    servers.release(slow.name)
    analysis = analyse(recorder.cells(slow.name), kv_bytes, {slow.name: backend.tier})
    calibration = build_calibration(analysis, settings, recorder.environment())
    tier = calibration["tiers"][backend.name] = calibration["tiers"].pop(slow.name)
    tier["queue_overlap"] = measured_overlap(overlap_probes, tier, kv_bytes, step)
    path = recorder.run_dir() / "admission-calibration.json"
    write_calibration(path, calibration)
    # 3. The guarded server: the same drive, the rule under test.
    guarded_backend = with_connector_options(backend, "admission", server_args=budget, calibration=str(path),
                                             admission=mode, **drive.options())
    recorder.progress(f"admission: guarded grid on {guarded_backend.name} (rule {mode}, {rounds} rounds)")
    endpoint = servers.endpoint(guarded_backend)
    guarded = run_grid(recorder, guarded_backend, endpoint, lengths, fractions, rounds)
    settle_undecided(recorder, guarded_backend, endpoint, guarded, MAX_ROUNDS)
    bursts = run_bursts(recorder, guarded_backend, endpoint, burst_lengths, fractions, step, max(3, settings.rounds))
    servers.release(guarded_backend.name)
    run = AdmissionRun(drive, step, control, guarded, calibration, bursts, mode)
    recorder.add_benchmark("admission", summary(run, break_even_lines(analysis)),
                          {"drive": {**drive.options(), "predicted_break_even_prefix": drive.break_even_prefix},
                           "mode": mode,
                           "calibration": calibration, "analysis": analysis,
                           "admitted_cells": [list(k) for k in guarded.admitted_cells()],
                           "declined_cells": [list(k) for k in guarded.declined_cells()],
                           "negative_control": slower_hits(control), "positive_control": paid_cells(control),
                           "slower_hits": slower_hits(guarded), "missed_gains": missed_gains(control, guarded)})
    return run


def summary(run: AdmissionRun, calibration_lines: list[str]) -> str:
    tier = next(iter(run.calibration["tiers"].values()))
    # The prefix the rule enforces (its margin included), not the margin-0 one where hits start to pay.
    p_star = tier.get("enforced_break_even_prefix_tokens", tier.get("break_even_prefix_tokens"))
    negative, positive = slower_hits(run.control), paid_cells(run.control)
    slower, missed = slower_hits(run.guarded), missed_gains(run.control, run.guarded)
    lines = [
        run.drive.describe(),
        f"control (every load taken), {len(run.control.cells)} cells:",
        grid_table(run.control),
        *calibration_lines,
        f"rule {run.mode}: enforced break-even prefix {'-' if p_star is None else f'{p_star:,.0f} tokens'} "
        f"(hits pay from {tier.get('break_even_prefix_tokens') or 0:,.0f}), "
        f"margin {tier.get('margin', 0):.0%}, queue overlap {tier.get('queue_overlap') or 0:.2f}",
        grid_table(run.guarded),
        f"guarded: {len(run.guarded.admitted_cells())} cells admitted, {len(run.guarded.declined_cells())} declined",
        f"negative control (a rule that takes every load would be caught): "
        f"{'holds, ' + str(len(negative)) + ' slower cells' if negative else 'FAILS: no slower cell'}",
        f"positive control (a rule that declines every load would be caught): "
        f"{'holds, ' + str(len(positive)) + ' cells paid' if positive else 'FAILS: no cell paid'}",
        f"guarded: {len(slower)} slower cells, {len(missed)} paying cells declined",
        "behind a queue (guarded):",
        burst_table(run.bursts) if run.bursts else "(no probes)",
    ]
    return "\n".join(lines)
