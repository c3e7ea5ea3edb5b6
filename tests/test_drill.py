"""The drill-down inside a block (oracle/drill/points.py): on eager (the production model), a fault names
the point it breaks, the points before it agree, and a clean block has no false divergence."""

from __future__ import annotations

import pytest
import torch

from exporters.torch.eager import EagerBackend
from models.faults import catalogue as faults
from models import FAMILY_NAMES
from tests.depth import IN_DEPTH
from oracle.backend import CheckSpec, resolve
from oracle.check import run_check
from oracle.verdict.compare import reduction_length
from oracle.drill.points import drill, point_limits
from oracle.reference.cached import reference_of
from oracle.reports.result import Status
from oracle.source.sources import model_source, prompt_tokens


def _drilled(family: str, transform) -> dict:
    """The check's own drill of its worst failing block (the default, --drill auto)."""
    r = run_check(CheckSpec(family=family, backend="eager"), EagerBackend(name="drilled", transform=transform))
    assert r.status == Status.FAIL and r.drill and not r.drill.get("error"), (r.status, r.drill)
    (d,) = r.drill["blocks"]
    assert (d["layer"], d["kind"]) == (r.worst["layer"], r.worst["kind"])  # the localised block
    return d


def _first(d: dict) -> dict:
    names = [p["name"] for p in d["points"]]
    i = names.index(d["first_divergence"])
    assert all(p["status"] in (Status.PASS, Status.NA) for p in d["points"][:i]), d["points"][:i]
    assert all(p["ratio"] < 0.1 for p in d["points"][:i] if p["status"] == Status.PASS)  # the inputs agree
    return d["points"][i]


def _scale_one_expert(layer: int, expert: int):
    def transform(model):
        with torch.no_grad():
            model.layers[layer].mlp.experts.down_proj[expert] *= 1.01
    return transform


def _scale_shared_expert(model):
    with torch.no_grad():
        for layer in model.layers:
            if getattr(layer.mlp, "shared_expert", None) is not None:
                layer.mlp.shared_expert.down_proj.weight *= 1.01


@pytest.mark.parametrize("family,fault,point", [
    ("qwen3_moe", "rope_theta_wrong", "q_rope"),  # RoPE: the rotated query, its projections agree
    ("olmoe", "qk_norm_missing", "q_norm"),  # computed by HF, skipped by the candidate
    ("qwen3_5_moe", "gdn_conv_state_not_carried", "conv"),  # Gated DeltaNet: the causal conv's output
    ("qwen3_5_moe", "gdn_state_not_carried", "recurrence"),  # ... and the recurrence after it
    ("deepseek_v3", "router_bias_ignored", "selection"),  # the correction bias: scores agree, selection not
    ("qwen3_moe", "router_no_renorm", "weights"),
    # Granite divides the logits after lm_head: HF's `output` is its block output (the row's), not lm_head's
    ("granitemoe", "logits_scaling_missing", "output"),
    # AFMoE: HF's q_proj and gate_proj joined as the production q_proj (Family.hf_point_view): q_proj agrees
    ("afmoe", "qk_norm_missing", "q_norm"),
])
def test_a_catalogue_fault_is_drilled_to_its_point(family, fault, point):
    d = _drilled(family, faults.get(fault).inject)
    assert d["first_divergence"] == point, d["verdict"]
    assert _first(d)["status"] == Status.FAIL and f"first divergence at `{point}`" in d["verdict"]


def test_a_single_experts_fault_is_drilled_to_the_experts():
    """One expert of one layer off by 1%: the router's points agree, the experts' output does not."""
    d = _drilled("qwen3_moe", _scale_one_expert(1, 3))
    assert (d["layer"], d["kind"], d["first_divergence"]) == (1, "moe", "experts"), d["verdict"]
    assert {p["name"]: p["status"] for p in d["points"]}["topk"] == Status.PASS


