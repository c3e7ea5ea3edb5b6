"""The MoE text towers of multimodal releases (models/text_tower.py): on text their multi-axis rope is the
1-D rope the family file maps to, the reference (HF's text model with the release's head) computes what the
released composite model computes on text, and the tiny checkpoint has the release's layout."""

from __future__ import annotations

import json

import pytest
import torch

from models import FAMILY_NAMES, get_family
from models.checkpoint import read_weights
from models.layers.rope import Rope
from oracle.source.seeded import tiny_checkpoint

TOWERS = [n for n in FAMILY_NAMES if get_family(n).text_tower is not None]

# the released composite model of each tower (transformers.models.<hf_module>): (class, config overrides giving
# it vision / audio towers small enough to build, the attribute whose forward is the language model's or None)
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
          "deepstack_visual_indexes": [0]}
RELEASED = {
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", {"vision_config": VISION}, None),
    "qwen3_omni_moe": ("Qwen3OmniMoeForConditionalGeneration",
                       {"enable_audio_output": False,
                        "thinker_config": {"vision_config": VISION,
                                           "audio_config": {"encoder_layers": 1, "encoder_attention_heads": 2,
                                                            "encoder_ffn_dim": 32, "d_model": 16, "output_dim": 64,
                                                            "downsample_hidden_size": 8, "num_mel_bins": 16}}},
                       "thinker"),
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration",
                  {"vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                                     "out_hidden_size": 64}}, None),
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeForConditionalGeneration",
                        {"vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2}},
                        None),
    "glm5_next": ("Glm5NextForConditionalGeneration",
                  {"vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                                     "out_hidden_size": 64, "projection_intermediate_size": 32}}, None),
    "muse_spark": ("MuseSparkForConditionalGeneration",
                   {"vision_config": {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                                      "num_attention_heads": 2, "pos_emb_height": 4, "pos_emb_width": 4,
                                      "max_position_embeddings": 16, "layer_types": ["full_attention"]},
                    "audio_config": {"hidden_sizes": [8, 8, 8, 8], "depths": [1, 1, 1, 1], "out_hidden_size": 64}},
                   None),
}


def _merged(a: dict, b: dict) -> dict:
    return {**a, **{k: _merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


PROMPT = [3, 17, 200, 5, 99, 42, 7, 128, 64, 1, 250, 33]


def _tower(name):
    fam = get_family(name)
    d = tiny_checkpoint(fam, 0)
    return fam, d, json.loads((d / "config.json").read_text())


def test_every_text_tower_is_checked_against_its_released_model():
    assert TOWERS and set(TOWERS) <= set(RELEASED)


@pytest.mark.parametrize("name", TOWERS)
def test_tiny_checkpoint_has_the_release_layout(name):
    """config.json is the release's composite one (llama.cpp's converter and mlx-lm pick their model by it), the
    text model's tensors are under the release's prefix, the head at the release's name, no other tower."""
    fam, d, cfg = _tower(name)
    tower = fam.text_tower
    assert cfg["model_type"] == tower.composite and cfg["architectures"] == [tower.architecture]
    inner = cfg
    for key in tower.nest:
        inner = inner[key]
    assert inner["num_hidden_layers"] == fam.tiny_config["num_hidden_layers"]
    names = list(read_weights(d))
    tied = fam.args(fam.tiny_config).tie_word_embeddings  # (ERNIE-4.5-VL ties its head: none stored)
    assert (f"{tower.head}.weight" in names) != tied
    # (ERNIE-4.5-VL's release keeps the language model at model.*: transformers' conversion reads it into tower.path)
    saved = {"ernie4_5_vl_moe": "model"}.get(name, tower.path)
    assert all(k.startswith(saved + ".") for k in names if k != f"{tower.head}.weight")
    assert any(".layers." in k for k in names)


@pytest.mark.parametrize("name", TOWERS)
def test_text_positions_rotate_as_the_families_1d_rope(name):
    """The cos/sin HF's text model gives its decoder layers on text (its own positions: every rope axis the
    token's position) are those of the production model's 1-D rope (the family's RopeArgs) at those positions."""
    fam, d, cfg = _tower(name)
    model = fam.hf_class().from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    decoder = model.get_decoder()
    seen = {}

    def keep(module, args, kwargs, out):
        seen["pe"] = kwargs["position_embeddings"]

    hook = decoder.layers[0].register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPT]))
    hook.remove()
    rope = fam.args(fam.tiny_config).rope
    if rope.per_layer and not any(rope.per_layer):  # no layer rotates (GLM-5.3's NoPE latent attention and KDA)
        assert seen["pe"] is None
        return
    cos, sin = (t.reshape(-1, len(PROMPT), t.shape[-1])[0] for t in seen["pe"])  # [T, rotary dims]
    args = fam.args(cfg)
    rope = Rope(args.head_dim, args.rope)
    freqs = torch.arange(len(PROMPT)).float()[:, None] * rope.inv_freq[None, :]
    # the layout of HF's cos/sin: rotate-half (each frequency twice, halves), or pairs interleaved (ERNIE)
    emb = freqs.repeat_interleave(2, dim=-1) if args.rope.interleave else torch.cat((freqs, freqs), dim=-1)
    assert cos.shape[-1] >= rope.rotary_dim
    torch.testing.assert_close(cos[:, : rope.rotary_dim], emb.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, : rope.rotary_dim], emb.sin(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", TOWERS)
def test_reference_is_the_released_model_on_text(name):
    """HF's released composite model read from the tiny checkpoint by transformers' own loading (its conversion
    of the release's names; its vision / audio towers, absent from the checkpoint, small and random), run on
    text with its own position ids (get_rope_index on text), prefill and two cached decode steps: the same
    logits as the text tower's reference."""
    import importlib

    fam, d, cfg = _tower(name)
    cls_name, overrides, part = RELEASED[name]
    mod = importlib.import_module(f"transformers.models.{fam.hf_module}")
    config_cls = getattr(mod, fam.text_tower.composite_config)
    composite = {k: v for k, v in _merged(cfg, overrides).items()
                 if k not in ("architectures", "transformers_version", "model_type")}
    released, info = getattr(mod, cls_name).from_pretrained(d, config=config_cls(**composite), dtype=torch.float32,
                                                             attn_implementation="eager", output_loading_info=True)
    towers = ("visual.", "audio_tower.", "vision_tower.", "resampler_model.", "vision_adapter.", "vision_projection.")
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(any(t in k for t in towers) for k in info["missing_keys"]), info["missing_keys"]
    released = (getattr(released, part) if part else released).eval()
    tower = fam.hf_class().from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    for model in (tower, released):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([PROMPT]), use_cache=True)
            logits, cache = [out.logits[0, -1]], out.past_key_values
            for tok in (11, 12):
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
                logits.append(out.logits[0, -1])
                cache = out.past_key_values
        outs.append(torch.stack(logits))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
