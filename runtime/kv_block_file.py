"""One offloaded KV block as bytes: a header that names what the block is, then its K/V.

Header (little-endian, 88 bytes): magic `KILNKVB1`, the namespace digest (the artifact, target, KV
dtype and layout the block was computed with), the block's chain hash, the payload's length and its
CRC-32. A reader that expects another namespace, hash or length calls the file foreign; a short file
is truncated; a payload whose CRC differs is corrupt. Either way the block is not used.
"""

from __future__ import annotations

import struct
import zlib
from typing import Literal

MAGIC = b"KILNKVB1"
_HEADER = struct.Struct("<8s32s32sQII")
HEADER_BYTES = _HEADER.size

BlockFault = Literal["foreign", "truncated", "corrupt"]
BLOCK_FAULTS: tuple[BlockFault, ...] = ("foreign", "truncated", "corrupt")


class BlockFileError(Exception):
    def __init__(self, fault: BlockFault, detail: str) -> None:
        super().__init__(f"{fault}: {detail}")
        self.fault = fault


def encode_header(namespace: bytes, block_hash: bytes, payload: memoryview | bytes) -> bytes:
    return _HEADER.pack(MAGIC, namespace, block_hash, len(payload), zlib.crc32(payload), 0)


def decode(data: memoryview, namespace: bytes, block_hash: bytes, payload_bytes: int) -> memoryview:
    """The payload of a block file's bytes `data`, checked against what the reader expects; a
    BlockFileError naming the fault otherwise."""
    if len(data) < HEADER_BYTES:
        raise BlockFileError("truncated", f"{len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, their_namespace, their_hash, length, crc, _ = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockFileError("foreign", f"not a kiln KV block (magic {bytes(magic)!r})")
    if their_namespace != namespace:
        raise BlockFileError(
            "foreign", f"computed by another artifact or KV layout ({their_namespace.hex()[:16]})"
        )
    if their_hash != block_hash or length != payload_bytes:
        raise BlockFileError("foreign", f"holds block {their_hash.hex()[:16]} of {length} bytes")
    payload = data[HEADER_BYTES:]
    if len(payload) < length:
        raise BlockFileError("truncated", f"{len(payload)} of {length} payload bytes")
    if len(payload) > length:
        raise BlockFileError("corrupt", f"{len(payload) - length} bytes past the payload")
    if zlib.crc32(payload) != crc:
        raise BlockFileError("corrupt", "the payload's CRC-32 does not match the header's")
    return payload