def test_a_shared_experts_fault_is_drilled_to_its_projection():
    """The shared expert's down projection off by 1%: its gate and up projections agree."""
    d = _drilled("qwen2_moe", _scale_shared_expert)
    assert d["first_divergence"] == "shared_expert.down_proj", d["verdict"]
    status = {p["name"]: p["status"] for p in d["points"]}
    assert status["shared_expert.gate_proj"] == status["shared_expert.up_proj"] == Status.PASS


def test_the_markdown_report_has_the_points_table():
    r = run_check(CheckSpec(family="qwen3_moe", backend="eager"),
                  EagerBackend(name="drilled", transform=faults.get("rope_theta_wrong").inject))
    from oracle.reports.markdown import markdown

    md = markdown(r.to_dict())
    assert "| **`q_rope`** | fail |" in md and "| `q_proj` | pass |" in md


def test_a_backend_without_points_says_so():
    """A candidate without run_block_points (the contract's default): the drill is n/a, never a guess."""
    from tests.plugins import NAN_IN_MOE  # eager with NaN in one MoE block

    class NoPoints:  # an old-style plugin whose candidate has only the three required methods
        name = "no-points"

        def availability(self):
            return True, ""

        def load(self, model, spec):
            cand = NAN_IN_MOE.load(model, spec)

            class C:
                prefill, decode, run_block = cand.prefill, cand.decode, cand.run_block
            return C()

    r = run_check(CheckSpec(family="olmoe", backend="eager"), NoPoints())
    assert r.status == Status.FAIL
    (d,) = r.drill["blocks"]
    assert d["points"] == [] and d["verdict"].startswith("n/a: the backend exposes no points")


# Families whose clean drill names a point where HF's module computes another intermediate than the production
# model's (a drill alignment defect of the harness, open: the checks themselves pass every block and e2e). Each
# is a strict expected failure with what was measured, so that fixing the alignment turns it red.
DRILL_POINTS_OPEN: dict = {}  # family -> why its clean layer's drill finds a divergence (none now)


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xfail(reason=DRILL_POINTS_OPEN[f], strict=True))
                                    if f in DRILL_POINTS_OPEN else f for f in FAMILY_NAMES])
def test_no_false_divergence_in_a_clean_layer(family):
    """Every family's first decoder layer (its attention, router and experts inside), clean: every
    point HF and the production model both compute is within its limit."""
    spec = CheckSpec(family=family, backend="eager")
    src = model_source(spec)
    ref = reference_of(spec, src, prompt_tokens(spec, src.args.vocab_size))
    lim = point_limits("fp32", "layer", family, "eager", reduction_length(src.args))
    cand, hf = resolve("eager").load(src, spec), resolve("hf").load(src, spec)
    for key in [k for k in ref.block_keys() if k[1] == "layer"]:  # every layer: dense, sparse, linear, full
        d = drill(ref, key, cand, hf, lim)
        assert d.first_divergence is None, d.verdict
        compared = [p for p in d.points if p.status == Status.PASS]
        assert len(compared) >= 4 and all(p.ratio <= 1 for p in compared), [(p.name, p.status, p.reason) for p in d.points]


# ---------------------------------------------------------------- mlx (mlx-lm's own model, compiled by MLX)
@pytest.fixture(scope="module")
def mlx():
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")


@pytest.mark.parametrize("family,fault,point", [
    ("qwen3_moe", "rope_theta_wrong", "q_rope"),  # mlx-lm's rotary module, its q call
    ("olmoe", "qk_norm_missing", "q_norm"),
    ("qwen3_5_moe", "gdn_state_not_carried", "recurrence"),  # mlx-lm's gated_delta_update
    ("qwen3_moe", "router_no_renorm", "weights"),  # the block's routing mirror
    ("lfm2_moe", "rmsnorm_eps_wrong", "input_layernorm"),  # mlx-lm's operator_norm under the production name
])
def test_an_mlx_fault_is_drilled_to_its_point(mlx, family, fault, point):
    r = run_check(CheckSpec(family=family, backend="mlx"), resolve("mlx").with_fault(faults.get(fault)))
    assert r.status == Status.FAIL and r.drill and not r.drill.get("error"), (r.status, r.drill)
    (d,) = r.drill["blocks"]
    assert d["first_divergence"] == point, d["verdict"]
    _first(d)
    # what mlx-lm computes inline is n/a with the reason, never a guess
    assert all(p["reason"] for p in d["points"] if p["status"] == Status.NA)


