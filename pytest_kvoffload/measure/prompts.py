"""Deterministic token-id prompts with a chosen shared prefix.

Tokens come from a generator seeded by a digest of everything that names the prompt, so a prompt is
reproducible from its key while two keys never share tokens by accident. The run's salt belongs in
the key: a fixed seed against a long-lived server would otherwise measure last run's prefix cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

# Ids below this are often special tokens (pad, bos, eos, unk) in Llama-like vocabularies.
FIRST_ORDINARY_TOKEN = 4


@dataclass(frozen=True)
class Prompt:
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @property
    def tokens(self) -> list[int]:
        return list(self.prefix + self.suffix)

    def __len__(self) -> int:
        return len(self.prefix) + len(self.suffix)


def _tokens(key: str, count: int, vocab_size: int) -> tuple[int, ...]:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=count))


def prefix_length(length: int, fraction: float) -> int:
    return max(0, min(length, round(length * fraction)))


def make_prompt(length: int, fraction: float, *, seed: int = 0, salt: str = "", variant: str = "",
                vocab_size: int = 32000) -> Prompt:
    """A prompt of `length` tokens whose first round(length x fraction) tokens are the shared prefix.

    The prefix depends on (seed, salt, length, fraction); the suffix also on `variant`, so prompts
    that differ only in variant share exactly their prefix: prime with one variant, measure another.
    """
    if length < 1:
        raise ValueError("a prompt needs at least one token")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("fraction must lie in [0, 1]")
    n_prefix = prefix_length(length, fraction)
    base = f"{seed}|{salt}|{length}|{fraction!r}"
    prefix = _tokens(f"prefix|{base}", n_prefix, vocab_size)
    suffix = _tokens(f"suffix|{base}|{variant}", length - n_prefix, vocab_size)
    return Prompt(prefix, suffix)


def expected_cached(prefix_tokens: int, prompt_tokens: int, block_size: int, granularity: int | None = None,
                    last_block: bool = False, all_but_last_token: bool = False) -> int:
    """Tokens a cache can serve: whole storage units of the shared prefix, cut to whole KV blocks
    that leave at least one prompt token to compute (vLLM always computes the last one).

    With `last_block` the cache may also serve the block that holds the prompt's last token: vLLM's
    OffloadingConnector offers it, the scheduler takes the whole prompt as loaded and recomputes only
    that token (`_update_waiting_for_remote_kv`); the engine's own cache never offers it.
    With `all_but_last_token` as well, a cache that holds the whole prompt in whole units serves and counts
    every token but the last: LMCache's MP connector (`get_num_new_matched_tokens`; its lookups end on
    chunk boundaries, so a prompt of 384 tokens in chunks of 256 is served 256).
    """
    unit = granularity or block_size
    stored = prefix_tokens // unit * unit
    if last_block and all_but_last_token and stored == prompt_tokens:
        return prompt_tokens - 1
    loadable = (prompt_tokens if last_block else max(0, prompt_tokens - 1)) // block_size * block_size
    return min(stored, loadable)
