"""oracle matrix / report merge / report diff / report.html / goldens / the nightly workflow."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from oracle.matrix import OUTPUTS, combos, shard

ROOT = Path(__file__).resolve().parents[1]
FAMS = "olmoe,mixtral"


def _strip(summary):
    return {k: v for k, v in summary.items() if k != "timings"}


SERIAL_STDOUT = []  # full_run's


@pytest.fixture(scope="module")
def full_run(cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    # -j 1: one check after the other, what test_parallel_run_equals_serial compares -j 2 with
    r = cli("matrix", "--families", FAMS, "--backends", "eager,hf", "-j", "1", "--report-dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    SERIAL_STDOUT.append(r.stdout)
    return out


def test_matrix_writes_every_output(full_run):
    for name in OUTPUTS:
        assert (full_run / name).is_file(), name
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["counts"]["pass"] == 4 and summary["status"] == "pass"
    assert len(list((full_run / "checks").glob("*.json"))) == 4
    junit = (full_run / "junit.xml").read_text()
    assert junit.count("<testcase") == 4 and "<failure" not in junit


def test_summary_and_report_open_with_the_grid(full_run):
    """Families down, backends across, one grid per precision, before the flat list of checks."""
    fams = FAMS.split(",")
    md = (full_run / "summary.md").read_text()
    grid = md.index("| family | eager | hf |")
    assert grid < md.index("| check | status |") and md.index("**fp32**") < grid
    for f in fams:
        assert f"| {f} | ✅ pass | ✅ pass |" in md
    html = (full_run / "report.html").read_text()
    assert html.index("<table class='grid'>") < html.index("All checks") < html.index("<section")
    assert html.count("<td class='cell c-pass'>") == 4
    assert f"href='#{fams[0]} / eager / fp32'" in html and f'<section id="{fams[0]} / eager / fp32">' in html


def test_two_shards_merged_equal_one_run(cli, full_run, tmp_path):
    for i in (1, 2):
        r = cli("matrix", "--families", FAMS, "--backends", "eager,hf", "--shard", f"{i}/2",
                "--report-dir", str(tmp_path / f"s{i}"))
        assert r.returncode == 0, r.stderr
    r = cli("report", "merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--report-dir", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    merged = json.loads((tmp_path / "m" / "summary.json").read_text())
    one = json.loads((full_run / "summary.json").read_text())
    assert _strip(merged) == _strip(one)
    for name in OUTPUTS:
        assert (tmp_path / "m" / name).is_file()


@pytest.mark.parametrize("second, needle", [
    (None, "not a matrix report directory (no summary.json in it)"),
    ('{"schema": "oracle-matrix/v1", "rows": 5}', "malformed summary rows"),
    ("{", "not JSON"),
])
def test_a_bad_shard_is_refused_and_nothing_is_merged(cli, full_run, tmp_path, second, needle):
    """Every shard read and merged before anything is written: the output holds no copied check
    of the good shard beside a missing summary."""
    bad = tmp_path / "bad"
    bad.mkdir()
    if second is not None:
        (bad / "summary.json").write_text(second)
    out = tmp_path / "m"
    r = cli("report", "merge", str(full_run), str(bad), "--report-dir", str(out))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists() or list(out.rglob("*")) == []


def test_shards_cover_the_matrix_once():
    cs = combos(["a", "b", "c"], ["x", "y"], ["fp32", "bf16"])
    parts = [shard(cs, i, 5) for i in range(1, 6)]
    assert sorted(c.id for p in parts for c in p) == sorted(c.id for c in cs)
    assert shard(cs, 2, 5) == shard(cs, 2, 5)  # deterministic


def test_hang_is_an_error_row(cli, tmp_path):
    """A hung check is killed with everything it started (its process group: a compiler it
    spawned does not outlive it) and is that check's error row."""
    pid_file = tmp_path / "child.pid"
    r = cli("matrix", "--families", "olmoe", "--backends", "tests.plugins:HANGS_WITH_CHILD", "--timeout", "8",
            "--report-dir", str(tmp_path / "m"), env={"ORACLE_TEST_CHILD_PID": str(pid_file)})
    assert r.returncode == 1  # the hang fails the matrix; the run itself finished
    rows = json.loads((tmp_path / "m" / "summary.json").read_text())["rows"]
    assert rows[0]["status"] == "error" and rows[0]["reason"] == "timed out after 8 s"
    _assert_killed(int(pid_file.read_text()))


