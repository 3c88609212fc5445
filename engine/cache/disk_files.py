"""The disk tier's files: one per checkpoint page (a block chain's segment of one block, or an exact checkpoint's
partial page), named by its key, with a header that says whose it is (docs/design.md, Host retention).

Layout: MAGIC, a 4-byte little-endian header length, the header (JSON: the core's identity, the key, the tokens it
covers, dtype, the page's shape, whether a snapshot follows and the parent block's key, the payload's BLAKE2b), then
the payload: the page's bytes in the host slot's layout, then for a hybrid model's exact checkpoint its recurrent-state
snapshot in the host snapshot row's. A file whose header does not parse, names another identity, dtype or shape, or
whose payload is short or does not match its checksum, is skipped and logged, never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("flare.engine")

MAGIC = b"FLAREKV1"
SUFFIX = ".kv"
MAX_HEADER = 4096


class UnreadableFile(Exception):
    pass


@dataclass(frozen=True)
class DiskEntry:
    """What a file holds: the tokens its checkpoint covers, and for a hybrid's exact checkpoint its snapshot and the
    key of the block before its own (b"": none), by which exact ends are found (HostTier.exact_ends)."""

    length: int
    snapshot: bool = False
    parent: bytes = b""


@dataclass(frozen=True)
class Layout:
    """What a file must match to be served: the core's cache identity, the page's dtype and shape, and the size of
    a snapshot (a hybrid model's; 0: none)."""

    identity: bytes
    dtype: str
    shape: tuple[int, ...]
    snapshot_bytes: int = 0

    @property
    def payload_bytes(self) -> int:
        count = 1
        for extent in self.shape:
            count *= extent
        return count * {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2,
                        "torch.float8_e4m3fn": 1}[self.dtype]


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def write(directory: Path, key: bytes, entry: DiskEntry, layout: Layout, page: bytes | memoryview,
          snapshot: bytes | None = None) -> None:
    """Write through a temporary name, so that a crash leaves no half file under the real one."""
    checksum = hashlib.blake2b(page, digest_size=16)
    if snapshot is not None:
        checksum.update(snapshot)
    header = json.dumps({"identity": layout.identity.hex(), "key": key.hex(), "length": entry.length,
                         "dtype": layout.dtype, "shape": list(layout.shape), "snapshot": snapshot is not None,
                         "parent": entry.parent.hex(), "checksum": checksum.hexdigest()}).encode()
    path = directory / file_name(key)
    temporary = path.with_suffix(".tmp")
    with open(temporary, "wb") as out:
        out.write(MAGIC + struct.pack("<I", len(header)) + header)
        out.write(page)
        if snapshot is not None:
            out.write(snapshot)
    os.replace(temporary, path)


def _header(handle, layout: Layout) -> dict:
    start = handle.read(len(MAGIC) + 4)
    if len(start) < len(MAGIC) + 4 or start[:len(MAGIC)] != MAGIC:
        raise UnreadableFile("not a KV page file")
    (size,) = struct.unpack("<I", start[len(MAGIC):])
    if size > MAX_HEADER:
        raise UnreadableFile("header too long")
    try:
        header = json.loads(handle.read(size))
        identity, dtype, shape = bytes.fromhex(header["identity"]), header["dtype"], tuple(header["shape"])
        int(header["length"]), bytes.fromhex(header["key"]), header["checksum"]
        header["entry"] = DiskEntry(int(header["length"]), bool(header.get("snapshot", False)),
                                    bytes.fromhex(header.get("parent", "")))
    except (ValueError, KeyError, TypeError) as exc:
        raise UnreadableFile(f"header unreadable: {exc}") from None
    if identity != layout.identity:
        raise UnreadableFile("another core's page")
    if (dtype, shape) != (layout.dtype, layout.shape):
        raise UnreadableFile(f"layout {dtype} {shape}, not {layout.dtype} {layout.shape}")
    if header["entry"].snapshot and not layout.snapshot_bytes:
        raise UnreadableFile("a snapshot, and the model has no recurrent state")
    return header


def read(directory: Path, key: bytes, layout: Layout) -> tuple[bytes, bytes | None]:
    """The page's payload and the snapshot's (None: the file has none), checked against its header and checksum."""
    path = directory / file_name(key)
    try:
        with open(path, "rb") as handle:
            header = _header(handle, layout)
            size = layout.payload_bytes + (layout.snapshot_bytes if header["entry"].snapshot else 0)
            payload = handle.read(size + 1)
    except OSError as exc:
        raise UnreadableFile(str(exc)) from None
    if header["key"] != key.hex():
        raise UnreadableFile("the header names another key")
    if len(payload) != size:
        raise UnreadableFile(f"payload of {len(payload)} bytes, not {size}")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["checksum"]:
        raise UnreadableFile("checksum mismatch")
    page = payload[:layout.payload_bytes]
    return page, payload[layout.payload_bytes:] if header["entry"].snapshot else None


def scan(directory: Path, layout: Layout) -> list[tuple[bytes, DiskEntry]]:
    """The key and entry of each file the core may serve, least recently written first; the others are logged and
    left alone (another core's files may share the directory)."""
    found: list[tuple[float, bytes, DiskEntry]] = []
    for path in directory.glob("*" + SUFFIX):
        try:
            with open(path, "rb") as handle:
                header = _header(handle, layout)
            key = bytes.fromhex(header["key"])
            if file_name(key) != path.name:
                raise UnreadableFile("the header names another key")
            found.append((path.stat().st_mtime, key, header["entry"]))
        except (OSError, UnreadableFile) as exc:
            log.warning("disk cache: skipping %s: %s", path.name, exc)
    return [(key, entry) for _, key, entry in sorted(found, key=lambda found: found[0])]
