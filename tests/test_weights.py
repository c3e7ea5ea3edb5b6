"""The trained weight profile (oracle/source/trained.py, docs/weights.md): its statistics are in the written
checkpoints, it is deterministic per seed, the normal profile is byte-for-byte what it was before
the profiles, HF's fp32 reference stays finite and non-degenerate on it for every family, and a
real checkpoint (--model-dir) refuses it."""

import json
import math
import re
from importlib.metadata import version

import numpy as np
import pytest
import torch

from models import FAMILY_NAMES, get_family
from oracle.source import trained as T
from oracle.source.identity import checkpoint_identity
from models.checkpoint import read_weights
from oracle.source.seeded import tiny_checkpoint

# sha256 of the normal tiny checkpoints at seed 0, taken before the profiles existed (transformers
# 5.23.0, torch 2.13.0: config.json records the one, the draws are the other's)
NORMAL_SHA256 = {
    "olmoe": "39d2880b222fa250a27d61c60afe833ef81bf06b3aab5f9fe08996d53d810004",
    "qwen3_5_moe": "b6f298168bf75cc0b6afef5925519d879fc1af7b4c9161886f7afd2342f19d1a",
    "ernie4_5_moe": "3f50caf6739e8412df98a812834efff34a3acd6b14ca2b8406419171c9cc7b1e",
    "gpt_oss": "5ba7e6869850ca61ca09d96131c1c761c713ec76a5bb89fe4e0213c4afa24a46",
}
NORMAL_DIRS = {"olmoe": "olmoe-s0-a7b7cd950fcff1408454", "qwen3_5_moe": "qwen3_5_moe-s0-fd44debe792c8e6757d3",
               "ernie4_5_moe": "ernie4_5_moe-s0-323993171b892c05bf5d", "gpt_oss": "gpt_oss-s0-13891b79b32fce4cee28"}
PINNED = version("transformers") == "5.23.0" and torch.__version__.startswith("2.13.0")

# the roles the profile rewrites, by saved (save_pretrained) tensor name (under a text tower's prefix too: a
# multimodal release's language model); every other tensor is untouched. The router: a gate's or router's own
# weight (not shared_expert_gate), or under the family's router module (Family.hf_router: HunYuan's gate.wg); the
# saved names are the release's (Mixtral's block_sparse_moe, Hy3's router.gate), not always HF's in-memory ones
ROLES = {
    "embedding": r"(.*\.)?embed_tokens\.weight",
    "qk": r".*self_attn\.(q_proj|k_proj|q_b_proj|q_norm|k_norm)\.(weight|bias)",
    "norm": r".*norm\.weight",
    "writer": r".*\.(o_proj|out_proj)\.(weight|bias)",
    "router": r".*\.(gate|router|router\.layer)\.(weight|bias)",
}
LAYER = re.compile(r".*\.layers\.\d+\.(.*)")


def role(name: str, router: str) -> str | None:
    m = LAYER.fullmatch(name)
    if m and m.group(1).startswith(router + ".") and m.group(1).endswith(("weight", ".bias")):
        return "router"
    return next((r for r, rx in ROLES.items() if re.fullmatch(rx, name)), None)


def both(family: str, seed: int = 0):
    """The family, its normal and trained tiny checkpoints (seed), read under the profile's names (a family whose
    modules HF names otherwise: through its Family.hf_profile_view, so DBRX's Wqkv shows as q, k and v rows)."""
    fam = get_family(family)
    view = fam.hf_profile_view or (lambda sd, cfg: sd)
    return fam, *(view(read_weights(tiny_checkpoint(fam, seed, p)), fam.tiny_config) for p in ("normal", "trained"))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_profile_statistics_in_the_checkpoint(family):
    """Outlier dims (every token, >= 10x the embedding's std), massive activations on a tenth of the
    vocabulary (>= 100x its median), residual norm gains spread over >= 1.5 decades, routers x4,
    q/k x2.5 (or their norm gains, or MLA's queries x2.5^2), the attention output projection writing
    the outlier dims x20; nothing else changed."""
    fam, normal, trained = both(family)
    offset = fam.args(fam.tiny_config).norm.offset

    def role_of(k):
        return role(k, fam.hf_router)

    changed = {k for k in normal if not torch.equal(normal[k], trained[k])}
    assert {role_of(k) for k in changed} >= set(ROLES), changed  # every role rewritten in every family
    assert all(role_of(k) for k in changed), sorted(k for k in changed if not role_of(k))

    embedding = next(k for k in normal if role_of(k) == "embedding")
    e0, e = normal[embedding], trained[embedding]
    outlier, massive, _ = T.special_dims(0, e.shape[1])
    assert (e[:, outlier].abs().min(0).values >= 10 * e0.std()).all()  # every token, every outlier dim
    rows = T.massive_rows(0, e.shape[0])
    assert len(rows) == round(0.1 * e.shape[0])
    assert (e[rows][:, massive].abs() >= 100 * e.abs().median()).all()
    others = [r for r in range(e.shape[0]) if r not in rows]
    assert (e[others][:, massive].abs() < 10 * e.abs().median()).all()  # only those tokens

    gains = []
    for k in changed:
        if role_of(k) == "norm":
            g = trained[k].double() + (1 if offset else 0)
            assert (g > 0).all(), k
            gains.append(g)
    g = torch.cat(gains).log10()
    assert float(g.quantile(0.975) - g.quantile(0.025)) >= 1.5

    # the layers whose attention is MLA (Kimi-Linear's others are Kimi delta attention, with q_proj and k_proj)
    mla_layers = {k.split("self_attn.")[0] for k in normal if "kv_a_proj_with_mqa" in k}
    rest = [d for d in range(e.shape[1]) if d not in outlier]
    for k in changed:
        n, t = normal[k], trained[k]
        if role_of(k) == "router":
            assert torch.equal(t, 4 * n), k
        elif role_of(k) == "writer":  # rows of the outlier dims x20, the others as they were
            assert torch.allclose(t[outlier], 20 * n[outlier]) and torch.equal(t[rest], n[rest]), k
        elif role_of(k) == "qk" and ("q_norm" in k or "k_norm" in k):  # gains x2.5
            assert torch.allclose(t + offset, 2.5 * (n + offset), rtol=1e-6), k
        elif role_of(k) == "qk":
            assert torch.allclose(t, (6.25 if k.split("self_attn.")[0] in mla_layers else 2.5) * n, rtol=1e-6), k


