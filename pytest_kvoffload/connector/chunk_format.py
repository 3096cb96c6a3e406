"""A chunk file's on-disk format: the header's fields, the payload's layout (Layout) and its checksum.

File = 4 KiB header + payload padded to 4 KiB, so that the whole file moves with one O_DIRECT call.
Header: magic, format version, fingerprint digest, key, payload length, checksum, layout numbers, the
position of the chunk's first block in its prompt, then each block's chained key (the index is rebuilt
from them when a server restarts). The store (store.py) reads and writes such files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from pytest_kvoffload.connector.io_memory import ALIGN, padded

MAGIC = b"KVOFFLD1"
# 2: xxh3 checksum (1 summed 64-bit words, blind to swapped blocks). 3: chunks of 1 to Layout.blocks
# blocks, each block's key in the header (2 held whole chunks under one chunk key). Files of another
# version are never read: the index counts them at start (chunks_old_format) and leaves them in place.
FORMAT_VERSION = 3
HEADER_SIZE = ALIGN
# magic, version, fingerprint digest, key, payload bytes, checksum, layers, blocks in this file, bytes per
# block, position of its first block in the prompt; then `blocks` keys of KEY_BYTES each.
HEADER = struct.Struct("<8sI32s16sQQIIQI")
HEADER_FIELDS = ("magic", "version", "fingerprint", "key", "payload_bytes", "checksum", "layers", "blocks",
                 "block_bytes", "first_block")
KEY_BYTES = 16
# Block keys the header has room for: a chunk of more blocks is refused by the connector's options.
MAX_BLOCKS = (ALIGN - HEADER.size) // KEY_BYTES


def checksum(payload: np.ndarray) -> int:
    """xxh3-64 of the payload: order-sensitive, so two swapped blocks are caught as well as torn,
    truncated and bit-flipped chunks.

    Not cryptographic: at about 29 GB/s on one core (measured beside zlib.crc32's 6.6 GB/s and an
    order-blind sum of 64-bit words at the same 29 GB/s) it stays far above any drive.
    """
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(payload)))


@dataclass(frozen=True)
class Layout:
    layers: int
    blocks: int  # blocks of a whole chunk (a prompt's last chunk may hold fewer)
    block_bytes: int  # bytes of one block of one layer

    def payload_bytes_for(self, blocks: int) -> int:
        return self.layers * blocks * self.block_bytes

    def file_bytes_for(self, blocks: int) -> int:
        return HEADER_SIZE + padded(self.payload_bytes_for(blocks))

    @property
    def payload_bytes(self) -> int:
        return self.payload_bytes_for(self.blocks)

    @property
    def file_bytes(self) -> int:
        return self.file_bytes_for(self.blocks)


def read_header(path: Path) -> dict:
    """A chunk file's header fields plus `block_keys` (hex; empty for another format version). No checksum
    check: for the index's start-up scan, tools and tests."""
    with open(path, "rb") as fh:
        raw = fh.read(HEADER_SIZE)
    fields = dict(zip(HEADER_FIELDS, HEADER.unpack_from(raw)))
    keys = []
    if fields["magic"] == MAGIC and fields["version"] == FORMAT_VERSION and fields["blocks"] <= MAX_BLOCKS:
        start = HEADER.size
        keys = [raw[start + i * KEY_BYTES:start + (i + 1) * KEY_BYTES].hex() for i in range(fields["blocks"])]
    fields["block_keys"] = keys
    return fields


__all__ = ["FORMAT_VERSION", "HEADER", "HEADER_FIELDS", "HEADER_SIZE", "KEY_BYTES", "Layout", "MAGIC", "MAX_BLOCKS",
           "checksum", "read_header"]
