"""The artifact cache, bounded: what it holds, least-recently-used eviction, and `oracle cache`
(here, below the harness: models, oracle and exporters all write it).

Entries are the cache's units of reuse: a built artifact (`artifacts/<namespace>/<key>/`: a program,
a GGUF, an mlx directory), a checkpoint it wrote (`checkpoints/<name>/`: tiny and `--config`
checkpoints, a shipped file dequantized, a faulted copy), a captured reference or noise measurement
(`references/<key>.*`, `noise/<key>.*`). Each is used, found again by content (oracle/cache/artifacts.py),
and marked used then (the mtime of its `.used` file): least recently used first out.

The limit (`MOE_ORACLE_CACHE_LIMIT`, or `--cache-limit` on the commands that build, default
`DEFAULT_LIMIT`) is kept after each new entry: the least recently used entries no process holds are
removed until the cache is within it. A process holds an entry (a shared flock on its lock file,
`locks/<entry>.lock`) from when it finds or builds it until it exits: a running check's programs and
GGUFs are never removed under it. A check whose artifacts would not fit in the limit, or on the disk,
is refused before it builds (`refusal`: exit 2 with the sizes).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path


def cache_root() -> Path:
    """$MOE_ORACLE_CACHE, default ~/.cache/moe-oracle."""
    return Path(os.environ.get("MOE_ORACLE_CACHE", Path.home() / ".cache" / "moe-oracle"))


DEFAULT_LIMIT = 32 << 30  # 32 GiB: a laptop's share; real-width llama.cpp checks once left 38 GB of GGUFs
ENV = "MOE_ORACLE_CACHE_LIMIT"
USED = ".used"
_HELD: dict[str, int] = {}  # lock file -> fd this process holds shared (released when it exits), oldest first
MAX_HELD = 256  # a long self-test holds its latest entries only (each lock is an open file descriptor)


def parse_size(text: str) -> int:
    """'32G', '500M', '1.5T', '1048576' -> bytes (binary units, an optional trailing B or iB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 20G, 500M, 1T, or bytes)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def limit() -> int:
    """The cache's size limit in bytes: MOE_ORACLE_CACHE_LIMIT (which --cache-limit sets for the command
    and its children), else DEFAULT_LIMIT."""
    env = os.environ.get(ENV)
    if env:
        try:
            return parse_size(env)
        except ValueError as e:
            raise ValueError(f"{ENV}: {e}") from None
    return DEFAULT_LIMIT


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


@dataclass
class Entry:
    name: str  # relative to the cache root: artifacts/iree/<key>, checkpoints/tiny-..., noise/<key>
    kind: str  # artifacts/<namespace>, checkpoints, references, noise
    paths: list  # what removing it removes
    bytes: int
    last_used: float  # seconds since the epoch
    held: bool = False  # a running process holds it (never evicted)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["paths"] = [str(p) for p in self.paths]
        return d


def size_of(p: Path) -> int:
    """Bytes of a file, or of the files under a directory (links not followed; a file gone meanwhile: 0)."""
    if p.is_file():
        return p.stat().st_size
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def group_files(path: Path) -> list[Path]:
    """The files of the file-group entry at `path` (references/<key>.*, noise/<key>.*)."""
    return list(path.parent.glob(path.name.split(".", 1)[0] + ".*"))


def entry_bytes(path: Path) -> int:
    """Bytes of the entry at `path`: a directory's files, or a file group's."""
    if path.is_dir():
        return size_of(path)
    return sum(size_of(f) for f in group_files(path))


def _used(paths: list) -> float:
    stamps = []
    for p in paths:
        marker = p / USED if p.is_dir() else p
        for q in (marker, p):
            try:
                stamps.append(q.stat().st_mtime)
                break
            except OSError:
                continue
    return max(stamps, default=0.0)


def lock_file(name: str) -> Path:
    return cache_root() / "locks" / (name.replace("/", "-") + ".lock")


