"""The admission rule never makes a hit slower than recompute, and the check has teeth.

On a drive slowed by the connector's bandwidth limit (so that the break-even prefix falls inside the
swept lengths), the module first calibrates: cold and tier-hit cells with admission off, fitted into a
calibration file. That same grid is the negative control: it must contain cells where the hit is
slower than recompute, and the check must flag them. Then a server with admission on runs the grid,
and in every cell the hit, compared with a cold request taken beside it in each round, must not be
slower beyond the noise of those ratios measured in the same run.

Behind a queue: each probe is sent just behind a fresh prompt two steps long, once with its prefix on
disk and once cold. On the slowed server (every load taken) these probes measure how much of that queue
a load really hides in (queue_overlap, written into the calibration); on the guarded server (queue-aware
rule) they show how many loads each rule admits and whether the extra ones were useful (a hit faster
than the cold probe beside it), and the check is again that no admitted hit is slower.
"""

import numpy as np
import pytest

from pytest_kvoffload import machine
from pytest_kvoffload.analysis import RecomputeFit, TierFit, analyse, queue_overlap
from pytest_kvoffload.backends import with_connector_options
from pytest_kvoffload.burst import background_length, queued_behind
from pytest_kvoffload.calibration import build_calibration, write_calibration
from pytest_kvoffload.cells import Cell, State
from pytest_kvoffload.measure import CellRunner, place_in_tier_only
from pytest_kvoffload.prompts import expected_cached, make_prompt, prefix_length
from pytest_kvoffload.report import break_even_lines
from pytest_kvoffload.stats import cell_table

pytestmark = pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")

NOISE_FLOOR = 0.03


def slow_gbps(settings) -> float:
    return float(settings.extra.get("slow_drive_gbps") or machine.defaults()["slow_drive_gbps"])


def step_tokens() -> int:
    return int(machine.defaults()["step_tokens"])


def run_grid(kv_session, backend, rounds):
    """Cold and tier-hit rounds interleaved, so each hit is compared with a cold request taken beside it.

    Cells whose shared prefix is shorter than one stored chunk have nothing to load, so nothing for the
    rule to decide: they are left out of the comparison.
    """
    settings = kv_session.settings
    endpoint = kv_session.endpoint(backend)
    granularity = backend.granularity(settings)
    pairs: dict = {}
    for length in settings.lengths:
        for r in range(rounds):
            cold = CellRunner(kv_session, backend, endpoint, Cell(length, 0.0, State.COLD), first_round=r).run(1)
            for fraction in settings.fractions:
                # Engine hits of the same cells let the calibration fit the tier by pairs (analysis.py).
                CellRunner(kv_session, backend, endpoint, Cell(length, fraction, State.ENGINE_HIT), first_round=r).run(1)
                hit = CellRunner(kv_session, backend, endpoint, Cell(length, fraction, State.TIER_HIT),
                                 first_round=r).run(1)
                if expected_cached(prefix_length(length, fraction), length, settings.block_size, granularity):
                    pairs.setdefault((length, fraction), []).append((hit.ttfts[0], cold.ttfts[0]))
    return pairs


def violations(pairs):
    """Cells whose hit is slower than the cold request beside it, beyond the noise of those ratios.

    tolerance = max(3%, 3 x the ratios' relative half inter-quartile range): measured in this run.
    """
    out = []
    for (length, fraction), rounds in sorted(pairs.items()):
        ratios = np.asarray([hit / cold for hit, cold in rounds])
        median = float(np.median(ratios))
        q1, q3 = np.percentile(ratios, [25, 75])
        tolerance = max(NOISE_FLOOR, 3 * (q3 - q1) / 2 / median)
        if median > 1 + tolerance:
            hit = float(np.median([h for h, _ in rounds]))
            cold = float(np.median([c for _, c in rounds]))
            out.append(f"{length} tokens, {fraction:g} cached: tier hit {hit * 1e3:.0f} ms vs cold {cold * 1e3:.0f} ms "
                       f"(median ratio {median:.2f}, noise +{tolerance:.0%})")
    return out


