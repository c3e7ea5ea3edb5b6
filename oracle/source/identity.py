"""A checkpoint's identity: the sha256 of its config and weight files, computed in one streamed
pass that also checks every floating tensor for NaN/Inf, cached like git's index by each file's path,
size and mtime."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from models.checkpoint import CheckpointError, shard_files
from oracle.cache.files import temp_file
from oracle.cache.store import cache_root

# bit patterns of a non-finite value (exponent all ones) per floating dtype: (uint view, mask)
_NONFINITE_BITS = {"F64": (np.uint64, 0x7FF0000000000000), "F32": (np.uint32, 0x7F800000),
                   "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80),
                   "F8_E4M3": (np.uint8, 0x7F), "F8_E5M2": (np.uint8, 0x7C)}


_CHUNK = 64 << 20  # bytes read at a time (a multiple of every element size)


def _scan_file(path: Path, h) -> list[tuple[str, int]]:
    """Feed the file's bytes to `h` in order, one pass, and count the non-finite values of
    every floating tensor on the way: [(tensor name, count)] of the bad ones."""
    bad = []
    with open(path, "rb") as f:
        if path.suffix != ".safetensors":
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
            return bad
        head = f.read(8)
        n = int.from_bytes(head, "little")
        header_bytes = f.read(n)
        h.update(head)
        h.update(header_bytes)
        header = json.loads(header_bytes)
        header.pop("__metadata__", None)
        pos = 0  # relative to the data section
        for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = t["data_offsets"]
            if begin > pos:
                h.update(f.read(begin - pos))
            view = _NONFINITE_BITS.get(t["dtype"])
            count = 0
            for start in range(begin, end, _CHUNK):
                chunk = f.read(min(_CHUNK, end - start))
                h.update(chunk)
                if view is not None:
                    bits = np.frombuffer(chunk, dtype=view[0])
                    count += int(np.count_nonzero((bits & view[1]) == view[1]))
            pos = max(pos, end)
            if count:
                bad.append((name, count))
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return bad


def _identity_stamp(model_dir: Path) -> tuple[list[Path], list, Path]:
    """The files of a checkpoint's identity, their (name, size, mtime) and the cache entry."""
    files = [model_dir / "config.json", *shard_files(model_dir)]
    stamp = []
    for p in files:
        try:
            st = p.stat()
            stamp.append([p.name, st.st_size, st.st_mtime_ns])
        except OSError as e:
            raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
    entry = cache_root() / "identities" / (hashlib.sha256(str(model_dir).encode()).hexdigest()[:24] + ".json")
    return files, stamp, entry


def cached_identity(model_dir: Path) -> str | None:
    """The checkpoint's sha256 from the identity cache when no file changed (path, size, mtime),
    else None: reads no tensor data."""
    _, stamp, entry = _identity_stamp(Path(model_dir).resolve())
    return _identity_entry(entry, stamp)


def _identity_entry(entry: Path, stamp: list) -> str | None:
    try:
        doc = json.loads(entry.read_text())
        return doc["sha256"] if doc.get("files") == stamp else None
    except (OSError, ValueError, KeyError):
        return None


def checkpoint_identity(model_dir: Path) -> str:
    """The checkpoint's sha256 (config.json and the weight files, names and bytes), computed
    in one streamed pass that also checks every floating tensor for NaN/Inf (a non-finite
    weight is an error naming the tensor: the checkpoint is bad, not the backend).

    Cached like git's index: keyed by each file's path, size and mtime, so a second check of
    an unchanged directory reads no tensor data."""
    model_dir = Path(model_dir).resolve()
    files, stamp, entry = _identity_stamp(model_dir)
    known = _identity_entry(entry, stamp)
    if known:
        return known
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        try:
            bad = _scan_file(p, h)
        except PermissionError as e:
            raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{p}: truncated or corrupt file ({type(e).__name__}: {e})") from None
        if bad:
            name, count = bad[0]
            more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
            raise CheckpointError(f"checkpoint tensor {name} in {p.name} has {count} NaN/Inf value(s){more}: "
                                  "the checkpoint is bad, no backend can be judged on it")
    digest = h.hexdigest()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_file(entry.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"dir": str(model_dir), "files": stamp, "sha256": digest}) + "\n")
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache: the identity is recomputed next time
    return digest
