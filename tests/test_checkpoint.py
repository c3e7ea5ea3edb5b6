"""Checkpoint layouts: per-expert (save_pretrained) and fused/stacked experts both load."""

import pytest
import torch

from models import FAMILY_NAMES, get_family
from models.checkpoint import CheckpointError, read_config, read_weights
from oracle.source.seeded import tiny_checkpoint


def _fuse(weights):
    """The in-memory HF layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    import re

    out, groups = {}, {}
    for k, t in weights.items():
        m = re.fullmatch(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", k)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:  # (MiniMax-M3's release keeps its correction bias beside the gate: HF's is the gate's)
            out[k.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
                .replace(".block_sparse_moe.", ".mlp.")] = t
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        names = ("w1", "w3", "w2") if (0, "w1") in parts else ("gate_proj", "up_proj", "down_proj")
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, names[0]], parts[e, names[1]]]) for e in range(n)])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts[e, names[2]] for e in range(n)])
    return out


# families whose checkpoints have their experts fused only (transformers writes and reads no
# per-expert form): gpt-oss's gate_up [E, H, 2I], Granite's input_linear, Llama 4's [E, H, 2I]
FUSED_ONLY = ("gpt_oss", "granitemoe", "llama4",
              # ... and Granite's kin (input_linear / output_linear), DBRX's w1/v1/w2 over the experts, JetMoE's,
              # Qwen3-VL-MoE's gate_up_proj [E, H, 2I] as the release stores them
              "granitemoeshared", "granitemoe_swa", "granitemoehybrid", "dbrx", "jetmoe", "qwen3_vl_moe",
              # ... or per expert only: ERNIE-4.5-VL's one list of text then vision experts of two widths (no fused
              # form of it exists: transformers splits it into text_moe / vision_moe on load)
              "ernie4_5_vl_moe",
              # ... and Mistral 4, which transformers 5.23's conversion mapping leaves out: its experts.gate_up_proj
              # [E, 2I, H] as HF holds them is the one form HF writes and reads; so is Gemma 4's
              "mistral4", "gemma4",
              # ... and HY-V4, whose release ships its experts pre-stacked (transformers 5.23 writes them so)
              "hy_v4",
              # ... and the families transformers 5.23 has no conversion mapping for, which it writes and reads fused
              # only (Inkling, Muse Spark, ZAYA; Doge's experts are two embedding tables, no list of experts at all)
              "inkling", "muse_spark", "zaya", "doge")


@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f not in FUSED_ONLY])
def test_fused_and_per_expert_layouts_give_the_same_model(family):
    fam = get_family(family)
    d = tiny_checkpoint(fam, 0)
    cfg, w = read_config(d), read_weights(d)
    assert any(".experts.0." in k for k in w)  # save_pretrained wrote the per-expert form
    a = fam.build(cfg, w)
    b = fam.build(cfg, _fuse(w))
    tokens, pos = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)
    with torch.no_grad():
        assert torch.equal(a(tokens, pos), b(tokens, pos))


def test_missing_expert_is_named():
    fam = get_family("olmoe")
    d = tiny_checkpoint(fam, 0)
    w = read_weights(d)
    del w["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.experts\.3\.up_proj\.weight"):
        fam.validate(read_config(d), w)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.to(torch.int32), r"experts\.3\.up_proj\.weight has dtype torch\.int32"),
    (lambda t: t[:-1], r"experts' shapes differ: .*experts\.3\.up_proj\.weight is"),
])
def test_a_malformed_expert_is_named_not_promoted_or_stacked_blindly(change, message):
    # torch.stack promotes an integer expert to float (the check then passed on truncated
    # weights) and fails on a short one without naming it
    fam = get_family("olmoe")
    d = tiny_checkpoint(fam, 0)
    w = read_weights(d)
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    w[key] = change(w[key])
    with pytest.raises(CheckpointError, match=message):
        fam.validate(read_config(d), w)


def test_tiny_checkpoint_is_deterministic_and_cached(tmp_path, monkeypatch):
    fam = get_family("mixtral")
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "a"))
    a = tiny_checkpoint(fam, 5)
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "b"))
    b = tiny_checkpoint(fam, 5)
    assert a.name == b.name  # content-addressed
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert tiny_checkpoint(fam, 5) == b  # second call: cache hit
    assert sorted(p.name for p in b.parent.iterdir()) == [b.name]  # no temp dirs left


def test_tiny_weights_have_std_about_0_1():
    w = read_weights(tiny_checkpoint(get_family("qwen3_moe"), 0))
    std = w["model.layers.0.self_attn.q_proj.weight"].std().item()
    assert 0.09 < std < 0.11


# ------------------------------------------------------------------ seeded checkpoints of configs
def test_seeded_checkpoint_is_sharded_like_save_pretrained(tmp_path):
    """One decoder layer at a time, HF's own initialisation with the config's
    initializer_range, HF's reverse weight conversion (per-expert names), shards + index:
    transformers loads it with nothing missing, and its weights have the config's std."""
    from oracle.source.identity import checkpoint_identity
    from models.checkpoint import tensor_index
    from oracle.source.seeded import write_seeded_checkpoint
    from oracle.reference.streaming import load_hf_model

    fam = get_family("qwen2_moe")
    cfg = dict(fam.tiny_config, model_type="qwen2_moe", initializer_range=0.05)
    write_seeded_checkpoint(fam, cfg, 3, tmp_path, torch.bfloat16, shard_bytes=60_000)
    index = tensor_index(tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in index  # the per-expert layout HF writes
    assert {dt for _, dt, _ in index.values()} == {"BF16"}
    model = load_hf_model(fam, tmp_path)  # raises on any missing or mismatched tensor
    w = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    assert 0.045 < float(w.std()) < 0.055
    assert checkpoint_identity(tmp_path) == checkpoint_identity(tmp_path)


def test_identity_is_cached_by_path_size_mtime(tmp_path, monkeypatch):
    """A second check of an unchanged checkpoint does not re-read (re-hash) it; a changed file is."""
    import shutil

    from oracle.source import identity as C

    d = tmp_path / "c"
    shutil.copytree(tiny_checkpoint(get_family("olmoe"), 0), d)
    first = C.checkpoint_identity(d)
    reads = []
    monkeypatch.setattr(C, "_scan_file", lambda p, h: reads.append(p) or [])
    assert C.checkpoint_identity(d) == first and reads == []
    (d / "config.json").write_text((d / "config.json").read_text() + " ")
    C.checkpoint_identity(d)
    assert reads  # the changed directory was read again


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b-v0.1"])
def test_published_configs_resolve(name):
    """The shipped published configs map onto their family (HF's config class + ModelArgs)."""
    from models import family_for_model_type
    from oracle.source.published import published_config

    cfg = published_config(name, layers=2)
    fam = get_family(family_for_model_type(cfg["model_type"]))
    args = fam.args(cfg)
    assert args.num_hidden_layers == 2 and args.hidden_size >= 2048 and args.num_experts >= 8


def test_a_cut_within_a_dense_prefix_is_that_prefix():
    """DeepSeek-V3's first 3 layers are dense: --layers 2 is its first two (dense) layers, a model HF and the
    rules take (first_k_dense_replace 3 > 2 layers was refused); --layers 5 keeps the prefix and two MoE layers."""
    from models import family_for_model_type
    from oracle.source.published import published_config

    two, five = published_config("deepseek-v3", layers=2), published_config("deepseek-v3", layers=5)
    assert two["first_k_dense_replace"] == 2 and five["first_k_dense_replace"] == 3
    fam = get_family(family_for_model_type(two["model_type"]))
    assert fam.args(two).num_hidden_layers == 2


def test_a_cut_renumbers_a_familys_own_layer_lists():
    """Kimi-Linear's release lists its KDA and full-attention layers 1-based in linear_attn_config (HF derives
    layer_types from them): a cut to the last N layers renumbers them (Family.cut_layers), or HF's config class
    indexes a layer the cut removed (IndexError, measured before it). The last 2 of 27: a KDA layer, then the full
    attention of layer 27; the last 5: 23 to 27."""
    from models import family_for_model_type
    from oracle.source.published import published_config

    whole = published_config("kimi-linear-48b-a3b-instruct")["linear_attn_config"]
    assert max(whole["kda_layers"] + whole["full_attn_layers"]) == 27
    two, five = (published_config("kimi-linear-48b-a3b-instruct", layers=n) for n in (2, 5))
    assert (two["linear_attn_config"]["kda_layers"], two["linear_attn_config"]["full_attn_layers"]) == ([1], [2])
    kept = {i - 22 for i in whole["full_attn_layers"] if i > 22}
    assert set(five["linear_attn_config"]["full_attn_layers"]) == kept
    assert sorted(five["linear_attn_config"]["kda_layers"] + five["linear_attn_config"]["full_attn_layers"]) == [1, 2, 3, 4, 5]
    fam = get_family(family_for_model_type(two["model_type"]))
    args = fam.args(two)
    assert args.num_hidden_layers == 2 and args.layer_types == ("kda", "full_attention")


def test_a_nemotron_h_cut_keeps_an_attention_block():
    """Nemotron-H's release spells its depth as hybrid_override_pattern (HF ignores num_hidden_layers beside it):
    the cut slices the pattern, keeping the last window of N layers that holds an attention block (the release
    ends in Mamba2 + MoE, and transformers 5.23's NemotronH cache cannot run without attention)."""
    from models import family_for_model_type
    from oracle.source.published import published_config

    name = "nvidia-nemotron-3-nano-30b-a3b-bf16"
    whole = published_config(name)["hybrid_override_pattern"]
    assert len(whole) == 52 and whole.endswith("ME")
    two, three = (published_config(name, layers=n)["hybrid_override_pattern"] for n in (2, 3))
    last = whole.rindex("*")
    assert (two, three) == (whole[last:last + 2], whole[last:last + 3]) == ("*E", "*EM")
    cfg = published_config(name, layers=3)
    args = get_family(family_for_model_type(cfg["model_type"])).args(cfg)
    assert args.num_hidden_layers == 3 and len(set(args.layer_types)) >= 2
    # mlx-lm's NemotronHModel indexes its caches by the first Mamba2 layer (IndexError without one): refused
    pytest.importorskip("mlx_lm")
    from exporters.mlx.config import ConfigError, mlx_config

    assert mlx_config("nemotron_h", cfg)["hybrid_override_pattern"] == list("*EM")
    with pytest.raises(ConfigError, match="no Mamba2 layer .*IndexError"):
        mlx_config("nemotron_h", published_config(name, layers=2))


def test_check_on_a_config(tmp_path, capsys):
    """--config takes a published name or a config.json; --layers cuts it; the check passes."""
    import json

    from oracle.cli import main

    fam = get_family("olmoe")
    path = tmp_path / "olmoe-small.json"
    path.write_text(json.dumps(dict(fam.tiny_config, model_type="olmoe", initializer_range=0.05,
                                    num_hidden_layers=3)))
    report = tmp_path / "r.json"
    code = main(["check", "--family", "olmoe", "--backend", "eager", "--config", str(path), "--layers", "2",
                 "--json", str(report)])
    assert code == 0, capsys.readouterr()
    doc = json.loads(report.read_text())
    assert doc["spec"]["config"] == str(path) and doc["spec"]["layers"] == 2
    assert len([b for b in doc["blocks"] if b["kind"] == "layer"]) == 2
    assert main(["check", "--family", "olmoe", "--backend", "eager", "--layers", "2"]) == 2


def _composite_qwen35(dst):
    """The tiny Qwen3.5-MoE as the multimodal release lays it out: composite config.json
    (model_type qwen3_5_moe, text_config, vision_config) and model.language_model.* names."""
    import json

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint(get_family("qwen3_5_moe"), 0)
    text = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "architectures"}
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": False,
           "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64}}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(src / "model.safetensors")
    save_file({("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in w.items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("backend", ["eager", "hf", "mlx"])
def test_composite_qwen35_config_loads(tmp_path, capsys, backend):
    """A real Qwen3.5-MoE release config (composite, text_config) is read, not refused."""
    import json

    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    from oracle.cli import main

    d = _composite_qwen35(tmp_path / "composite")
    report = tmp_path / "r.json"
    code = main(["check", "--family", "qwen3_5_moe", "--backend", backend, "--model-dir", str(d),
                 "--json", str(report)])
    assert code == 0, capsys.readouterr()
    assert json.loads(report.read_text())["e2e"]["token_exact"]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_layer_by_layer_build_equals_the_whole_dict_build(family):
    """build_from (parameters on meta, filled one decoder layer at a time from the shards) gives
    exactly the model the whole-dict build gives, in fp32 and bf16."""
    from oracle.backend import CheckSpec
    from oracle.source.sources import model_source

    src = model_source(CheckSpec(family=family, backend="eager"))
    for dtype in (torch.float32, torch.bfloat16):
        a = src.build_production(dtype).state_dict()
        b = src.family.build(src.config, src.weights(), dtype, src.args.max_seq_len).state_dict()
        assert list(a) == list(b)
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_granitemoe_swa_with_a_shared_mlp_passes(tmp_path):
    """GraniteMoE-SWA's optional shared MLP beside the MoE block (shared_intermediate_size > 0: granitemoeshared's
    mechanism, not in the tiny config): a seeded checkpoint of the tiny config with one checks on eager, and the
    production model has it."""
    import json

    from models.granitemoe_swa import TINY
    from oracle.backend import CheckSpec
    from oracle.check import run_check
    from oracle.source.sources import model_source

    path = tmp_path / "granitemoe_swa-shared.json"
    path.write_text(json.dumps({**TINY, "shared_intermediate_size": 48, "model_type": "granitemoe_swa",
                                "architectures": ["GraniteMoeSWAForCausalLM"]}))
    spec = CheckSpec(family="granitemoe_swa", backend="eager", config=str(path))
    src = model_source(spec)
    assert src.args.shared_expert_beside and src.args.shared_expert_intermediate_size == 48
    model = src.build_production(torch.float32)
    assert model.layers[0].shared_mlp.up_proj.weight.abs().sum() > 0  # the checkpoint's weights, not zeros
    r = run_check(spec)
    assert r.status == "pass" and r.e2e.token_exact, r.worst


def test_a_seeded_checkpoint_takes_the_releases_tensor_names_where_save_pretrained_writes_others():
    """Kimi-Linear's dense layer: transformers 5.23's save_pretrained names its MLP block_sparse_moe (its rename of the
    release's MoE blocks, reversed, takes every `mlp`), the release (and mlx-lm, llama.cpp's converter) `mlp`: the tiny
    checkpoint is written as released (Family.release_names), with the release's config fields, and HF reads it back
    as the same model (the production model built from it equals HF's state, tensor for tensor)."""
    import json

    from safetensors import safe_open

    from models import get_family
    from oracle.source.seeded import tiny_checkpoint

    family = get_family("kimi_linear")
    d = tiny_checkpoint(family, 0)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense layer
    assert not any(n.startswith("model.layers.0.block_sparse_moe.") for n in names)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in names  # a sparse one, as released
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["linear_attn_config"]["kda_layers"] == [1, 3, 4] and cfg["first_k_dense_replace"] == 1
    hf = family.hf_class().from_pretrained(d)
    sd = hf.state_dict()
    assert torch.equal(sd["model.layers.0.mlp.gate_proj.weight"],
                       family.build(cfg, {n: t for n, t in _read(d).items()}).state_dict()["layers.0.mlp.gate_proj.weight"]
                       .to(sd["model.layers.0.mlp.gate_proj.weight"].dtype))


def _read(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))
