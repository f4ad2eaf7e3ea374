"""The disk tier's files (`--kv-cache-dir`): one file per KV block and rank, named by the block's
prefix-cache hash, under a directory named by the model and KV layout (`tier_directory`), so that
an engine restarted on the same model, or another instance of it on this host, finds them.

A file is `MAGIC`, a 4-byte header length, a JSON header (layout key, block hash, rank, payload
size, CRC-32 of the payload) and the payload: the block's bytes of every KV tensor of the rank, in
the runner's order. Pure Python: the engine validates files with it before counting them as hits
(`read_block_file`), the model runner writes and reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

MAGIC = b"SPLITSERVE-KV\x01"
SUFFIX = ".kv"


class TierFileError(ValueError):
    """A disk-tier file that must not be served: unreadable, cut short, corrupt or another layout's."""


def layout_key(fields: dict) -> str:
    """A short name for everything that makes KV blocks interchangeable (model weights, dtypes,
    block size, parallel layout): blocks are only ever read back under the same key."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def tier_directory(root: str, key: str) -> str:
    return os.path.join(root, key)


def block_path(directory: str, block_hash_hex: str, rank: int) -> str:
    return os.path.join(directory, f"{block_hash_hex}.rank{rank}{SUFFIX}")


def parse_block_name(name: str) -> tuple[str, int] | None:
    """(hash hex, rank) of a block file's name; None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    stem, _, rank = name[: -len(SUFFIX)].rpartition(".rank")
    if not stem or not rank.isdigit() or len(stem) != 64:
        return None
    return stem, int(rank)


def write_block_file(path: str, key: str, block_hash_hex: str, rank: int, payload: bytes) -> None:
    """Write atomically (a temporary name, then a rename): a reader sees the whole file or none."""
    header = json.dumps(
        {"key": key, "hash": block_hash_hex, "rank": rank, "nbytes": len(payload), "crc32": zlib.crc32(payload)}
    ).encode()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        f.write(payload)
    os.replace(tmp, path)


def read_block_file(path: str, key: str, block_hash_hex: str, rank: int) -> bytes:
    """The payload of a block file, after checking everything the header says; TierFileError
    naming what is wrong otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TierFileError(f"{path}: cannot be read ({e.strerror or e})") from e
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise TierFileError(f"{path}: not a splitserve KV block file")
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start : start + length])
    except ValueError as e:
        raise TierFileError(f"{path}: its header is not valid JSON") from e
    payload = data[start + length :]
    expected = {"key": key, "hash": block_hash_hex, "rank": rank}
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
        raise TierFileError(f"{path}: written for another model, layout or block")
    if header.get("nbytes") != len(payload):
        raise TierFileError(f"{path}: cut short ({len(payload)} of {header.get('nbytes')} bytes)")
    if header.get("crc32") != zlib.crc32(payload):
        raise TierFileError(f"{path}: its checksum does not match (corrupt)")
    return payload