def test_trained_is_deterministic_per_seed(tmp_path, monkeypatch):
    fam = get_family("qwen3_5_moe")  # (1 + w) norms, Gated DeltaNet
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "a"))
    a = tiny_checkpoint(fam, 3, "trained")
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "b"))
    b = tiny_checkpoint(fam, 3, "trained")
    assert a.name == b.name and a.name.startswith("qwen3_5_moe-s3-trained-")
    assert checkpoint_identity(a) == checkpoint_identity(b)
    assert checkpoint_identity(tiny_checkpoint(fam, 4, "trained")) != checkpoint_identity(b)
    assert checkpoint_identity(tiny_checkpoint(fam, 3)) != checkpoint_identity(b)
    assert json.loads((a / "oracle_tiny.json").read_text())["weights"] == "trained"


@pytest.mark.parametrize("family", sorted(NORMAL_SHA256))
def test_normal_is_unchanged(family, tmp_path, monkeypatch):
    """The normal profile's cache key and bytes are what they were before the profiles: every
    golden, baseline and cached reference made on them stays valid."""
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    d = tiny_checkpoint(get_family(family), 0)
    assert "weights" not in json.loads((d / "oracle_tiny.json").read_text())
    if not PINNED:
        pytest.skip(f"the recorded bytes are transformers 5.23.0 / torch 2.13.0's (here {version('transformers')}, "
                    f"{torch.__version__})")
    assert d.name == NORMAL_DIRS[family]
    assert checkpoint_identity(d) == NORMAL_SHA256[family]


def test_seeded_config_checkpoint_takes_the_profile(tmp_path, monkeypatch):
    """--config NAME --weights trained: the seeded (HF-initialised, layer at a time) checkpoint gets
    the same rewrite, scaled to its own init (initializer_range)."""
    from oracle.source.seeded import config_checkpoint

    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    fam = get_family("olmoe")
    cfg = tmp_path / "olmoe-small.json"
    cfg.write_text(json.dumps(dict(fam.tiny_config, model_type="olmoe", initializer_range=0.02)))
    normal = read_weights(config_checkpoint(fam, str(cfg), None, 1, dtype="fp32"))
    d = config_checkpoint(fam, str(cfg), None, 1, dtype="fp32", weights="trained")
    assert d.name.startswith("olmoe-small-Lall-s1-fp32-trained-")
    trained = read_weights(d)
    e = trained["model.embed_tokens.weight"]
    outlier, massive, _ = T.special_dims(1, e.shape[1])
    assert (e[:, outlier].abs().min(0).values >= 10 * 0.02).all()
    assert (e[T.massive_rows(1, e.shape[0])][:, massive].abs() >= 100 * e.abs().median()).all()
    assert torch.equal(trained["model.layers.1.mlp.gate.weight"], 4 * normal["model.layers.1.mlp.gate.weight"])
    g = trained["model.layers.0.input_layernorm.weight"].log10()
    assert float(g.max() - g.min()) >= 1.5
    v = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(trained[v], normal[v])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hf_reference_is_finite_and_not_degenerate(family):
    """HF fp32 on the trained checkpoint (seed 0), a prompt that holds a massive-activation token:
    finite everywhere, the outlier and massive dims at the first layer's input, logits neither flat
    nor the same choice at every position."""
    from oracle.reference.run import capture, first_nonfinite
    from oracle.reference.streaming import load_hf_model

    fam = get_family(family)
    d = tiny_checkpoint(fam, 0, "trained")
    # a check's prompt at seed 0 (oracle.source.sources.prompt_tokens), opening with a massive-activation token
    prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt[0] = T.massive_rows(0, 256)[0]
    ref = capture(load_hf_model(fam, d), fam, prompt, 4)
    assert first_nonfinite(ref) is None
    H = fam.args(fam.tiny_config).hidden_size
    x = ref.inputs[(0, "layer")][0].x_array[0]  # [T, H], or [T, N * H]: N residual streams (Qwen4-Exp's), each H
    x = x.reshape(x.shape[0], -1, H)[:, 0]  # (every stream starts as the embedding: the first)
    outlier, massive, _ = T.special_dims(0, H)
    # against each position's own median: a family that norms its embeddings (Inkling, Muse Spark) scales each
    # position by its own RMS, so the massive-activation token's position is all massive dims after it
    median = np.median(np.abs(x), axis=-1, keepdims=True)
    assert (np.abs(x[:, outlier]) >= 10 * median).all()
    assert (np.abs(x[0, massive]) >= 100 * median[0]).all()
    logits = np.concatenate(ref.logits)  # [positions, V]
    # (the logits after a massive-activation token are flatter: its norm is all massive dims)
    assert np.median(logits.std(axis=-1)) > 0.05 and len(set(logits.argmax(-1).tolist())) > 1