def entries(root: Path | None = None) -> list[Entry]:
    """Every entry of the cache, least recently used first."""
    root = Path(root or cache_root())
    out = []
    art = root / "artifacts"
    for ns in sorted(art.iterdir()) if art.is_dir() else ():
        for d in sorted(ns.iterdir()) if ns.is_dir() else ():
            if d.is_dir() and not d.name.startswith(".tmp-"):
                out.append(Entry(f"artifacts/{ns.name}/{d.name}", f"artifacts/{ns.name}", [d], 0, 0.0))
    ck = root / "checkpoints"
    for d in sorted(ck.iterdir()) if ck.is_dir() else ():
        if d.is_dir() and not d.name.startswith(".tmp-"):
            out.append(Entry(f"checkpoints/{d.name}", "checkpoints", [d], 0, 0.0))
    for kind in ("references", "noise"):
        base = root / kind
        groups: dict = {}
        for f in sorted(base.iterdir()) if base.is_dir() else ():
            if f.is_file():
                groups.setdefault(f.name.split(".", 1)[0], []).append(f)
        for stem, files in groups.items():
            out.append(Entry(f"{kind}/{stem}", kind, files, 0, 0.0))
    for e in out:
        e.bytes = sum(size_of(p) for p in e.paths)
        e.last_used = _used(e.paths)
        e.held = _held_by_another(e.name)
    return sorted(out, key=lambda e: e.last_used)


def _held_by_another(name: str) -> bool:
    """Whether a process holds the entry (its lock file, shared or exclusive), this one included."""
    import fcntl

    path = lock_file(name)
    if str(path) in _HELD:
        return True
    if not path.exists():
        return False
    try:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
        return False
    except OSError:
        return True


def _name(path: Path) -> str | None:
    """The entry a path under the cache root belongs to (artifacts/<ns>/<key>, checkpoints/<dir>,
    references/<stem>, noise/<stem>), or None outside it."""
    try:
        rel = Path(path).relative_to(cache_root()).parts
    except ValueError:
        return None
    if len(rel) >= 3 and rel[0] == "artifacts":
        return "/".join(rel[:3])
    if len(rel) >= 2 and rel[0] in ("checkpoints", "references", "noise"):
        return f"{rel[0]}/{rel[1] if rel[0] == 'checkpoints' else rel[1].split('.', 1)[0]}"
    return None


def hold(path: Path) -> None:
    """Hold the cache entry `path` belongs to for the rest of this process: a shared flock on its lock
    file, which eviction (an exclusive lock taken without waiting) passes by. Taken before the entry is
    looked up or built, so nothing removes it between finding it and using it."""
    import fcntl

    name = _name(path)
    if name is None:
        return
    lf = lock_file(name)
    if str(lf) in _HELD:
        _HELD[str(lf)] = _HELD.pop(str(lf))  # the most recent now
        return
    try:
        lf.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lf, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _HELD[str(lf)] = fd
    except OSError:
        return  # a read-only cache: nothing is evicted from it by us either
    while len(_HELD) > MAX_HELD:  # the oldest hold goes (closing the descriptor releases its lock)
        os.close(_HELD.pop(next(iter(_HELD))))


def mark_used(path: Path) -> None:
    """Mark the entry used now (least recently used goes first): a directory's `.used` file, a file
    group's (references/<key>.*) files' mtimes."""
    path = Path(path)
    try:
        if path.is_dir():
            (path / USED).touch()
        else:
            for f in group_files(path):
                os.utime(f)
    except OSError:
        pass  # a read-only cache: nothing to mark


def use(path: Path) -> None:
    """hold and mark_used."""
    hold(path)
    mark_used(path)


def total_bytes(root: Path | None = None) -> int:
    return sum(e.bytes for e in entries(root))


