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


# Seeded draws a slice is chosen from, and how close its reuse should come to the whole trace's.
SLICE_DRAWS = 64
SLICE_TOLERANCE = 0.10


def prefix_trees(requests: list[TraceRequest], size: int | None = None) -> list[list[TraceRequest]]:
    """The requests grouped by their first hash id (a request without any is a tree of its own), each tree in
    trace order, the trees in the order of their first request. Trees share no block: a block's key is its
    whole prefix. With `size`, a tree of more requests than that is split where it branches (a system
    prompt every conversation opens with: one sub-tree per conversation), so a slice can take parts whole."""
    trees: dict = {}
    for request in sorted(requests, key=lambda r: r.line):
        root = request.hash_ids[0] if request.hash_ids else ("alone", request.line)
        trees.setdefault(root, []).append(request)
    if size is None:
        return list(trees.values())
    units = [unit for tree in trees.values() for unit in _branches(tree, size)]
    return sorted(units, key=lambda unit: unit[0].line)


def _branches(tree: list[TraceRequest], size: int) -> list[list[TraceRequest]]:
    if len(tree) <= size:
        return [tree]
    ids = [r.hash_ids for r in tree]
    common = 0
    while all(len(i) > common for i in ids) and len({i[common] for i in ids}) == 1:
        common += 1
    groups: dict = {}
    for request in tree:
        key = request.hash_ids[common] if len(request.hash_ids) > common else ("stem",)
        groups.setdefault(key, []).append(request)
    if len(groups) == 1:
        return [tree]  # one chain longer than the slice: its first requests complete a draw (_draw)
    return [unit for group in groups.values() for unit in _branches(group, size)]


def _draw(trees: list[list[TraceRequest]], size: int, rng) -> list[TraceRequest]:
    """Whole trees in a seeded order while they fit; the slice is completed with the first requests (in
    time) of the first tree that did not: a conversation's opening turns, a system prompt's first users."""
    order = trees[:]
    rng.shuffle(order)
    chosen, left = [], []
    for tree in order:
        if len(chosen) + len(tree) <= size:
            chosen.extend(tree)
        else:
            left.append(tree)
    for tree in left:
        if len(chosen) >= size:
            break
        chosen.extend(tree[:size - len(chosen)])
    return chosen


def slice_by_tree(requests: list[TraceRequest], size: int, seed: int = 0) -> list[TraceRequest]:
    """`size` requests that keep the trace's reuse: SLICE_DRAWS seeded draws of whole prefix trees (_draw),
    and of those the one whose reuse share is closest to the whole trace's, in trace order. A first-N window
    cuts chains, and a single draw's reuse hangs on which trees it happened to take (seeds 0 to 4 of one
    draw gave 35% to 74% on the shared Mooncake trace, whose reuse is 64%). slice_gap says how close it came."""
    import random

    if len(requests) <= size:
        return sorted(requests, key=lambda r: r.line)
    target = reuse_share(requests)
    rng = random.Random(seed)
    trees = prefix_trees(requests, size)
    best, best_gap = None, float("inf")
    for _ in range(SLICE_DRAWS):
        chosen = sorted(_draw(trees, size, rng), key=lambda r: r.line)
        gap = abs(reuse_share(chosen) - target)
        if gap < best_gap:
            best, best_gap = chosen, gap
    return best


def slice_gap(chosen: list[TraceRequest], requests: list[TraceRequest]) -> str | None:
    """None when the slice's reuse share is within SLICE_TOLERANCE of the whole trace's; else one line saying
    by how much no slice of that size came closer."""
    mine, whole = reuse_share(chosen), reuse_share(requests)
    if abs(mine - whole) <= SLICE_TOLERANCE:
        return None
    return (f"no slice of {len(chosen)} requests kept the trace's reuse within {SLICE_TOLERANCE:.0%} points in "
            f"{SLICE_DRAWS} draws: the closest has {mine:.0%} against the trace's {whole:.0%} "
            f"({(mine - whole) * 100:+.0f} points)")
