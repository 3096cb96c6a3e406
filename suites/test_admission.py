"""The admission rule never makes a hit slower than recompute, and the check has teeth.

On a drive slowed by the connector's bandwidth limit (so that the break-even prefix falls inside the
swept lengths), the module first calibrates: cold and tier-hit cells with admission off, fitted into a
calibration file. That same grid is the negative control: it must contain cells where the hit is
slower than recompute, and the check must flag them. Then a server with admission on runs the grid,
and in every cell the hit, compared with a cold request taken beside it in each round, must not be
slower beyond the noise of those ratios measured in the same run.
"""

import numpy as np
import pytest

from pytest_kvoffload import machine
from pytest_kvoffload.analysis import analyse
from pytest_kvoffload.backends import with_connector_options
from pytest_kvoffload.calibration import build_calibration, write_calibration
from pytest_kvoffload.cells import Cell, State
from pytest_kvoffload.measure import CellRunner
from pytest_kvoffload.prompts import expected_cached, prefix_length
from pytest_kvoffload.stats import cell_table

pytestmark = pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")

NOISE_FLOOR = 0.03


def slow_gbps(settings) -> float:
    return float(settings.extra.get("slow_drive_gbps") or machine.defaults()["slow_drive_gbps"])


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
    slow = with_connector_options(kv_backend, "slow", read_gbps=gbps)
    control = run_grid(kv_session, slow, rounds)
    kv_session.pool.release(slow.name)
    cells = [c for c in cell_table(kv_session.writer.data["measurements"]) if c["backend"] == slow.name]
    analysis = analyse(cells, settings.model.kv_bytes_per_token(), {slow.name: "disk"})
    calibration = build_calibration(analysis, settings, kv_session.writer.data["environment"])
    calibration["tiers"]["kvoffload-disk"] = calibration["tiers"].pop(slow.name)
    path = kv_session.run_dir / "admission-calibration.json"
    write_calibration(path, calibration)
    admitted = with_connector_options(kv_backend, "admission", read_gbps=gbps, calibration=str(path))
    guarded = run_grid(kv_session, admitted, rounds)
    kv_session.pool.release(admitted.name)
    return {"control": control, "guarded": guarded, "gbps": gbps, "calibration": calibration}


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
