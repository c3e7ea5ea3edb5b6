"""Reports: deterministic JSON (apart from timings), atomic writes, the markdown summary."""

import json

from exporters.torch.eager import EagerBackend
from models.faults import catalogue as faults
from oracle.backend import CheckSpec
from oracle.check import run_check
from oracle.reports.markdown import markdown
from oracle.reports.result import dumps, write_atomic


def _strip_timings(doc):
    doc = dict(doc)
    doc.pop("timings")
    return doc


def test_same_spec_same_json():
    spec = CheckSpec(family="qwen2_moe", backend="eager", seed=3)
    a, b = json.loads(dumps(run_check(spec))), json.loads(dumps(run_check(spec)))
    assert a["timings"] and _strip_timings(a) == _strip_timings(b)
    assert json.dumps(_strip_timings(a), sort_keys=True) == json.dumps(_strip_timings(b), sort_keys=True)


def test_seed_changes_weights_and_prompt():
    a = run_check(CheckSpec(family="olmoe", backend="eager", seed=1))
    b = run_check(CheckSpec(family="olmoe", backend="eager", seed=2))
    assert a.e2e.prompt_tokens != b.e2e.prompt_tokens
    assert a.provenance["checkpoint"]["sha256"] != b.provenance["checkpoint"]["sha256"]


def test_markdown_names_the_fault():
    spec = CheckSpec(family="qwen3_moe", backend="eager")
    r = run_check(spec, EagerBackend(transform=faults.get("rope_theta_wrong").inject))
    md = markdown(r.to_dict())
    assert "**fail**" in md and "Localised fault: **layer 1 attention (full_attention)**" in md
    assert "First divergence: step" in md
    # the drill-down of the failing block (oracle/drill/points.py) names the point inside it, in bold
    assert "Drill: layer 1 attention: first divergence at `q_rope`" in md and "| **`q_rope`** | fail |" in md
    drill = [line for line in md.splitlines() if line.startswith("| `") or line.startswith("| **`")]
    # compact besides the drill's points table (one row per point); 39, was 30: the invariance section (its title, a
    # table of the three rows, the blank lines around them) added 8 lines
    assert len(md.splitlines()) - len(drill) < 39


def test_nonfinite_json_is_valid():
    from oracle.reports.result import _clean

    assert _clean({"a": float("nan"), "b": [float("inf")]}) == {"a": "nan", "b": ["inf"]}


def test_write_atomic_leaves_no_temp(tmp_path):
    p = tmp_path / "sub" / "r.json"
    write_atomic(p, "{}\n")
    assert p.read_text() == "{}\n" and [x.name for x in p.parent.iterdir()] == ["r.json"]