# mlx-lm's known defects (goldens/known_divergences.toml): where the drill finds them, inside the router
KNOWN_MLX_DIVERGENCE = {"ernie4_5_moe": ("logits", "topk", "weights", "output", "mlp"),  # correction bias dropped
                        "deepseek_v3": ("topk", "weights", "output", "mlp"),  # dropped groups filled with 0
                        "glm4_moe": ("topk", "weights", "output", "mlp"), "dots1": ("topk", "weights", "output", "mlp"),
                        # the latent attention's low-rank norms at rms_norm_eps (HF: 1e-6): there, or what follows
                        "glm4_moe_lite": ("self_attn.q_a_layernorm", "self_attn.kv_a_layernorm", "self_attn.context",
                                          "self_attn.o_proj", "self_attn", "post_attention_layernorm", "mlp", "output")}


@pytest.mark.parametrize("family", IN_DEPTH)  # the other families: tests/depth.py
def test_no_false_divergence_in_a_clean_mlx_layer(mlx, family):
    """mlx-lm's first decoder layer of every family, clean: no point diverges."""
    spec = CheckSpec(family=family, backend="mlx")
    src = model_source(spec)
    ref = reference_of(spec, src, prompt_tokens(spec, src.args.vocab_size))
    lim = point_limits("fp32", "layer", family, "mlx", reduction_length(src.args))
    cand, hf = resolve("mlx").load(src, spec), resolve("hf").load(src, CheckSpec(family=family, backend="hf"))
    for key in [k for k in ref.block_keys() if k[1] == "layer"]:
        d = drill(ref, key, cand, hf, lim)
        if family in KNOWN_MLX_DIVERGENCE and d.first_divergence is not None:  # goldens/known_divergences.toml
            assert d.first_divergence in KNOWN_MLX_DIVERGENCE[family], d.verdict
            continue
        assert d.first_divergence is None, d.verdict
        assert sum(p.status == Status.PASS for p in d.points) >= 4, [(p.name, p.status, p.reason) for p in d.points]


def test_the_html_report_plots_the_points_and_report_diff_names_a_changed_point():
    from oracle.reports.html import check_section
    from oracle.reports.summary import diff, diff_markdown, row_of

    r = run_check(CheckSpec(family="qwen3_moe", backend="eager"),
                  EagerBackend(name="drilled", transform=faults.get("rope_theta_wrong").inject))
    doc = r.to_dict()
    html = check_section(doc)
    assert "<h3>Drill: layer 1 attention: first divergence at `q_rope`" in html
    assert 'alt="error per point inside the block"' in html
    row = row_of(doc, "r.json")
    assert row["drill"] == {"1.attention": "q_rope"}
    moved = {**row, "drill": {"1.attention": "q_norm"}}  # the same check, another point diverging first
    d = diff({"rows": [row]}, {"rows": [moved]})
    assert d["drill_changes"] == [{"id": row["id"], "block": "1.attention", "from": "q_rope", "to": "q_norm"}]
    assert "| 1.attention | q_rope | q_norm |" in diff_markdown(d)


