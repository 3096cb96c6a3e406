"""Slices that keep a trace's reuse: 24 requests within 10 points of the whole trace's reuse share for
seeds 0 to 9, on the shared Mooncake trace and on conversation-chain traces built from it; and a slice that
cannot says so and by how much."""

import random
from pathlib import Path

import pytest

from pytest_kvoffload.traces.prefix_trees import prefix_trees, reuse_share, slice_by_tree, slice_gap
from pytest_kvoffload.traces.read import TraceRequest, read_trace

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def shared():
    if not SHARED.is_file():
        pytest.skip(f"the shared Mooncake trace is not at {SHARED}")
    return read_trace(SHARED).requests


def conversations(requests, system_prompt: bool, seed: int = 0, count: int = 400):
    """A multi-turn trace from the shared one's lengths: each conversation's turn extends the prompt of its
    previous turn (long chains, not many small trees), turns interleaved in time across conversations; with
    `system_prompt`, every conversation opens with the same blocks (one prefix tree)."""
    rng = random.Random(seed)
    opening = tuple(("system", k) for k in range(4)) if system_prompt else ()
    turns = []
    for c in range(count):
        ids = opening
        for t in range(rng.randint(2, 10)):
            source = requests[(c * 10 + t) % len(requests)]
            ids = ids + tuple((c, t, k) for k in range(max(1, min(6, len(source.hash_ids) // 10))))
            turns.append((c * 3.0 + t * 20.0 + rng.random(), source.output_length, ids))
    turns.sort(key=lambda turn: turn[0])
    return [TraceRequest(n, arrival, 16 * len(ids), out, ids) for n, (arrival, out, ids) in enumerate(turns)]


def assert_slices_keep_reuse(requests, size=24, seeds=range(10), points=0.10):
    whole = reuse_share(requests)
    shares = [reuse_share(slice_by_tree(requests, size, seed)) for seed in seeds]
    assert all(abs(s - whole) <= points for s in shares), (whole, shares)
    assert all(len(slice_by_tree(requests, size, seed)) == size for seed in seeds)


def test_slices_of_the_shared_trace_keep_its_reuse_for_every_seed(shared):
    assert_slices_keep_reuse(shared)


@pytest.mark.parametrize("system_prompt", [False, True], ids=["conversations", "one-tree"])
def test_slices_of_conversation_chains_keep_their_reuse_for_every_seed(shared, system_prompt):
    chains = conversations(shared, system_prompt)
    assert len(prefix_trees(chains)) == (1 if system_prompt else 400)
    assert_slices_keep_reuse(chains)


def test_a_slice_keeps_trace_order_and_whole_conversations():
    chains = conversations([TraceRequest(0, 0.0, 100, 5, tuple(range(40)))], system_prompt=True, count=60)
    chosen = slice_by_tree(chains, 24, seed=3)
    assert [r.line for r in chosen] == sorted(r.line for r in chosen)
    by_conversation = {}
    for r in chains:
        by_conversation.setdefault(r.hash_ids[4][0], []).append(r.line)
    taken = {r.line for r in chosen}
    cut = [c for c, lines in by_conversation.items() if taken & set(lines) and not set(lines) <= taken]
    assert len(cut) <= 1  # at most the one that completes the slice, and that by its first turns


def test_a_slice_that_cannot_keep_the_reuse_says_so_and_by_how_much():
    chain = [TraceRequest(n, float(n), 16 * (n + 1), 1, tuple(range(n + 1))) for n in range(100)]
    chosen = slice_by_tree(chain, 3)
    gap = slice_gap(chosen, chain)
    assert gap.startswith("no slice of 3 requests kept the trace's reuse within 10% points") and "points)" in gap
    assert slice_gap(chain, chain) is None