@pytest.fixture(scope="module")
def grids(kv_session, kv_backend):
    if kv_backend.name not in kv_session.settings.backends:
        pytest.skip(f"{kv_backend.name} is not among --kv-backend")
    settings = kv_session.settings
    rounds = max(7, settings.rounds)
    gbps = slow_gbps(settings)
    # A known step budget, the same for calibration and guarded runs, lets the burst know its queue.
    budget = ("--max-num-batched-tokens", str(step_tokens()))
    slow = with_connector_options(kv_backend, "slow", server_args=budget, read_gbps=gbps)
    control = run_grid(kv_session, slow, rounds)
    # The same probes behind a long prefill with every load taken: how much of a queue a load hides in.
    overlap_probes = run_bursts(kv_session, slow, 3)
    kv_session.pool.release(slow.name)
    cells = [c for c in cell_table(kv_session.writer.data["measurements"]) if c["backend"] == slow.name]
    analysis = analyse(cells, settings.model.kv_bytes_per_token(), {slow.name: "disk"})
    calibration = build_calibration(analysis, settings, kv_session.writer.data["environment"])
    tier = calibration["tiers"]["kvoffload-disk"] = calibration["tiers"].pop(slow.name)
    tier["queue_overlap"] = measured_overlap(overlap_probes, tier, settings)
    overlap = "-" if tier["queue_overlap"] is None else f"{tier['queue_overlap']:.2f}"
    lines = break_even_lines(analysis) + [f"queue overlap {overlap}; written to {path_of(kv_session)}"]
    kv_session.add_benchmark(f"admission calibration ({gbps} GB/s drive, admission off)", "\n".join(lines),
                             {"analysis": analysis, "calibration": calibration})
    path = path_of(kv_session)
    write_calibration(path, calibration)
    admitted = with_connector_options(kv_backend, "admission", server_args=budget, read_gbps=gbps,
                                      calibration=str(path), admission="queue")
    guarded = run_grid(kv_session, admitted, rounds)
    bursts = run_bursts(kv_session, admitted, max(5, settings.rounds))
    kv_session.pool.release(admitted.name)
    overlap = tier["queue_overlap"]
    text = (f"queue overlap measured with admission off: {'-' if overlap is None else f'{overlap:.2f}'} "
            "(0: a load waits its turn behind the prefill, 1: it is fully hidden)\n" + burst_table(bursts))
    kv_session.add_benchmark("admission behind a queue", text, {"queue_overlap": overlap, "cells": [
        {"length": length, "fraction": fraction, **cell} for (length, fraction), cell in sorted(bursts.items())]})
    return {"control": control, "guarded": guarded, "bursts": bursts, "gbps": gbps, "calibration": calibration}


def path_of(kv_session):
    return kv_session.run_dir / "admission-calibration.json"


def run_bursts(kv_session, backend, rounds):
    """Per cell and round: the probe with its prefix only on disk, then a cold probe, each behind a fresh
    prompt two steps long. A declined load is recomputed, so the cold probe is what the static rule does
    whenever it declines."""
    settings = kv_session.settings
    endpoint = kv_session.endpoint(backend)
    granularity = backend.granularity(settings)
    background = background_length(step_tokens(), settings.max_model_len, settings.block_size)
    cells: dict = {}
    for r in range(rounds):
        for length in settings.lengths:
            for fraction in settings.fractions:
                expected = expected_cached(prefix_length(length, fraction), length, settings.block_size, granularity)
                if not expected:
                    continue
                salt = f"{kv_session.salt}|burst|{length}|{fraction}|{r}"

                def prompt(n, f, variant, tag):
                    return make_prompt(n, f, seed=settings.seed, salt=f"{salt}|{tag}", variant=variant,
                                       vocab_size=settings.model.vocab_size).tokens

                for primed in place_in_tier_only(endpoint, backend, prompt(length, fraction, "prime", "probe")):
                    kv_session.record(burst_record(backend, length, fraction, r, "prime", primed))
                hit = queued_behind(endpoint, prompt(background, 0.0, "", "bg-hit"),
                                    prompt(length, fraction, "measure", "probe"))
                cold = queued_behind(endpoint, prompt(background, 0.0, "", "bg-cold"),
                                     prompt(length, 0.0, "measure", "cold"))
                cell = cells.setdefault((length, fraction), {"rounds": [], "expected_disk_tokens": expected,
                                                             "background_tokens": background})
                c = hit.connector
                cell["rounds"].append({
                    "hit_s": hit.probe.client_ttft_s, "cold_s": cold.probe.client_ttft_s,
                    "disk_tokens": hit.cached_by_source.get("disk", 0),
                    "admitted": bool(c.get("kvoffload:loads_admitted_total")),
                    "queued": bool(c.get("kvoffload:loads_admitted_queued_total")),
                    "declined": bool(c.get("kvoffload:loads_declined_total")),
                })
                for state, outcome in (("tier-hit", hit), ("cold", cold)):
                    record = burst_record(backend, length, fraction, r, "burst", outcome.probe)
                    record.update(state=state, cached_by_source=outcome.cached_by_source,
                                  connector=outcome.connector, background_ttft_s=outcome.background.client_ttft_s)
                    kv_session.record(record)
    return cells