def test_every_catalogue_fault_declares_the_point_it_breaks():
    from oracle.drill.points import TAPS

    assert set(faults.POINTS) == {f.name for f in faults.CATALOGUE}
    taps = {n for names in TAPS.values() for n in names}
    modules = {"q_norm", "experts", "input_layernorm", "context", "output"}  # submodule paths and specials
    named = {p for v in faults.POINTS.values() if v is not None for p in (v if isinstance(v, tuple) else (v,))}
    modules |= {"post_attention_layernorm", "shared_expert.gate_proj", "shared_experts.gate_proj", "shared_experts.up_proj"}
    modules |= {"post_mlp_layernorm", "shared_mlp"}  # A.X-K1's MoE output norm; Granite's shared MLP (the layer's)
    modules |= {"dt_layernorm", "norm"}  # Jamba's RMSNorm of the time step's input; lightning attention's norm
    modules |= {"forget_gate", "o_norm"}  # Kimi delta attention's per-channel decay and its gated output norm
    modules |= {"indexer"}  # DeepSeek sparse attention's indexer: its choice (oracle.drill.points.chosen_keys)
    modules |= {"q_gate_proj", "q_b_proj", "kv_b_proj", "k_rope_only_layernorm"}  # MLA's projections (A.X-K2, dots3)
    # Gemma 4's layer: its dense MLP beside the MoE block (HF's `mlp`, the production `dense_mlp`), that MLP's
    # pre-norm, and its router's (HF's mlp.gate in the regrouped reference: models/layers/moe_beside.py)
    modules |= {"mlp", "dense_mlp", "pre_feedforward_layernorm", "mlp.gate"}
    # ZAYA: its router MLP's norm (the first reader of the cross-layer state), its scaled residual add's module
    modules |= {"router_mlp.norm", "post_attention_residual_scale"}
    # Muse Spark: its residual gate, input-scaled post-feedforward norm and the experts' projected-input norm; Qwen4-Exp:
    # the gated residual streams' mix modules around each block (models/layers/gated_residual.py)
    modules |= {"post_attention_residual_gate", "post_feedforward_layernorm", "pre_expert_norm"}
    modules |= {"attn_hyper_connection", "mlp_hyper_connection"}
    # ... and its per-layer embeddings' n-gram lookup; DeepSeek-V4's grouped output projection's first stage (its
    # attention core has no point both sides record) and its CSA layers' indexer (the compressor's)
    modules |= {"ple.ple_embedding.ngram_embedding", "o_a_proj", "compressor.indexer"}
    assert named <= taps | modules


def test_the_selftest_reports_the_share_drilled_to_the_faults_point():
    from oracle.selftest.result import render
    from oracle.selftest.run import run_selftest

    names = ["rope_theta_wrong", "router_no_renorm", "expert_gate_up_swapped", "qk_norm_flat_for_per_head"]
    res = run_selftest("eager", ["qwen3_moe"], seeds=(0,), fault_names=names, drill=True)
    s = res.summary()
    assert s["detected"] == s["faults"] == len(names) and s["drilled"] == len(names), s
    assert s["point_localized"] == len(names), [(r.fault, r.point, r.drill_point) for r in res.faults]
    assert "drill names the fault's point 4/4" in render(res)


def test_at_bf16_each_point_is_judged_against_hfs_own_bf16_error():
    """Trained weights at bf16: a clean model's every point is within HF bf16's own error there (a token
    HF bf16 routes elsewhere too is no divergence), and a RoPE fault is still drilled to `q_rope`."""
    spec = CheckSpec(family="qwen3_moe", backend="eager", precision="bf16", weights="trained", drill="all")
    r = run_check(spec, EagerBackend())
    assert r.drill and not r.drill.get("error") and len(r.drill["blocks"]) >= 8, r.drill
    assert all(d["first_divergence"] is None for d in r.drill["blocks"]), [d["verdict"] for d in r.drill["blocks"]]
    judged = [p for d in r.drill["blocks"] for p in d["points"] if "noise_rel_l2" in p["metrics"]]
    assert judged  # some points were beyond the table and within bf16's own error
    faulted = run_check(CheckSpec(family="qwen3_moe", backend="eager", precision="bf16", weights="trained"),
                        EagerBackend(name="drilled", transform=faults.get("rope_theta_wrong").inject))
    (d,) = faulted.drill["blocks"]
    assert d["first_divergence"] == "q_rope", d["verdict"]


