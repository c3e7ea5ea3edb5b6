"""Files and directories written into place: a temp directory or file made with the umask's
permissions (a cache another user shares stays readable), and a content-addressed directory built
once (a crash leaves nothing, a concurrent identical build wins)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from oracle.cache import store as cache
from oracle.cache.store import cache_root


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def temp_dir(parent: Path, prefix: str | None = None) -> Path:
    """A new directory in `parent` to build in and rename into place, with the permissions
    mkdir gives (the umask's), not mkdtemp's 0700: a cache or output another user shares
    stays readable. The default prefix names the writer (models/cache.temp_prefix)."""
    d = Path(tempfile.mkdtemp(prefix=cache.temp_prefix() if prefix is None else prefix, dir=parent))
    os.chmod(d, 0o777 & ~_umask())
    return d


def temp_file(parent: Path, prefix: str = ".tmp-", suffix: str = "") -> tuple[int, str]:
    """mkstemp in `parent` (fd, path), with the permissions open() gives (the umask's), not 0600."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=parent)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, path


def cached_dir(recipe: dict, stem: str, recipe_file: str, build, needed=None, build_it: bool = True) -> Path | None:
    """cache_root()/checkpoints/<stem>-<hash of recipe>: built once by `build(dir)` into a temp
    dir and renamed into place (a crash leaves nothing; a concurrent identical build wins; a killed
    one leaves a directory models/cache.remove_stale_temps removes). `needed` (bytes, or a function
    giving them): its size, refused before it is built where it cannot fit in the cache
    (oracle/cache/store.py). `build_it` False: None where it is not built."""
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:20]
    final = cache_root() / "checkpoints" / f"{stem}-{key}"
    if (final / "config.json").is_file():
        cache.hold(final)  # never evicted while this process runs
        cache.mark_used(final)
        return final
    if not build_it:
        return None
    cache.hold(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if needed is not None:
        cache.make_room(needed() if callable(needed) else needed, f"the checkpoint {stem}")
    tmp = temp_dir(final.parent)
    try:
        build(tmp)
        (tmp / recipe_file).write_text(json.dumps(recipe, indent=1, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cache.mark_used(final)
    cache.enforce_quietly(final)
    return final
