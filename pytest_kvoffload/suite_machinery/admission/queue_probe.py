"""A probe request that arrives while the engine is busy with a long prefill: the queue a load can hide in.

The background prompt is longer than one step's token budget, so the engine first looks at the probe in
the step that finishes the background's prefill, with that prefill still ahead of it. The background is
sent first, but on a loaded machine it can reach the engine after the probe, which then runs alone: such a
round measured no queue (`served_ahead`) and is measured again with fresh prompts, up to ATTEMPTS times;
the attempts served ahead are kept in the records (purpose "burst-ahead"), not in the cell.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pytest_kvoffload.analysis.fits import queue_overlap

from pytest_kvoffload.core.costs import RecomputeFit, load_and_recompute
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.serve.client import Endpoint, RequestResult, settled_snapshot, stream_completion
from pytest_kvoffload.measure.runner import place_in_tier_only
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.measure.context import Recorder
from pytest_kvoffload.measure.prompts import expected_cached, make_prompt, prefix_length


def background_length(step_tokens: int, max_model_len: int, block_size: int) -> int:
    """Two steps' worth of prompt, less a sliver so the probe is looked at in the second step."""
    return max(block_size, min(2 * step_tokens - step_tokens // 32, max_model_len - block_size))


ATTEMPTS = 3  # a round whose probe ran ahead of its queue is measured again, at most this often in all
LEAD_S = 0.05  # the background is sent this long before the probe


@dataclass
class QueuedProbe:
    probe: RequestResult
    background: RequestResult
    # Counter deltas around both requests. The background prompt is fresh, so every hit and every
    # admission decision in them is the probe's.
    cached_by_source: dict
    connector: dict
    lead_s: float = LEAD_S

    @property
    def served_ahead(self) -> bool:
        """The probe ran before the background's prefill: behind it, the probe's first token comes in the step
        that ends that prefill (two steps), so the background's first token trails it by under a step; ahead
        of it, by the whole prefill. Half the background's time to its first token is that step."""
        gap = self.background.client_ttft_s - self.lead_s - self.probe.client_ttft_s
        return gap > self.background.client_ttft_s / 2


def queued_behind(endpoint: Endpoint, background: list[int], probe: list[int], lead_s: float = LEAD_S) -> QueuedProbe:
    before = endpoint.metrics()
    # One HTTP session per thread: requests' sessions are not thread-safe.
    other = Endpoint(endpoint.url, endpoint.model_name)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-background") as pool:
        pending = pool.submit(stream_completion, other, background)
        time.sleep(lead_s)
        probe_result = stream_completion(endpoint, probe)
        background_result = pending.result()
    delta = settled_snapshot(endpoint, before, len(background) + len(probe)).delta(before)
    return QueuedProbe(probe_result, background_result,
                       {k: int(v) for k, v in delta.cached_by_source.items() if v},
                       {k: v for k, v in delta.extra.items() if v}, lead_s)


def run_bursts(recorder: Recorder, backend, endpoint, lengths, fractions, step: int, rounds: int,
               first_round: int = 0) -> dict:
    """Per cell and round: the probe with its prefix only on disk, then a cold probe, each behind a fresh
    prompt two steps long. A declined load is recomputed, so the cold probe is what the static rule does
    whenever it declines."""
    settings = recorder.settings
    granularity, block = backend.granularity(settings), backend.kv_block(settings)
    background = background_length(step, settings.max_model_len, block)
    cells: dict = {}
    # Cells whose shared prefix is shorter than one stored chunk load nothing: left out.
    measured = [(length, fraction, expected) for length in lengths for fraction in fractions
                if (expected := expected_cached(prefix_length(length, fraction), length, block, granularity))]
    tracker = Tracker(recorder.progress, f"queue bursts on {backend.name}", rounds * len(measured),
                      "cells x rounds", total_work=rounds * sum(length for length, _, _ in measured))
    for r in range(first_round, first_round + rounds):
        for length, fraction, expected in measured:
            hit, cold = queued_round(recorder, backend, endpoint, length, fraction, r, background)
            cell = cells.setdefault((length, fraction), {"rounds": [], "expected_disk_tokens": expected,
                                                         "background_tokens": background})
            c = hit.connector
            cell["rounds"].append({
                "hit_s": hit.probe.client_ttft_s, "cold_s": cold.probe.client_ttft_s,
                "disk_tokens": hit.cached_by_source.get("disk", 0),
                "admitted": bool(c.get("kvoffload:loads_admitted_total")),
                "queued": bool(c.get("kvoffload:loads_admitted_queued_total")),
                "declined": bool(c.get("kvoffload:loads_declined_total")),
                "served_ahead": hit.served_ahead or cold.served_ahead,
            })
            tracker.step(f"{length} tokens, {fraction:g} cached, round {r + 1}", work=length)
    return cells


def queued_round(recorder: Recorder, backend, endpoint, length: int, fraction: float, r: int,
                 background: int) -> tuple[QueuedProbe, QueuedProbe]:
    """One round of a cell: its prefix placed on disk, the hit probe and the cold probe, each behind a fresh
    background; measured again with fresh prompts while either probe was served ahead (module's doc)."""
    settings = recorder.settings
    for attempt in range(ATTEMPTS):
        salt = f"{recorder.salt}|burst|{length}|{fraction}|{r}" + (f"|again {attempt}" if attempt else "")

        def prompt(n, f, variant, tag):
            return make_prompt(n, f, seed=settings.random_seed, salt=f"{salt}|{tag}", variant=variant,
                               vocab_size=settings.model.vocab_size).tokens

        for primed in place_in_tier_only(endpoint, backend, prompt(length, fraction, "prime", "probe")):
            recorder.keep(burst_record(backend, length, fraction, r, "prime", primed))
        hit = queued_behind(endpoint, prompt(background, 0.0, "", "bg-hit"), prompt(length, fraction, "measure", "probe"))
        cold = queued_behind(endpoint, prompt(background, 0.0, "", "bg-cold"),
                             prompt(length, 0.0, "measure", State.COLD.value))
        ahead = hit.served_ahead or cold.served_ahead
        for state, outcome in ((State.TIER_HIT.value, hit), (State.COLD.value, cold)):
            purpose = "burst-ahead" if ahead and attempt + 1 < ATTEMPTS else "burst"
            record = burst_record(backend, length, fraction, r, purpose, outcome.probe)
            record.update(state=state, cached_by_source=outcome.cached_by_source, connector=outcome.connector,
                          background_ttft_s=outcome.background.client_ttft_s, served_ahead=outcome.served_ahead)
            recorder.keep(record)
        if not ahead:
            break
        recorder.progress(f"queue burst {length} tokens, round {r + 1}: a probe ran ahead of its queue; measured again")
    return hit, cold


def measured_overlap(probes, tier, kv_bytes_per_token: int, step: int) -> float | None:
    """The calibration's queue_overlap from probes whose loads were all taken (analysis.queue_overlap).

    A bandwidth the calibration could not resolve (its loads' transfer took less time than the rounds'
    noise) is priced as the admission rule prices it: no time per token, the fixed cost alone. That
    underestimates a load, and so the share of the queue it hides in: it errs towards recompute."""
    if not probes:
        return None
    recompute = RecomputeFit(**tier["recompute"])
    gbps = tier.get("bandwidth_gbps")
    seconds_per_token = kv_bytes_per_token / (gbps * 1e9) if gbps else 0.0
    background = next(iter(probes.values()))["background_tokens"]
    wait = recompute(background) - recompute(min(background, step))
    samples = [(length, r["disk_tokens"], r["hit_s"], r["cold_s"])
               for (length, _), cell in probes.items() for r in cell["rounds"] if r["disk_tokens"]]
    return queue_overlap(samples, lambda n: load_and_recompute(n, 0, recompute, tier["fixed_s"], seconds_per_token),
                         wait)


def burst_record(backend, length, fraction, r, purpose, result) -> dict:
    record = {"backend": backend.name, "length": length, "fraction": fraction, "state": State.TIER_HIT.value, "round": r,
              "purpose": purpose, **result.to_dict()}
    record.pop("output_token_ids", None)
    record.pop("top_logprobs", None)
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
