"""Qwen3-Omni-MoE's thinker (qwen3_omni_moe), its language model, on text input: Qwen3-MoE's mechanisms
(per-head q/k RMSNorm, softmax top-k routing renormalised when norm_topk_prob, no shared expert, every
layer MoE) under interleaved MRoPE, as Qwen3-VL-MoE's text tower. On text MRoPE is 1-D rope: the thinker's
text model gives every axis the token's position (its default without position ids; get_rope_index gives
text tokens the same), so every frequency is rotated by that one position (tests/test_text_tower.py).
The talker (a codec MoE that speaks the thinker's output) and code2wav are not the language model.

The reference is HF's Qwen3OmniMoeThinkerTextModel with the thinker's lm_head (models.text_tower). The
tiny checkpoint has the release's layout: config.json the composite qwen3_omni_moe one (the text config
at thinker_config.text_config, architectures Qwen3OmniMoeForConditionalGeneration), the language model at
thinker.model.* and the head at thinker.lm_head (what transformers' Qwen3-Omni conversion reads into
thinker.model.language_model), the experts per expert (experts.{e}.gate/up/down_proj), no other tower."""

from models.args import AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, sanitize_hf
from models.text_tower import TextTower

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=256,
    # the release's interleaved MRoPE sections, scaled to head_dim 16 (8 frequencies: 4 + 2 + 2)
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2],
                     "interleaved": True, "mrope_interleaved": True},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

TOWER = TextTower(model="Qwen3OmniMoeThinkerTextModel", composite="qwen3_omni_moe",
                  architecture="Qwen3OmniMoeForConditionalGeneration", composite_config="Qwen3OmniMoeConfig",
                  path="thinker.model", head="thinker.lm_head", nest=("thinker_config", "text_config"))


def to_args(c) -> ModelArgs:
    require(not c.mlp_only_layers and c.decoder_sparse_step == 1,
            "qwen3_omni_moe: dense MLP layers (mlp_only_layers / decoder_sparse_step > 1) are not supported yet")
    return hf_args(
        c, "qwen3_omni_moe", attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=c.norm_topk_prob),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's thinker.model.* / thinker.lm_head (transformers' in-memory thinker.model.language_model.*
    too) as model.* / lm_head, without the thinker's audio and vision towers, the talker and code2wav."""
    w = {}
    for k, t in weights.items():
        if not k.startswith("thinker.") or k.startswith(("thinker.visual.", "thinker.audio_tower.",
                                                          "thinker.model.visual.", "thinker.model.audio_tower.")):
            continue
        k = k[len("thinker."):]
        w[k.replace("model.language_model.", "model.", 1)] = t
    return sanitize_hf(w, args)


FAMILY = Family(
    name="qwen3_omni_moe", model_types=("qwen3_omni_moe", "qwen3_omni_moe_text"), hf_module="qwen3_omni_moe",
    hf_class_name="Qwen3OmniMoeThinkerTextModel", hf_config_name="Qwen3OmniMoeTextConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, text_tower=TOWER,
    rules=(("positive", "moe_intermediate_size", "decoder_sparse_step"), ("layer_index", "mlp_only_layers")),
)
