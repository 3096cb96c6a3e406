"""Chained block keys: a block's key depends on every token up to and including it.

blake2b, not Python's hash(): keys must agree between the scheduler and worker processes and across
server restarts. The root folds in everything that makes stored KV incompatible (model, dtype, block
size, layout, platform), so another model's chunks can never answer a lookup.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

KEY_BYTES = 16


def key_root(fingerprint: str) -> bytes:
    return hashlib.blake2b(fingerprint.encode(), digest_size=KEY_BYTES).digest()


def block_keys(token_ids: Sequence[int], block_tokens: int, root: bytes) -> list[str]:
    """Keys of the full KV blocks of `token_ids`, in order; a trailing partial block has none."""
    tokens = np.asarray(token_ids, dtype="<i8")
    keys = []
    previous = root
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.blake2b(previous, digest_size=KEY_BYTES)
        digest.update(tokens[start:start + block_tokens].tobytes())
        previous = digest.digest()
        keys.append(previous.hex())
    return keys


def request_key_root(root: bytes, request) -> bytes | None:
    """The chain root of one request's keys, or None for a request that must be neither saved nor loaded.

    vLLM hashes more than tokens into a block (kv_cache_utils.generate_block_hash_extra_keys): the LoRA
    adapter, the request's cache_salt, multimodal inputs and prompt embeddings. Two requests with the
    same tokens but another adapter or salt must not share KV, so the adapter and salt go into the root;
    multimodal and embedding prompts, whose KV depends on more than their token ids, are not keyed.
    """
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    extra = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extra.append(f"lora={lora.lora_name}|{lora.lora_path}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        extra.append(f"cache_salt={salt}")
    if not extra:
        return root
    return hashlib.blake2b(root + "|".join(extra).encode(), digest_size=KEY_BYTES).digest()
