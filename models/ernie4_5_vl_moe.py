"""ERNIE 4.5 VL's text tower (ernie4_5_vl_moe), on text input: ERNIE 4.5 MoE's mechanisms (ernie4_5_moe):
rotary pairs interleaved over the whole head, rotated in fp32; dense and sparse layers by mlp_layer_types; a
softmax router in fp32 whose correction bias (moe_statics) decides the choice only, the top-k weights
divided by max(sum, moe_norm_min); always-on shared experts. Its MoE layers hold two expert sets, one for
text tokens and one for image/video tokens (of other widths: moe_intermediate_size [text, vision]): on text
every token goes to the text experts (HF's Ernie4_5_VLMoeMoeBlock without moe_mm_token_type_ids), so the
vision experts and their router are not part of the model checked. On text its 3-D rope is ERNIE's 1-D
rope: HF gives every axis (height, width, time) the token's position (its default without position ids),
pre-permutes the frequencies of the height/width sections and interleaves them back, so each frequency is
rotated by that one position, pairs interleaved (tests/test_text_tower.py).

The reference is HF's Ernie4_5_VLMoeTextModel with the release's lm_head (models.text_tower). The tiny
checkpoint has the release's layout (what transformers' ernie4_5_vl_moe conversion reads): config.json the
composite ernie4_5_vl_moe one (text_config nested, architectures Ernie4_5_VLMoeForConditionalGeneration),
the language model at model.* (embed_tokens, layers, norm), lm_head at the top (tied by default), each MoE
layer's experts as one list experts.{0..2E-1} (the E text experts, then the E vision experts), the text
router's weight as mlp.gate.weight [H, E] (the vision router's mlp.gate.weight_1), the correction biases as
mlp.moe_statics.e_score_correction_bias [2, E] (text row, vision row); no vision tower or resampler."""

import re

from models.args import DENSE, SPARSE, AttentionArgs, ModelArgs, RopeArgs, RouterArgs
from models.checkpoint import CheckpointError
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.text_tower import TextTower

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, moe_num_experts=8, moe_k=2,
    moe_intermediate_size=[32, 16],  # text experts, vision experts (other widths, as the release's 1536 / 512)
    moe_num_shared_experts=1, moe_norm_min=1e-12, mlp_layer_types=["dense", "sparse", "sparse"],
    use_bias=False, max_position_embeddings=256,
    # the release's 3-D rope sections (height, width, time: 22, 22, 20 of 64), scaled to 8 frequencies
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]},
    tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

TOWER = TextTower(model="Ernie4_5_VLMoeTextModel", composite="ernie4_5_vl_moe",
                  architecture="Ernie4_5_VLMoeForConditionalGeneration", composite_config="Ernie4_5_VLMoeConfig")


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"ernie4_5_vl_moe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(set(c.mlp_layer_types) <= {SPARSE, DENSE}, f"ernie4_5_vl_moe: mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    text_width = c.moe_intermediate_size[0]
    return hf_args(
        c, "ernie4_5_vl_moe", rope=RopeArgs(rope_theta(c), interleave=True, fp32=True),  # HF rotates in fp32
        attention=AttentionArgs(qkv_bias=c.use_bias, o_bias=c.use_bias), mlp_bias=c.use_bias,
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size,
        num_experts=c.moe_num_experts, moe_intermediate_size=text_width,
        router=RouterArgs(norm_topk_prob=True, norm_topk_min=float(c.moe_norm_min), correction_bias=True, fp32=True,
                          fp32_params=("weight", "e_score_correction_bias")),  # HF: _keep_in_fp32_modules_strict
        shared_expert_intermediate_size=text_width * (c.moe_num_shared_experts or 0), shared_expert_gated=False,
    )


EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(.*)")
TOWERS = ("vision_model.", "model.vision_model.", "resampler_model.", "model.resampler_model.", "model.visual.",
          "vision_tower.", "model.vision_tower.")


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's text experts (the first E of experts.{0..2E-1}), its text router (mlp.gate.weight [H, E],
    transposed) and the text row of its correction biases, without the vision experts, router and tower."""
    n = args.num_experts
    w = {}
    for k, t in weights.items():
        if k.startswith(TOWERS) or k.endswith("mlp.gate.weight_1"):
            continue
        k = k.replace("model.language_model.", "model.", 1)
        if m := EXPERT.fullmatch(k):
            if int(m.group(2)) >= n:  # a vision expert
                continue
        elif k.endswith("mlp.gate.weight"):
            if t.ndim != 2 or t.shape[1] != n:
                raise CheckpointError(f"{k} has shape {tuple(t.shape)}, expected the release's [hidden, {n}]")
            t = t.t().contiguous()
        elif k.endswith("mlp.moe_statics.e_score_correction_bias"):
            k, t = k.replace("mlp.moe_statics.", "mlp.gate."), t.reshape(-1, n)[0]  # the text experts' row
        w[k] = t
    return sanitize_hf(w, args)


FAMILY = Family(
    name="ernie4_5_vl_moe", model_types=("ernie4_5_vl_moe", "ernie4_5_vl_moe_text"), hf_module="ernie4_5_vl_moe",
    hf_class_name="Ernie4_5_VLMoeTextModel", hf_config_name="Ernie4_5_VLMoeTextConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, text_tower=TOWER, hf_router="mlp.text_moe.gate",
    experts="moe_num_experts", top_k="moe_k", rules=(("positive", "intermediate_size"),),
)
