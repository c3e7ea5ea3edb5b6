"""Checkpoint layouts: per-expert (save_pretrained) and fused/stacked experts both load."""

import pytest
import torch

from models import FAMILY_NAMES, get_family
from models.checkpoint import CheckpointError, read_config, read_weights, tiny_checkpoint


def _fuse(weights):
    """The in-memory HF layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    import re

    out, groups = {}, {}
    for k, t in weights.items():
        m = re.fullmatch(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", k)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[k.replace(".block_sparse_moe.", ".mlp.")] = t
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        names = ("w1", "w3", "w2") if (0, "w1") in parts else ("gate_proj", "up_proj", "down_proj")
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, names[0]], parts[e, names[1]]]) for e in range(n)])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts[e, names[2]] for e in range(n)])
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
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
