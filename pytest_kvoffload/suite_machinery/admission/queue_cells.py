"""The admission suite's queue cells: probes behind a queue on the control and the guarded server, paired by
round and judged with the frontier's noise (one cell alone cannot measure its own), an undecided one measured
again on both servers, interleaved, as the frontier's cells are (judge.until_decided)."""

from __future__ import annotations

from pytest_kvoffload.measure.context import Recorder
from pytest_kvoffload.serve.backend import Backend
from pytest_kvoffload.serve.server import settle
from pytest_kvoffload.suite_machinery.admission import judge
from pytest_kvoffload.suite_machinery.admission.queue_probe import run_bursts


def burst_figures(r: dict) -> tuple[bool, float, float]:
    return r["admitted"], r["hit_s"] / r["cold_s"], r["cold_s"]


def queue_bursts(recorder: Recorder, backend: Backend, endpoint, keys: list, rounds, step: int, into: dict) -> None:
    """Rounds of the probes behind a queue (queue_probe.run_bursts) of each (length, fraction) key, added to
    `into`'s cells."""
    for r in rounds:
        for key in keys:
            for k, cell in run_bursts(recorder, backend, endpoint, [key[0]], [1.0], step, 1, first_round=r).items():
                into.setdefault(k, {**cell, "rounds": []})["rounds"] += cell["rounds"]


def judge_queue(recorder: Recorder, pair: tuple, control_bursts: dict, bursts: dict, step: int, measured: float,
                margin: float, noise: judge.Noise, mode: str, first_extra: int) -> list[judge.CellVerdict]:
    """The queue cells judged with the frontier's noise (one cell alone cannot measure its own), an undecided
    one measured again on both servers, interleaved, as the frontier's are (judge.until_decided)."""
    def queue_decisions() -> dict[int, list[judge.Decision]]:
        return judge.decisions({k[0] - 1: c["rounds"] for k, c in control_bursts.items()},
                         {k[0] - 1: c["rounds"] for k, c in bursts.items()}, burst_figures)

    def measure_more(prefixes: list[int], more: int) -> dict[int, list[judge.Decision]]:
        recorder.progress(f"admission: queue cell(s) {', '.join(map(str, prefixes))} undecided; {more} more rounds "
                          "on both servers")
        keys = [k for k in control_bursts if k[0] - 1 in prefixes]
        sides = ((pair[0][0], pair[0][1], control_bursts), (pair[1][0], pair[1][1], bursts))
        for r in range(first_extra, first_extra + more):
            for b, e, into in (sides if r % 2 == 0 else sides[::-1]):  # who goes first alternates
                settle([side[1] for side in sides])
                queue_bursts(recorder, b, e, keys, [r], step, into)
        return queue_decisions()

    verdicts, _ = judge.until_decided(queue_decisions(), {k[0] - 1: (k[0] - 1) / measured for k in bursts}, margin,
                                      measure_more, measured=noise, declines=mode.startswith("queue"))
    return verdicts
