"""The artifact cache: content-addressed, atomic, and a corrupted entry is rebuilt."""

from oracle.cache.artifacts import cached_artifact, write_manifest


def test_cache_hit_miss_and_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    builds = []

    def build(path):
        builds.append(path)
        path.write_bytes(b"program")

    a = cached_artifact("t", {"x": 1}, "p.bin", build)
    b = cached_artifact("t", {"x": 1}, "p.bin", build)
    assert (a.cached, b.cached, len(builds)) == (False, True, 1) and a.sha256 == b.sha256
    assert cached_artifact("t", {"x": 2}, "p.bin", build).cached is False  # another key
    with open(b.path, "wb") as f:
        f.write(b"bit rot")
    c = cached_artifact("t", {"x": 1}, "p.bin", build)
    assert c.cached is False and c.sha256 == a.sha256 and len(builds) == 3


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))

    def build(path):
        path.write_bytes(b"half")
        raise RuntimeError("compiler crashed")

    try:
        cached_artifact("t", {"x": 1}, "p.bin", build)
    except RuntimeError:
        pass
    assert list((tmp_path / "artifacts" / "t").iterdir()) == []


def test_manifest(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"abc")
    m = write_manifest(tmp_path, "olmoe", {"a": 1}, {"precision": "fp32"}, [f])
    import json

    doc = json.loads(m.read_text())
    assert doc["files"]["model.bin"]["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def _slow_build(cache: str, log: str) -> None:
    import os
    import time

    os.environ["MOE_ORACLE_CACHE"] = cache

    def build(path):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(1.0)
        path.write_bytes(b"program")

    cached_artifact("t", {"x": 1}, "p.bin", build)


def test_concurrent_builds_of_one_key_build_once(tmp_path):
    """Two processes asking for the same missing artifact (parallel checks or tests): one builds,
    the other waits for it and takes it from the cache."""
    import multiprocessing

    log = tmp_path / "builds.txt"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_slow_build, args=(str(tmp_path / "cache"), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "built\n"
    entries = list((tmp_path / "cache" / "artifacts" / "t").iterdir())  # the one entry, no temp dir left
    assert len(entries) == 1 and (entries[0] / "p.bin").read_bytes() == b"program"


def test_cache_entries_and_reports_get_the_umasks_permissions_not_the_temp_files(tmp_path, monkeypatch):
    """Built in a temp directory or file and renamed into place, an entry would keep mkdtemp's
    0700 (mkstemp's 0600): another user sharing the cache, or a web server showing a report,
    could not read it. Here they get what mkdir and open give under the umask."""
    import os
    from pathlib import Path

    from oracle.reports.result import write_atomic

    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    old = os.umask(0o022)
    try:
        a = cached_artifact("t", {"x": 1}, "p.bin", lambda p: p.write_bytes(b"program"))
        write_atomic(tmp_path / "report.json", "{}\n")
        os.umask(0o027)
        write_atomic(tmp_path / "private.json", "{}\n")
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert (mode(Path(a.path).parent), mode(Path(a.path))) == (0o755, 0o644)
    assert (mode(tmp_path / "report.json"), mode(tmp_path / "private.json")) == (0o644, 0o640)