def measured_overlap(probes, tier, settings) -> float | None:
    """The calibration's queue_overlap from probes whose loads were all taken (analysis.queue_overlap)."""
    if not probes or not tier.get("bandwidth_gbps"):
        return None
    recompute = RecomputeFit(**tier["recompute"])
    fit = TierFit(tier["bandwidth_gbps"] * 1e9, tier["fixed_s"], 0)
    kv_bytes = settings.model.kv_bytes_per_token()
    background = next(iter(probes.values()))["background_tokens"]
    wait = recompute(background) - recompute(min(background, step_tokens()))
    samples = [(length, r["disk_tokens"], r["hit_s"], r["cold_s"])
               for (length, _), cell in probes.items() for r in cell["rounds"] if r["disk_tokens"]]
    return queue_overlap(samples, recompute, lambda n: fit.load_seconds(n, kv_bytes), wait)


def burst_record(backend, length, fraction, r, purpose, result) -> dict:
    record = {"backend": backend.name, "length": length, "fraction": fraction, "state": "tier-hit", "round": r,
              "purpose": purpose, **result.to_dict()}
    record.pop("output_token_ids", None)
    return record


def burst_table(cells) -> str:
    rows = ["length  cached  loads admitted: static  queue  useful   hit ms  cold ms  hit/cold",
            "(each probe behind a fresh {:,}-token prompt; useful: admitted and faster than the cold probe beside it)"
            .format(next(iter(cells.values()))["background_tokens"]) if cells else ""]
    for (length, fraction), cell in sorted(cells.items()):
        rs = cell["rounds"]
        n = len(rs)
        admitted = sum(r["admitted"] for r in rs)
        static = admitted - sum(r["queued"] for r in rs)
        useful = sum(r["admitted"] and r["hit_s"] < r["cold_s"] for r in rs)
        hit = float(np.median([r["hit_s"] for r in rs]))
        cold = float(np.median([r["cold_s"] for r in rs]))
        ratio = float(np.median([r["hit_s"] / r["cold_s"] for r in rs]))
        rows.append(f"{length:<7} {fraction:<7g} {static}/{n:<21} {admitted}/{n:<4} {useful}/{n:<5} "
                    f"{hit * 1e3:<8.0f} {cold * 1e3:<8.0f} {ratio:.2f}")
    return "\n".join(rows)


def test_negative_control_finds_hits_slower_than_recompute(grids):
    found = violations(grids["control"])
    assert found, (f"with admission off on a {grids['gbps']} GB/s drive no cell was slower than recompute: "
                   "the check would have no teeth; use a slower drive or shorter lengths")


def test_admission_never_makes_a_hit_slower_than_recompute(grids):
    found = violations(grids["guarded"])
    assert not found, "admission on, yet: " + "; ".join(found)


def test_declined_loads_move_no_disk_tokens(kv_session, grids):
    name = "kvoffload-disk[admission]"
    measured = [m for m in kv_session.writer.data["measurements"]
                if m["backend"] == name and m["state"] == "tier-hit" and m["purpose"] == "measure"]
    declined = [m for m in measured if m["connector"].get("kvoffload:loads_declined_total")]
    assert all(m["cached_by_source"].get("disk", 0) == 0 for m in declined)
    admitted = [m for m in measured if m["connector"].get("kvoffload:loads_admitted_total")]
    assert all(m["cached_by_source"].get("disk", 0) > 0 for m in admitted)


def test_queue_aware_admission_never_makes_a_hit_slower_than_recompute(grids):
    # A declined probe is a recompute: comparing it with the cold one measures only noise. Cells are
    # judged on their admitted rounds, when there are enough of them to have a spread.
    pairs = {cell: [(r["hit_s"], r["cold_s"]) for r in c["rounds"] if r["admitted"]]
             for cell, c in grids["bursts"].items()}
    found = violations({cell: rounds for cell, rounds in pairs.items() if len(rounds) >= 3})
    assert not found, "behind a long prefill, with the queue-aware rule: " + "; ".join(found)


def test_queued_probes_load_exactly_what_was_admitted(grids):
    for (length, fraction), cell in grids["bursts"].items():
        for i, r in enumerate(cell["rounds"]):
            want = cell["expected_disk_tokens"] if r["admitted"] else 0
            assert r["disk_tokens"] == want, (f"{length} tokens, {fraction:g} cached, round {i}: "
                                              f"{r['disk_tokens']} disk tokens, expected {want} "
                                              f"({'admitted' if r['admitted'] else 'declined'})")
