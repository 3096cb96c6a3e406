"""A trace's prefix trees: each request's block keys, how much of a request a cache already holds, the share of
a trace's blocks that an earlier request had (its reuse), and slices of whole trees. The planner and the
replay selection both read traces through these."""

from __future__ import annotations

from pytest_kvoffload.traces.read import FORMATS, Scaling, TraceRequest


def block_keys(request: TraceRequest, fmt: str, scaling: Scaling, block_size: int) -> tuple[int, list[int]]:
    """The request's prompt length and the keys of its cacheable blocks (whole blocks that leave at least
    one token to compute). A key names the prompt up to the block's end: the hash-id chain up to the trace
    block that holds that end, and the position in it (traces.build_prompt makes that the tokens)."""
    native = FORMATS[fmt]["block_tokens"]
    per_block = scaling.tokens_per_block or native
    length = max(1, round(request.input_length * per_block / native))
    chain, chains = 0, []
    for hash_id in request.hash_ids:
        chain = hash((chain, hash_id))
        chains.append(chain)
    keys = []
    for j in range((length - 1) // block_size):
        last = (j + 1) * block_size - 1
        trace_block = last // per_block
        if trace_block >= len(chains):
            break  # the prompt's own tail: shared with no other request
        keys.append(hash((chains[trace_block], last % per_block)))
    return length, keys


def leading(keys: list[int], cache, start: int = 0) -> int:
    """How many keys from `start` on are in the cache (an LRU or a set), up to the first that is not."""
    n = start
    while n < len(keys) and keys[n] in cache:
        n += 1
    return n - start


def reuse_share(requests: list[TraceRequest]) -> float:
    """Share of trace blocks (hash ids) that an earlier request of the same list already had."""
    seen: set = set()
    reused = total = 0
    for request in requests:
        chain = 0
        for hash_id in request.hash_ids:
            chain = hash((chain, hash_id))
            reused += chain in seen
            seen.add(chain)
            total += 1
    return reused / total if total else 0.0


def slice_by_tree(requests: list[TraceRequest], size: int, seed: int = 0) -> list[TraceRequest]:
    """About `size` requests whose reuse chains are whole: requests grouped into prefix trees (by their
    first hash id), whole trees taken in a seeded random order until `size` is reached, trace order kept.
    A first-N window cuts chains and keeps far less reuse than the trace has.

    A tree larger than `size` itself (reuse living in one large tree: every request sharing a system
    prompt) is not cut like a window: its sub-trees (the next hash id) are taken the same way, so the slice
    keeps both the shared root and the sub-trees' own reuse."""
    import random

    rng = random.Random(seed)
    chosen: list[TraceRequest] = []

    def take(group: list[TraceRequest], depth: int) -> None:
        trees: dict = {}
        for request in group:
            ids = request.hash_ids
            root = tuple(ids[:depth + 1]) if len(ids) > depth else ("alone", request.line)
            trees.setdefault(root, []).append(request)
        roots = list(trees)
        rng.shuffle(roots)
        for root in roots:
            if len(chosen) >= size:
                return
            tree = trees[root]
            if len(tree) > size and root[0] != "alone":
                take(tree, depth + 1)
            else:
                chosen.extend(tree)

    take(requests, 0)
    chosen.sort(key=lambda r: r.line)
    return chosen