def test_model_dir_refuses_the_trained_profile(tmp_path, capsys):
    from oracle.cli import main

    d = str(tiny_checkpoint(get_family("olmoe"), 0))
    for argv in (["check", "--backend", "eager", "--model-dir", d, "--weights", "trained"],
                 ["export", "--backend", "eager", "--model-dir", d, "--weights", "trained",
                  "--output-dir", str(tmp_path / "e")],
                 ["reference", "save", "--model-dir", d, "--weights", "trained", "--out", str(tmp_path / "r")]):
        assert main(argv) == 2, argv
        assert "--weights trained" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["matrix", "--families", "olmoe", "--model-dir", d, "--weights", "trained",
              "--report-dir", str(tmp_path / "m")])
    assert e.value.code == 2 and "--model-dir" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before anything is written


def test_plumbing():
    """Every command that makes a tiny / --config checkpoint takes --weights; the report records a
    trained profile and leaves the normal one out (reports as before); goldens, frozen on normal
    weights, do not apply to a trained check."""
    from oracle.verdict import goldens
    from oracle.backend import CheckSpec
    from oracle.check import spec_record
    from oracle.cli.common import WEIGHT_PROFILES
    from oracle.cli import parser

    assert WEIGHT_PROFILES == T.PROFILES
    p = parser()
    for argv in (["check", "--backend", "hf"], ["export", "--backend", "hf", "--output-dir", "x"], ["selftest"],
                 ["matrix", "--report-dir", "x"], ["reference", "save", "--out", "x"]):
        assert p.parse_args(argv).weights == "normal"
        assert p.parse_args([*argv, "--weights", "trained"]).weights == "trained"
    normal = goldens.default_spec("olmoe", "eager")
    trained = CheckSpec(**{**normal.__dict__, "weights": "trained"})
    assert "weights" not in spec_record(normal) and spec_record(trained)["weights"] == "trained"
    assert goldens.applies(normal) and not goldens.applies(trained)
    assert goldens.applies(trained, ("options",))  # structural goldens: the graph does not see the weights


def test_profile_constants_are_the_documented_ones():
    """docs/weights.md states these numbers."""
    assert (T.OUTLIER_DIMS, T.OUTLIER_SCALE, T.MASSIVE_DIMS, T.MASSIVE_SHARE, T.MASSIVE_SCALE) == (3, 20, 2, 0.1, 300)
    assert (T.ROUTER_SCALE, T.QK_SCALE) == (4, 2.5)
    assert math.isclose(math.exp(4 * T.GAIN_SIGMA), 100)  # +-2 sigma: two decades


def test_matrix_and_selftest_pass_the_profile_on(tmp_path, monkeypatch, capsys):
    """`oracle matrix --weights trained` runs every check with it (normal: the command lines as
    before); `oracle selftest --weights trained` runs the catalogue and the clean runs on it."""
    import oracle.matrix
    import oracle.selftest.result
    import oracle.selftest.run  # (patched below: imported here, not left to an earlier test)
    from oracle.cli import main
    from oracle.reports.summary import summarize

    seen = []
    monkeypatch.setattr(oracle.matrix, "run_matrix",
                        lambda cs, d, t, seed, extra, **kw: seen.append(extra) or summarize([]))
    for weights in ("trained", "normal"):
        argv = ["matrix", "--families", "olmoe", "--weights", weights, "--report-dir", str(tmp_path / weights)]
        assert main(argv) == 0
    assert seen == [["--weights", "trained"], []]

    def fake(backend, families, seeds, faults, progress=None, options=None, weights="normal", precision="fp32",
             drill=False, on_row=None, jobs=1, notice=None):
        seen.append(weights)
        return oracle.selftest.result.SelftestResult(backend, ["olmoe"], seeds, weights=weights)

    monkeypatch.setattr(oracle.selftest.run, "run_selftest", fake)
    main(["selftest", "--family", "olmoe", "--weights", "trained"])
    assert seen[-1] == "trained" and "trained weights" in capsys.readouterr().out