def test_a_point_the_backend_does_not_expose_is_counted_apart():
    """mlx-lm computes the router's scores inline: a fault that breaks `scores` there is drilled to a
    later point, listed with the reason, not counted as a miss nor as a hit."""
    from oracle.selftest.result import FaultRow, SelftestResult, render
    from oracle.selftest.judge import point_exposed

    pts = [{"name": "logits", "status": Status.PASS, "reason": ""},
           {"name": "scores", "status": Status.NA, "reason": "not exposed by the backend (computed inline)"},
           {"name": "topk", "status": Status.FAIL, "reason": ""}]
    assert point_exposed("scores", pts) == (False, "not exposed by the backend (computed inline)")
    assert point_exposed(("scores", "topk"), pts) == (True, "")
    assert point_exposed("experts", pts) == (False, "not a point of this backend's block")
    where = {"layer": 1, "kind": "router"}
    rows = [FaultRow("f", "a", "", "fp32", where, Status.FAIL, True, True, None, 0.0, point="scores",
                     drill_point="topk", drilled=True, point_exposed=False, point_reason="computed inline"),
            FaultRow("f", "b", "", "fp32", where, Status.FAIL, True, True, None, 0.0, point="weights",
                     drill_point="weights", drilled=True)]
    res = SelftestResult("mlx", ["f"], [0], faults=rows)
    s = res.summary()
    assert (s["drilled"], s["point_localized"], s["point_not_exposed"]) == (1, 1, 1)
    assert "not exposed here: computed inline" in render(res)


# ---------------------------------------------------------------- iree-llvm-cpu (a compiled backend)
# One faulted build per family, each fault in another block (a compile per family, not per fault);
# each block is drilled through its points program (the block program with the points as results).
IREE_CASES = {  # family -> (faults, their transform_id, [(block, the point its drill must name)])
    # the build tests/test_iree.py makes too (tests/plugins.py, one compile): layer 2's Gated DeltaNet state
    # not carried, layer 3's RoPE theta wrong, layer 0's expert 3 and layer 1's shared expert 1% off
    "qwen3_5_moe": ("qwen35_four_faults", "QWEN35_FOUR_FAULTS",
                    [((2, "attention"), "recurrence"), ((3, "attention"), "q_rope"), ((0, "moe"), "experts"),
                     ((1, "moe"), "shared_expert.down_proj")]),
    # (glm4_moe's q_norm and router-selection points were drilled here too, on a build of their own: 50 s of a
    # cold suite on 2 cores, for points the eager and mlx drills above reach and `oracle selftest --backend
    # iree-llvm-cpu --drill` covers; issue 76's cold budget)
}


@pytest.mark.parametrize("family", sorted(IREE_CASES))
def test_iree_drills_each_fault_to_its_point(family):
    from oracle.backend import resolve as resolve_backend

    backend = resolve_backend("iree-llvm-cpu")
    if not backend.availability()[0]:
        pytest.skip(backend.availability()[1])
    transform, transform_id, cases = IREE_CASES[family]
    if isinstance(transform, str):  # shared with another test file: by name from tests/plugins.py
        from tests import plugins

        transform, transform_id = getattr(plugins, transform), getattr(plugins, transform_id)
    spec = CheckSpec(family=family, backend="iree-llvm-cpu")
    src = model_source(spec)
    ref = reference_of(spec, src, prompt_tokens(spec, src.args.vocab_size))
    cand = type(backend)(transform=transform, transform_id=transform_id).load(src, spec)
    hf = resolve("hf").load(src, CheckSpec(family=family, backend="hf"))
    for key, point in cases:
        lim = point_limits("fp32", key[1], family, "iree-llvm-cpu", reduction_length(src.args))
        d = drill(ref, key, cand, hf, lim).as_dict()
        assert d["first_divergence"] == point, (key, d["verdict"])
        assert _first(d)["status"] == Status.FAIL