def prune(entries_to_remove: list[Entry]) -> list[Entry]:
    """Remove these entries (each under an exclusive lock taken without waiting: one a process holds
    now is kept); returns those removed."""
    import fcntl

    removed = []
    for e in entries_to_remove:
        lf = lock_file(e.name)
        if str(lf) in _HELD:
            continue
        try:
            lf.parent.mkdir(parents=True, exist_ok=True)
            with open(lf, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                for p in e.paths:
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                fcntl.flock(f, fcntl.LOCK_UN)
            removed.append(e)
        except OSError:
            continue  # held: kept
    return removed


def temp_prefix() -> str:
    """`.tmp-<host>-<pid>-`: a build directory (oracle.cache.files.temp_dir) names its writer, so one left
    by a killed process is known stale (remove_stale_temps)."""
    import socket

    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40]
    return f".tmp-{host}-{os.getpid()}-"


TEMP = re.compile(r"^\.tmp-([A-Za-z0-9_.]+)-(\d+)-")  # oracle.cache.store.temp_prefix: host, pid
LEGACY_TEMP_AGE = 86400.0  # a build directory that does not name its writer: stale after a day untouched


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def stale_temps(root: Path | None = None) -> list[Path]:
    """Build directories (`.tmp-*` beside the checkpoints and artifacts) whose writer is gone: a process
    killed while building (SIGKILL, a timeout) leaves its partial copy there, outside every entry (a
    seeded 30B checkpoint killed after 5 minutes left 41 GB). Stale: its writer, on this host, is not
    running; one that does not name its writer, untouched for a day."""
    root = Path(root or cache_root())
    host = temp_prefix().split("-")[1]
    dirs = [root / "checkpoints", *(d for d in (root / "artifacts").glob("*") if d.is_dir())]
    out = []
    for parent in dirs:
        for d in parent.glob(".tmp-*") if parent.is_dir() else ():
            m = TEMP.match(d.name)
            if m:
                if m.group(1) == host and not _alive(int(m.group(2))):
                    out.append(d)
            elif time.time() - _used([d]) > LEGACY_TEMP_AGE:
                out.append(d)
    return out


def remove_stale_temps(root: Path | None = None) -> int:
    """Remove stale_temps; returns the bytes freed."""
    freed = 0
    for d in stale_temps(root):
        freed += size_of(d)
        shutil.rmtree(d, ignore_errors=True)
    return freed


def enforce(size_limit: int | None = None) -> list[Entry]:
    """Keep the cache within its limit: remove least recently used entries no process holds until the
    total is at most the limit (what is held stays, even above it). Returns the entries removed. Stale
    build directories go first (remove_stale_temps)."""
    remove_stale_temps()
    return _evict(limit() if size_limit is None else size_limit)


def quick_total(root: Path | None = None) -> int:
    """The bytes of every entry's files (what `entries` sums, build directories included: an upper
    bound), by one directory walk: no lock file opened, no path sorted. A cache within its limit by
    this count needs nothing more (the common case, after each new entry: `entries` of a cache of
    10,000 entries takes a second or two)."""
    root = Path(root or cache_root())
    return sum(size_of(root / k) for k in ("artifacts", "checkpoints", "references", "noise"))


# After a new entry, the whole cache is counted again (quick_total walks every file) only where this
# process's last count is older than RECOUNT_S or that count plus what the process added since passes
# RECOUNT_SHARE of the limit: a self-test keeps hundreds of small noise measurements, and walking a cache of
# thousands of files after each took 10 s of its 114 (eager, 2026-11-29). Another process's additions within
# that minute can take the cache past its limit until the next count; a build's make_room always counts.
RECOUNT_S = 60.0
RECOUNT_SHARE = 0.9
_COUNTED: dict = {}  # cache root -> (time.monotonic() of this process's last count, its bytes + those added since)


