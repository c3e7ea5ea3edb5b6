"""Compiled artifacts (.vmfb, .pte, ...), cached by content hash, and export manifests.

A key is the sha256 of everything that determines the artifact: the checkpoint's sha256,
the options, the fault/transform id, and the versions of the tools that build it. A second
identical check finds the artifact and builds nothing; the result says which it was.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from oracle.cache.store import cache_root
from oracle.cache.files import temp_dir


@dataclass
class Artifact:
    name: str
    path: str
    sha256: str
    cached: bool  # True: found in the cache, nothing was built
    build_s: float  # seconds spent building (0 when cached)

    def as_dict(self) -> dict:
        return asdict(self)


ROOT = Path(__file__).resolve().parents[2]  # the checkout (or the installed packages' directory)


def source_digest(*paths: str) -> str:
    """sha256 (16 hex digits) of the code that determines an artifact, read, not imported (a warm check
    imports no torch): each path relative to the checkout, a file, or a folder's modules (its *.py, by name)."""
    h = hashlib.sha256()
    for p in paths:
        path = ROOT / p
        for f in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]

def versions(*packages: str) -> dict:
    """{package: its installed version, or None}. Each package's is read once a process: the
    installed packages do not change under a running one (the modules it imported would not follow),
    and each lookup walks the distributions on the path (an eager check asked 19 times: 0.6 s of olmoe's
    25 checks' 8 s, profiled)."""
    return {p: _version(p) for p in packages}


@functools.cache
def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cached_json(namespace: str, parts: dict, compute: Callable[[], object]):
    """A small derived value (plain JSON data) cached under <cache>/<namespace>/<key>.json:
    read back when `parts` (everything it is derived from: inputs, code, versions) are the same,
    else `compute()`d and written."""
    value = json_get(namespace, parts)
    if value is None:
        value = compute()
        json_put(namespace, parts, value)
    return value


def json_get(namespace: str, parts: dict):
    """The value json_put stored for `parts`, or None."""
    try:
        return json.loads((cache_root() / namespace / f"{key_of(parts)}.json").read_text())
    except (OSError, ValueError):
        return None


def json_put(namespace: str, parts: dict, value) -> None:
    """Store `value` for `parts` (atomically; a read-only cache or a value that is not plain data:
    nothing stored, computed again next time)."""
    from oracle.reports.result import write_atomic

    try:
        write_atomic(cache_root() / namespace / f"{key_of(parts)}.json", json.dumps(value))  # its order kept
    except (OSError, TypeError):
        pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_artifact(namespace: str, parts: dict, filename: str, build: Callable[[Path], None],
                    name: str | None = None, needed: int | Callable[[], int] | None = None) -> Artifact:
    """The artifact for `parts`, built by `build(path)` into a temp dir on a miss and then
    moved into place atomically (a crashed build leaves nothing behind). The entry is held by this
    process from here on (oracle/cache/store.py: never evicted under it) and marked used; a miss whose
    `needed` bytes (the artifact's estimated size, or a function giving it) cannot fit in the cache's limit or on its disk is
    refused before it builds (cache.CacheFull), and after a build the cache is kept within its limit."""
    from oracle.cache import store as cache

    d = cache_root() / "artifacts" / namespace / key_of(parts)
    target = d / filename
    cache.hold(d)
    hit = _cached(d, target, name or filename)
    if hit:
        cache.mark_used(d)
        return hit
    d.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(d):
        hit = _cached(d, target, name or filename)
        if hit:
            cache.mark_used(d)
            return hit
        if needed is not None:
            cache.make_room(needed() if callable(needed) else needed, f"the {namespace} artifact {name or filename}")
        art = _build(d, parts, filename, build, name)
    cache.mark_used(d)
    cache.enforce_quietly(d)
    return art


def _cached(d: Path, target: Path, name: str) -> Artifact | None:
    if target.is_file() and (d / "sha256").is_file():
        digest = (d / "sha256").read_text().strip()
        if sha256_file(target) == digest:
            return Artifact(name, str(target), digest, True, 0.0)
        shutil.rmtree(d, ignore_errors=True)  # corrupted in the cache: build it again
    return None


@contextlib.contextmanager
def build_lock(d: Path):
    """One build of a cache entry at a time across processes (parallel checks, `matrix -j`,
    parallel tests): the second waits, then finds the first's artifact. An advisory lock on
    <cache>/locks/<namespace>-<key>.lock, released by the kernel if its holder dies; none where
    flock is missing."""
    try:
        import fcntl

        locks = cache_root() / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        f = open(locks / f"{d.parent.name}-{d.name}.lock", "a")
    except (ImportError, OSError):  # no flock here, or a read-only cache
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(d: Path, parts: dict, filename: str, build: Callable[[Path], None], name: str | None) -> Artifact:
    target = d / filename
    tmp = temp_dir(d.parent)
    try:
        t = time.perf_counter()
        build(tmp / filename)
        build_s = time.perf_counter() - t
        digest = sha256_file(tmp / filename)
        (tmp / "sha256").write_text(digest + "\n")
        (tmp / "key.json").write_text(json.dumps(parts, sort_keys=True, indent=1, default=str))
        if d.exists():  # a concurrent build won: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.rename(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Artifact(name or filename, str(target), digest, False, build_s)


def write_manifest(output_dir: Path, family: str, config: dict, options: dict, files: list[Path],
                   extra: dict | None = None) -> Path:
    """manifest.json beside exported files: family, config, options, sha256 of each file."""
    from oracle.reports.result import write_atomic

    doc = {
        "schema": "oracle-export/v1",
        "family": family,
        "config": config,
        "options": options,
        "files": {Path(f).name: {"sha256": sha256_file(Path(f)), "bytes": Path(f).stat().st_size} for f in files},
        **(extra or {}),
    }
    path = Path(output_dir) / "manifest.json"
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    return path