def _assert_killed(child: int) -> None:
    import os
    import time

    for _ in range(50):  # reaped by init shortly after the kill
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").is_file() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break  # killed, a zombie waiting for its reaper
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hung check's child {child} survived the timeout")


def _same_reports(a: Path, b: Path) -> None:
    """The same rows and reports, timings aside (summary.json's, junit's time attributes)."""
    import re

    assert _strip(json.loads((a / "summary.json").read_text())) == _strip(json.loads((b / "summary.json").read_text()))
    assert (a / "summary.md").read_text() == (b / "summary.md").read_text()
    untimed = [re.sub(r' time="[0-9.]+"', "", (d / "junit.xml").read_text()) for d in (a, b)]
    assert untimed[0] == untimed[1]
    assert sorted(f.name for f in (a / "checks").iterdir()) == sorted(f.name for f in (b / "checks").iterdir())


def test_parallel_run_equals_serial(cli, full_run, tmp_path):
    """-j 2 reports what -j 1 (one check after the other: full_run, the default precisions fp32) does. (A -j 1
    run of its own here cost 8 s of a cold suite on 2 cores: issue 76's budget.)"""
    r = cli("matrix", "--families", FAMS, "--backends", "eager,hf", "--precisions", "fp32", "-j", "2",
            "--report-dir", str(tmp_path / "j2"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == SERIAL_STDOUT[0]
    summary = json.loads((tmp_path / "j2" / "summary.json").read_text())
    assert [row["id"] for row in summary["rows"]] == [c.id for c in combos(FAMS.split(","), ["eager", "hf"], ["fp32"])]
    assert summary["counts"]["pass"] == 4 and sorted(summary["timings"]) == [row["id"] for row in summary["rows"]]
    _same_reports(full_run, tmp_path / "j2")


def test_parallel_crash_and_hang_cost_only_their_rows(cli, tmp_path):
    """With -j 2 a crash (os._exit) and a hang (killed at --timeout with the process it
    started) are their checks' error rows; the checks beside them and after them pass."""
    pid_file = tmp_path / "child.pid"
    # --timeout: the hang holds its worker's core idle that long (the suite's wall time). 15 s (30 s
    # before): the two passing olmoe checks beside it took 1.7 s and 0.3 s forked, beside another job on
    # 2 cores (2026-11-28), a few seconds more where their checkpoint and reference are not yet cached
    r = cli("matrix", "--families", "olmoe", "--backends",
            "eager,examples.fp64_backend:BACKEND,tests.plugins:DIES,tests.plugins:HANGS_WITH_CHILD",
            "--timeout", "15", "-j", "2", "--report-dir", str(tmp_path / "m"),
            env={"ORACLE_TEST_CHILD_PID": str(pid_file)})
    assert r.returncode == 1, r.stdout + r.stderr  # the crash and the hang fail the matrix; the run finished
    rows = {row["id"]: row for row in json.loads((tmp_path / "m" / "summary.json").read_text())["rows"]}
    assert rows["olmoe__tests.plugins:DIES__fp32"]["status"] == "error"
    assert rows["olmoe__tests.plugins:DIES__fp32"]["reason"].startswith("exit 9")
    hang = rows["olmoe__tests.plugins:HANGS_WITH_CHILD__fp32"]
    assert hang["status"] == "error" and hang["reason"] == "timed out after 15 s"
    assert rows["olmoe__eager__fp32"]["status"] == "pass"
    assert rows["olmoe__examples.fp64_backend:BACKEND__fp32"]["status"] == "pass"
    _assert_killed(int(pid_file.read_text()))


def test_cold_processes_report_the_same(tmp_path, monkeypatch):
    """Where there is no warm fork server (warm=False: macOS), each check is a fresh
    interpreter, in parallel too, with the same rows."""
    from oracle.matrix import Combo, run_matrix, run_one

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cs = combos(["olmoe"], ["tests.plugins:DIES", "tests.plugins:UNAVAILABLE", "examples.fp64_backend:BACKEND"],
                ["fp32", "bf16"])
    summary = run_matrix(cs, tmp_path / "m", timeout=120, jobs=2, warm=False)
    rows = {row["id"]: row for row in summary["rows"]}
    assert rows["olmoe__tests.plugins:DIES__fp32"]["reason"] == "exit 9: exit 9"
    assert rows["olmoe__tests.plugins:UNAVAILABLE__bf16"]["status"] == "skipped"
    assert rows["olmoe__examples.fp64_backend:BACKEND__fp32"]["status"] == "pass"
    assert "does not support precision bf16" in rows["olmoe__examples.fp64_backend:BACKEND__bf16"]["reason"]
    row, secs = run_one(Combo("olmoe", "tests.plugins:DIES", "fp32"), tmp_path / "m", 120, 0, [])
    assert row == rows["olmoe__tests.plugins:DIES__fp32"] and secs > 0


def test_isolation_crash_skip_unsupported(cli, tmp_path):
    r = cli("matrix", "--families", "olmoe", "--backends",
            "tests.plugins:DIES,tests.plugins:UNAVAILABLE,examples.fp64_backend:BACKEND",
            "--precisions", "fp32,bf16", "--report-dir", str(tmp_path))
    assert r.returncode == 1  # the crash fails the matrix; the run itself finished
    rows = {row["id"]: row for row in json.loads((tmp_path / "summary.json").read_text())["rows"]}
    assert rows["olmoe__tests.plugins:DIES__fp32"]["status"] == "error"
    assert "exit 9" in rows["olmoe__tests.plugins:DIES__fp32"]["reason"]
    assert rows["olmoe__tests.plugins:UNAVAILABLE__fp32"]["status"] == "skipped"
    assert rows["olmoe__examples.fp64_backend:BACKEND__fp32"]["status"] == "pass"
    assert "does not support precision bf16" in rows["olmoe__examples.fp64_backend:BACKEND__bf16"]["reason"]
    junit = (tmp_path / "junit.xml").read_text()
    assert '<skipped message="needs a flux capacitor"' in junit and "<error" in junit


def test_diff_names_the_broken_backend(cli, tmp_path):
    args = ["matrix", "--families", "qwen3_moe", "--backends", "tests.plugins:SWITCHABLE"]
    assert cli(*args, "--report-dir", str(tmp_path / "base")).returncode == 0
    r = cli(*args, "--report-dir", str(tmp_path / "cur"), env={"ORACLE_TEST_BREAK": "qk_norm_missing"})
    assert r.returncode == 1
    d = cli("report", "diff", "--baseline", str(tmp_path / "base" / "summary.json"),
            "--current", str(tmp_path / "cur" / "summary.json"), "--format", "md")
    assert d.returncode == 1, d.stdout
    assert "regressions" in d.stdout and "qwen3_moe__tests.plugins:SWITCHABLE__fp32" in d.stdout
    assert "| pass | fail |" in d.stdout
    same = cli("report", "diff", "--baseline", str(tmp_path / "base" / "summary.json"),
               "--current", str(tmp_path / "base"))  # a run's --report-dir stands for its summary
    assert same.returncode == 0 and "no change" in same.stdout


def test_report_html_in_headless_chromium(full_run):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (Debian package chromium; .ci/run installs it)")
    shot = full_run / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={full_run / 'chromium-profile'}", "--window-size=1200,1600",
                    f"--screenshot={shot}", (full_run / "report.html").as_uri()],
                   capture_output=True, timeout=120)
    assert shot.is_file()
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1600)
    colors = img.getcolors(maxcolors=1 << 20)
    assert len(colors) > 200  # a rendered page with plots and tables, not a blank or error page
    # the plot's limit line and the green 'pass' cells are on the page
    px = set(img.getdata())
    assert any(r > 150 and g < 80 and b < 80 for r, g, b in px)  # red limit line
    assert any(g > 100 and r < 60 and b < 110 for r, g, b in px)  # green pass
    assert (200, 230, 201) in px  # the grid's pass cells (.c-pass background #c8e6c9)
    html = (full_run / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "First divergence" not in html


def test_goldens_check_passes_and_an_edit_fails(cli, tmp_path):
    r = cli("goldens", "check", "--backend", "eager", "--family", "qwen2_moe")
    assert r.returncode == 0, r.stdout + r.stderr  # the full `oracle goldens check` runs nightly
    golden = tmp_path / "goldens"
    shutil.copytree(ROOT / "goldens", golden)
    path = golden / "qwen2_moe" / "eager" / "tokens.json"
    doc = json.loads(path.read_text())
    doc["tokens"][4] = (doc["tokens"][4] + 1) % 256
    path.write_text(json.dumps(doc))
    r = cli("goldens", "check", "--backend", "eager", "--family", "qwen2_moe", env={"MOE_ORACLE_GOLDENS": str(golden)})
    assert r.returncode == 1
    assert "qwen2_moe/eager: golden token mismatch at position 4" in r.stdout


def test_goldens_apply_to_the_spec_they_were_frozen_for(tmp_path, monkeypatch):
    """Tokens: the frozen seed, lengths, precision and options. Structures: the frozen options
    only (a partitioner is another graph; a precision or a length is not, see the docs)."""
    from oracle.verdict import goldens
    from oracle.backend import CheckSpec

    monkeypatch.setenv("MOE_ORACLE_GOLDENS", str(tmp_path))
    d = tmp_path / "olmoe" / "b"
    d.mkdir(parents=True)
    (d / "tokens.json").write_text(json.dumps({"spec": {"seed": 0, "prompt_len": 8, "decode_tokens": 8,
                                                        "precision": "fp32"}, "tokens": [1, 2]}))
    (d / "ops.txt").write_text("# ops\na 1\nb 2\n")
    frozen = CheckSpec(family="olmoe", backend="b")
    assert goldens.token_gate(frozen, [1, 2]).status == "pass"
    assert goldens.token_gate(CheckSpec(family="olmoe", backend="b", prompt_len=5), [1, 2]) is None
    other = CheckSpec(family="olmoe", backend="b", options={"partitioner": "portable"})
    assert goldens.token_gate(other, [1, 2]) is None and goldens.structure_gates(other, {"ops": "x"}) == []
    bf16 = CheckSpec(family="olmoe", backend="b", precision="bf16")
    assert goldens.structure_gates(bf16, {"ops": "# ops\na 1\nb 2\n"})[0].status == "pass"
    row = goldens.structure_gates(frozen, {"ops": "# ops\na 1\nb 3\n"})[0]
    assert row.status == "fail" and "olmoe/b ops differs from the golden" in row.message
    assert "-b 2\n+b 3" in row.message  # a readable line diff


def test_freeze_refuses_a_failing_check_and_touches_nothing_else(cli, tmp_path):
    golden = tmp_path / "goldens"
    shutil.copytree(ROOT / "goldens", golden)
    before = {p: p.read_bytes() for p in golden.rglob("*") if p.is_file()}
    env = {"MOE_ORACLE_GOLDENS": str(golden), "ORACLE_TEST_BREAK": "router_sigmoid"}
    r = cli("goldens", "freeze", "--family", "olmoe", "--backend", "tests.plugins:SWITCHABLE", env=env)
    assert r.returncode == 1 and "not freezing" in r.stdout
    r = cli("goldens", "freeze", "--family", "olmoe", "--backend", "tests.plugins:SWITCHABLE",
            env={"MOE_ORACLE_GOLDENS": str(golden)})
    assert r.returncode == 0, r.stdout + r.stderr
    after = {p: p.read_bytes() for p in golden.rglob("*") if p.is_file()}
    new = set(after) - set(before)
    assert {p.relative_to(golden).as_posix() for p in new} == {"olmoe/tests.plugins:SWITCHABLE/tokens.json"}
    assert all(after[p] == before[p] for p in before)


def test_nightly_workflow_is_valid():
    r = subprocess.run([str(Path(shutil.which("check-jsonschema") or ROOT / ".venv/bin/check-jsonschema")),
                        "--builtin-schema", "vendor.github-workflows",
                        str(ROOT / ".github/workflows/oracle-nightly.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (ROOT / ".github/workflows/oracle-nightly.yml").read_text()
    for needle in ("--shard ${{ matrix.shard }}/6", "macos-14", "executorch-cuda", "--require", "report diff",
                   'selftest --backend ${{ matrix.backend }} --shard "$shard"', "make test-deep"):
        assert needle in text
    # every Linux backend that takes faults has its self-test, its shards covering every family once
    import yaml

    jobs = yaml.safe_load(text)["jobs"]["selftest"]["strategy"]["matrix"]["include"]
    for backend in ("eager", "hf", "mlx", "iree-llvm-cpu", "executorch", "executorch-mlx", "llamacpp"):
        shards = sorted((j["shard"] for j in jobs if j["backend"] == backend and not j.get("tag")),
                        key=lambda x: int(x.split("/")[0]))
        n = int(shards[0].split("/")[1])
        assert shards == [f"{i}/{n}" for i in range(1, n + 1)], (backend, shards)


def test_matrix_takes_a_checkpoint(cli, tmp_path):
    """--model-dir / --config [--layers] go to every check; they name one family's checkpoint
    (the family defaults to the one its config names)."""
    from models import get_family

    cfg = tmp_path / "olmoe-small.json"
    cfg.write_text(json.dumps(dict(get_family("olmoe").tiny_config, model_type="olmoe", initializer_range=0.05,
                                   num_hidden_layers=3)))
    r = cli("matrix", "--config", str(cfg), "--layers", "2", "--report-dir", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(next((tmp_path / "m" / "checks").glob("*.json")).read_text())
    assert doc["spec"]["config"] == str(cfg) and doc["spec"]["layers"] == 2 and doc["status"] == "pass"
    assert doc["spec"]["family"] == "olmoe"
    r = cli("matrix", "--families", "olmoe,mixtral", "--config", str(cfg), "--report-dir", str(tmp_path / "m2"))
    assert r.returncode == 2 and "give its family alone" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (("--families", "olmoe", "--backends", "nosuch"), "--backends: unknown backend 'nosuch'"),
    (("--families", "olmoe", "--backends", "eager,nosuch.mod:X"), "cannot import module 'nosuch.mod'"),
    (("--families", "olmoe", "--precisions", "fp33"), "--precisions: unknown precision 'fp33'"),
    (("--families", "olmoe,nosuch"), "--families: unknown family 'nosuch'"),
    (("--families", "olmoe", "--backends", ","), "--backends: empty list"),
    (("--families", "olmoe", "--shard", "3/2"), "--shard 3/2"),
])
def test_matrix_refuses_unknown_names_before_running(cli, tmp_path, args, needle):
    """A typo in a nightly workflow is exit 2 with the name, not a green run of skipped rows,
    and nothing is written (the report dir is not even created)."""
    out = tmp_path / "never"
    r = cli("matrix", *args, "--report-dir", str(out))
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_report_diff_names_the_flag_of_a_missing_or_malformed_file(cli, tmp_path):
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"schema": "oracle-matrix/v1", "rows": []}))
    r = cli("report", "diff", "--baseline", str(ok), "--current", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "--current" in r.stderr and "nope.json" in r.stderr
    r = cli("report", "diff", "--baseline", str(ok), "--current", str(tmp_path))
    assert r.returncode == 2 and "--current" in r.stderr and "a directory without summary.json" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "oracle-matrix/v1"}))
    r = cli("report", "diff", "--baseline", str(bad), "--current", str(ok))
    assert r.returncode == 2 and "malformed" in r.stderr and "Traceback" not in r.stderr
