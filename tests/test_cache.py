"""The bounded artifact cache (oracle/cache/store.py): least recently used entries go past the limit, an
entry another running process holds stays, an artifact that cannot fit is refused before it is built,
and `oracle cache list|prune`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oracle.cache import store as cache
from oracle.cache.artifacts import cached_artifact

ROOT = Path(__file__).resolve().parents[1]
KIB = 1024


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(cache.ENV, raising=False)
    monkeypatch.setattr(cache, "_HELD", {})  # this test's holds only
    monkeypatch.setattr(cache, "_COUNTED", {})  # and its counts
    return tmp_path / "cache"


def entry(root: Path, ns: str, key: str, size: int, used: float) -> Path:
    """An artifact entry of `size` bytes last used at `used` (seconds since the epoch)."""
    d = root / "artifacts" / ns / key
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(b"\0" * size)
    (d / cache.USED).touch()
    os.utime(d / cache.USED, (used, used))
    return d


HOLDER = """
import sys
from oracle.cache import store as cache
cache.hold(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
"""


def test_full_cache_loses_its_oldest_unheld_entries_and_keeps_a_held_one(root):
    now = time.time()
    paths = [entry(root, "iree", f"k{i}", 100 * KIB, now - 1000 + i * 100) for i in range(6)]  # k0 oldest
    assert cache.total_bytes() == 600 * KIB
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(paths[0])], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        held = {e.name: e.held for e in cache.entries()}
        assert held["artifacts/iree/k0"] and not held["artifacts/iree/k1"]
        removed = cache.enforce(350 * KIB)
        # k0 is the oldest but held by the running process: k1, k2, k3 go (the total then 300 KiB)
        assert sorted(e.name for e in removed) == ["artifacts/iree/k1", "artifacts/iree/k2", "artifacts/iree/k3"]
        assert [p.exists() for p in paths] == [True, False, False, False, True, True]
        assert cache.total_bytes() == 300 * KIB
    finally:
        holder.communicate("\n", timeout=60)
    # the holder gone, its entry is the oldest and goes first
    assert [e.name for e in cache.enforce(250 * KIB)] == ["artifacts/iree/k0"]


def test_the_quick_total_is_what_the_entries_hold_and_decides_nothing_under_the_limit(root, monkeypatch):
    now = time.time()
    for i in range(3):
        entry(root, "iree", f"k{i}", 100 * KIB, now - i)
    (root / "noise").mkdir(parents=True)
    (root / "noise" / "abc.npz").write_bytes(b"\0" * 7 * KIB)
    (root / "noise" / "abc.json").write_bytes(b"\0" * KIB)
    assert cache.quick_total() == cache.total_bytes() == 308 * KIB
    # within the limit by the walk: the entries (lock files, ages) are not read at all
    monkeypatch.setattr(cache, "entries", lambda root=None: pytest.fail("entries read under the limit"))
    assert cache.enforce(400 * KIB) == []


def test_small_entries_after_a_recent_count_are_added_to_it_until_near_the_limit(root, monkeypatch):
    """enforce_quietly(new entry): the first counts the cache (one walk); the next entries, while the count
    plus them stays within RECOUNT_SHARE of the limit, are added to that count without a walk; the entry that
    passes it walks again and evicts the least recently used; a count older than RECOUNT_S walks again."""
    monkeypatch.setenv(cache.ENV, "500K")
    walks = []
    quick_total = cache.quick_total
    monkeypatch.setattr(cache, "quick_total", lambda root=None: walks.append(1) or quick_total(root))
    now = time.time()
    paths = [entry(root, "iree", f"k{i}", 100 * KIB, now - 1000 + i) for i in range(6)]  # k0 oldest
    (root / "noise").mkdir()
    (root / "noise" / "n.npz").write_bytes(b"\0" * 5 * KIB)  # a file group's bytes count too
    cache.enforce_quietly(root / "noise" / "n")
    assert len(walks) == 1 and not paths[0].exists() and not paths[1].exists()  # 605 KiB: k0, k1 evicted
    assert cache.total_bytes() == 405 * KIB
    big = entry(root, "iree", "big", 50 * KIB, now)
    cache.enforce_quietly(big)  # 405 + 50 > 450 (90 % of 500): walked again, 455 is within the limit
    assert len(walks) == 2 and cache.total_bytes() == 455 * KIB and paths[2].exists()
    small = entry(root, "iree", "small", 10 * KIB, now)
    cache.enforce_quietly(small)  # 455 counted, more than 450 with anything: walked again
    assert len(walks) == 3
    for p in paths[2:4]:
        cache.prune([e for e in cache.entries() if e.paths[0] == p])
    cache.enforce_quietly(small)  # 265 KiB counted now
    assert len(walks) == 4 and cache.total_bytes() == 265 * KIB
    tiny = entry(root, "iree", "tiny", 1 * KIB, now)
    cache.enforce_quietly(tiny)  # 265 + 1 <= 450: added to the count, no walk
    assert len(walks) == 4
    monkeypatch.setattr(cache, "RECOUNT_S", 0.0)
    cache.enforce_quietly(tiny)  # the count is too old
    assert len(walks) == 5


def test_an_entry_used_again_is_kept_over_an_older_one(root):
    now = time.time()
    a = entry(root, "llamacpp", "a", 100 * KIB, now - 500)
    b = entry(root, "llamacpp", "b", 100 * KIB, now - 400)
    cache.mark_used(a)  # used now: b is the least recently used
    assert [e.name for e in cache.enforce(150 * KIB)] == ["artifacts/llamacpp/b"]
    assert a.exists() and not b.exists()


def test_an_artifact_that_cannot_fit_is_refused_before_it_is_built(root, monkeypatch):
    monkeypatch.setenv(cache.ENV, "64K")
    built = []
    with pytest.raises(cache.CacheFull) as e:
        cached_artifact("iree", {"k": 1}, "model.vmfb", lambda p: built.append(p), needed=200 * KIB)
    assert not built
    assert "200.0 KiB" in str(e.value) and "64.0 KiB" in str(e.value)
    assert not (root / "artifacts" / "iree").exists() or not any((root / "artifacts" / "iree").iterdir())


def test_a_new_artifact_evicts_old_ones_to_fit_and_is_held(root, monkeypatch):
    now = time.time()
    old = [entry(root, "iree", f"old{i}", 100 * KIB, now - 1000 + i) for i in range(3)]
    monkeypatch.setenv(cache.ENV, "250K")
    art = cached_artifact("iree", {"k": 2}, "model.vmfb", lambda p: p.write_bytes(b"\1" * (100 * KIB)),
                          needed=100 * KIB)
    assert not art.cached and Path(art.path).is_file()
    assert [p.exists() for p in old] == [False, False, True]  # room made for 100 KiB within 250 KiB
    assert cache.total_bytes() <= 250 * KIB
    assert any(e.held for e in cache.entries() if e.name.endswith(Path(art.path).parent.name))


def oracle(*args, env):
    return subprocess.run([sys.executable, "-m", "oracle.cli", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)


def test_cache_cli_lists_and_prunes_by_backend_age_and_size(root):
    now = time.time()
    entry(root, "iree", "a", 10 * KIB, now - 10 * 86400)
    entry(root, "iree-points", "b", 10 * KIB, now - 5)
    entry(root, "llamacpp", "c", 30 * KIB, now - 3 * 86400)
    entry(root, "executorch", "d", 20 * KIB, now - 60)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = oracle("cache", "list", "--json", env=env)
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert [e["name"] for e in doc["entries"]] == ["artifacts/iree/a", "artifacts/llamacpp/c",
                                                   "artifacts/executorch/d", "artifacts/iree-points/b"]
    assert doc["bytes"] == 70 * KIB
    got = oracle("cache", "prune", "--older-than", "2", "--dry-run", env=env)
    assert got.returncode == 0 and "would remove 2 entries" in got.stdout
    assert (root / "artifacts/iree/a").exists()
    got = oracle("cache", "prune", "--backend", "iree-llvm-cpu", "--older-than", "2", env=env)
    assert got.returncode == 0, got.stderr
    assert not (root / "artifacts/iree/a").exists() and (root / "artifacts/iree-points/b").exists()
    assert (root / "artifacts/llamacpp/c").exists()
    got = oracle("cache", "prune", "--max-size", "35K", env=env)  # c (oldest) goes: 30 KiB left
    assert got.returncode == 0 and not (root / "artifacts/llamacpp/c").exists()
    assert (root / "artifacts/executorch/d").exists()
    got = oracle("cache", "prune", "--all", env=env)
    assert got.returncode == 0 and "removed 2 entries" in got.stdout
    assert cache.entries() == []
    for bad in (["prune", "--max-size", "lots"], ["prune", "--backend", "nosuch"], ["--cache-limit", "x", "list"]):
        got = oracle("cache", *bad, env=env)
        assert got.returncode == 2 and "error" in got.stderr, (bad, got.stderr)


def test_a_check_whose_artifact_cannot_fit_is_refused_with_the_sizes_before_it_builds(root):
    pytest.importorskip("llama_cpp")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = oracle("check", "--family", "olmoe", "--backend", "llamacpp", "--cache-limit", "64K", env=env)
    assert got.returncode == 2, got.stdout + got.stderr
    assert "64.0 KiB" in got.stderr and "needs about" in got.stderr
    assert not (root / "artifacts" / "llamacpp").exists() or not any((root / "artifacts" / "llamacpp").iterdir())


def test_a_long_run_holds_its_latest_entries_only(root, monkeypatch):
    """Each hold is an open descriptor: a self-test building hundreds of programs keeps the latest
    MAX_HELD held (its running check's), the older ones evictable again."""
    monkeypatch.setattr(cache, "MAX_HELD", 3)
    now = time.time()
    paths = [entry(root, "iree", f"k{i}", KIB, now - 100 + i) for i in range(5)]
    for p in paths:
        cache.hold(p)
    cache.hold(paths[1])  # used again: among the latest
    assert len(cache._HELD) == 3
    assert {e.name for e in cache.entries() if e.held} == {"artifacts/iree/k1", "artifacts/iree/k3", "artifacts/iree/k4"}


def test_a_build_directory_whose_writer_is_gone_is_removed(root):
    """A process killed while building (SIGKILL, a timeout) leaves its partial directory beside the
    entries, outside every one (a seeded 30B checkpoint killed after 5 minutes left 41 GB): the next
    eviction (or `oracle cache`) removes it where its writer, named in it, is not running; one whose
    writer runs stays, and one that does not name its writer stays until a day untouched."""
    from oracle.cache.store import temp_prefix
    from oracle.cache.files import temp_dir

    ck = root / "checkpoints"
    ck.mkdir(parents=True)
    host = temp_prefix().split("-")[1]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = ck / f".tmp-{host}-{int(gone.stdout)}-abc"
    mine = temp_dir(ck)  # this process's: running
    other_host = ck / f".tmp-elsewhere-{int(gone.stdout)}-abc"  # another machine's (a shared cache): not ours to judge
    old, fresh = ck / ".tmp-legacy1", ck / ".tmp-legacy2"
    for d in (dead, other_host, old, fresh):
        d.mkdir()
    for d in (dead, mine, other_host, old, fresh):
        (d / "part.safetensors").write_bytes(b"\0" * 1000)
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    assert mine.name.startswith(f".tmp-{host}-{os.getpid()}-")
    assert sorted(cache.stale_temps()) == sorted([dead, old])
    assert cache.remove_stale_temps() == 2000
    assert not dead.exists() and not old.exists() and mine.exists() and other_host.exists() and fresh.exists()
    assert cache.stale_temps() == []


SLOW_BUILD = """
import sys, time
from oracle.cli.common import terminate_cleanly
from oracle.cache.files import cached_dir

def build(out):
    (out / "model.safetensors").write_bytes(b"0" * 100000)
    print("building", flush=True)
    time.sleep(120)

with terminate_cleanly():  # as `oracle` runs every command
    cached_dir({"slow": 1}, "slow", "recipe.json", build)
"""


def test_a_build_stopped_by_sigterm_leaves_nothing(root):
    """SIGTERM (a CI timeout, `timeout`) while `oracle` builds a cache entry exits through Python's exit,
    as Ctrl-C does: the partial directory goes, exit 143 (128 + SIGTERM)."""
    import signal

    env = {**os.environ, "MOE_ORACLE_CACHE": str(root), "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", SLOW_BUILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "building", p.stderr.read()[-2000:]
    assert len(list((root / "checkpoints").glob(".tmp-*"))) == 1
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143, p.stderr.read()[-2000:]
    assert not list((root / "checkpoints").glob(".tmp-*")) and not list((root / "checkpoints").glob("slow-*"))


def test_validate_only_of_a_config_not_built_writes_nothing_and_says_what_it_will_need(root):
    """--validate-only of a --config check whose seeded checkpoint is not built: the config checked and
    the plan (parameters, disk, memory), without writing the checkpoint; a plan that cannot fit is
    refused as the check would be (exit 2). The memory check is off: its 8.4 GiB are compared with what the
    host has free at that moment (measured: refused beside a self-test with 8.0 GiB free), and it has its
    own tests (tests/test_bad_inputs.py)."""
    env = {**os.environ, "MOE_ORACLE_CACHE": str(root), "MOE_ORACLE_MEMORY_CHECK": "off"}
    cmd = [sys.executable, "-m", "oracle", "check", "--config", "olmoe-1b-7b-0924", "--layers", "2",
           "--backend", "hf", "--precision", "bf16", "--validate-only"]
    out = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "not built yet" in out.stdout and "1.05 B parameters" in out.stdout  # as the built checkpoint's headers count (exporters/torch/hf.py) and "GiB of disk" in out.stdout
    assert not (root / "checkpoints").exists() or not any((root / "checkpoints").iterdir())
    out = subprocess.run(cmd + ["--cache-limit", "1G"], env=env, cwd=Path(__file__).parents[1], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "more than its limit" in out.stderr, out.stderr[-2000:]