def _counted_within(added: int, cap: int) -> bool:
    """Whether this process's recent count, with `added` bytes more, is still within RECOUNT_SHARE of `cap`
    (then the count is carried forward instead of walked again)."""
    root = str(cache_root())
    last = _COUNTED.get(root)
    if last is None or time.monotonic() - last[0] > RECOUNT_S or last[1] + added > RECOUNT_SHARE * cap:
        return False
    _COUNTED[root] = (last[0], last[1] + added)
    return True


def _evict(cap: int) -> list[Entry]:
    root, at = str(cache_root()), time.monotonic()
    total = quick_total()
    _COUNTED[root] = (at, total)
    if total <= cap:
        return []
    es = entries()
    total = sum(e.bytes for e in es)
    if total <= cap:
        return []
    removed = prune(least_recently_used(es, total, cap))
    _COUNTED[root] = (at, total - sum(e.bytes for e in removed))
    return removed


def least_recently_used(candidates: list[Entry], total: int, cap: int) -> list[Entry]:
    """Of `candidates` (least recently used first), those no process holds, in order, until `total`
    less their bytes is at most `cap`."""
    chosen = []
    for e in candidates:
        if total <= cap:
            break
        if not e.held:
            chosen.append(e)
            total -= e.bytes
    return chosen


class CacheFull(ValueError):
    """An artifact that cannot fit in the cache's limit or on its disk: refused before it is built
    (the harness's bad input: exit 2, with the sizes)."""


def enforce_quietly(added: Path | None = None) -> None:
    """enforce() after the entry `added` was written (not again where this process counted the cache within
    the last RECOUNT_S and it stays well within its limit with that entry), a cache it cannot read or a limit
    it cannot parse changing nothing (the check that built the artifact goes on; `oracle cache` says what is
    wrong)."""
    try:
        if added is not None and _counted_within(entry_bytes(Path(added)), limit()):
            return
        enforce()
    except (OSError, ValueError):
        pass


def make_room(needed: int, what: str) -> None:
    """Before building an artifact of about `needed` bytes: refuse it (CacheFull) where it cannot fit,
    else evict least recently used entries no process holds until it fits within the limit."""
    try:
        remove_stale_temps()  # before the disk's free space is read
    except OSError:
        pass
    why = refusal(needed, what)
    if why:
        raise CacheFull(why)
    try:
        _evict(max(0, limit() - needed))  # (stale build directories went above)
    except OSError:
        pass


def estimate(parameters: int, dtype: str) -> int:
    """An artifact's size from the checkpoint's parameter count: its weights at `dtype` (fp32/f32 4
    bytes, bf16/fp16/f16 2, a quantized qN type about (N + 0.5) / 8 with its scales: q8 1.06, q4_k_m
    0.56), plus 5 % for code and metadata. An unknown name: 4 (the most a weight takes)."""
    m = re.match(r"q(\d)", dtype.lower())
    per = (int(m.group(1)) + 0.5) / 8 if m else {"bf16": 2.0, "fp16": 2.0, "f16": 2.0}.get(dtype.lower(), 4.0)
    return int(parameters * per * 1.05)


def refusal(needed: int, what: str) -> str | None:
    """Why an artifact of `needed` bytes cannot be built here (the limit, or the disk's free space with
    what eviction could free), or None."""
    cap = limit()
    if needed > cap:
        return (f"{what} needs about {human(needed)} in the artifact cache, more than its limit of {human(cap)} "
                f"(set {ENV} or --cache-limit higher, or `oracle cache prune`)")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if needed <= free:
        return None
    evictable = sum(e.bytes for e in entries() if not e.held)
    if needed > free + evictable:
        return (f"{what} needs about {human(needed)} in the artifact cache ({root}); the disk has {human(free)} "
                f"free and the cache could free {human(evictable)}")
    return None


def age_text(seconds: float) -> str:
    d = max(0.0, time.time() - seconds)
    for unit, s in (("d", 86400), ("h", 3600), ("min", 60)):
        if d >= s:
            return f"{d / s:.1f} {unit}"
    return f"{d:.0f} s"
