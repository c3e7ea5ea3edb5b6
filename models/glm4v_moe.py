"""GLM-4.5V's text tower (glm4v_moe), on text input: GLM-4.5's mechanisms (glm4_moe) without the q/k norm:
GQA with q/k/v biases (no o bias), partial rotary (partial_rotary_factor, 0.5 by default), the first
`first_k_dense_replace` layers dense, then experts chosen as DeepSeek-V3 does (sigmoid + correction bias,
group-limited, fp32), renormalised, times routed_scaling_factor, plus always-on shared experts; under
MRoPE. On text MRoPE is 1-D rope: the text model gives every axis (temporal, height, width) the token's
position (its default without position ids; get_rope_index gives text tokens the same), so each
mrope_section's frequencies are rotated by that one position, as plain partial rope with the same
rope_theta does (tests/test_text_tower.py).

The reference is HF's Glm4vMoeTextModel with the release's lm_head (models.text_tower). The tiny
checkpoint has the release's layout: config.json the composite glm4v_moe one (text_config nested,
architectures Glm4vMoeForConditionalGeneration), the language model at model.language_model.*, lm_head at
the top, the experts per expert (experts.{e}.gate/up/down_proj, transformers' glm4v_moe conversion), no
vision tower."""

from models.args import AttentionArgs, ModelArgs, RopeArgs
from models.family import Family
from models.mapping import (deepseek_router, drop_layers_from, first_k_dense, hf_args, require, rope_theta, sanitize_hf,
                            sigmoid_routing)
from models.mlx_lm import rope_parameters
from models.qwen3_vl_moe import release_names
from models.rules import FIRST_K_DENSE, GROUPED
from models.text_tower import TextTower

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, attention_bias=True, max_position_embeddings=256,
    # the release's MRoPE over half the head (partial_rotary_factor 0.5), its sections scaled to 4
    # frequencies (head_dim 16: 8 rotary dims)
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1]},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

TOWER = TextTower(model="Glm4vMoeTextModel", composite="glm4v_moe", architecture="Glm4vMoeForConditionalGeneration",
                  composite_config="Glm4vMoeConfig")


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"glm4v_moe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    return hf_args(c, "glm4v_moe", attention=AttentionArgs(qkv_bias=c.attention_bias, o_bias=False),
                   rope=RopeArgs(rope_theta(c), partial_rotary_factor=float(
                       rope_parameters(c).get("partial_rotary_factor", 1.0))),  # as HF's rotary reads it
                   **first_k_dense(c), router=deepseek_router(c, **sigmoid_routing(c)))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(release_names(weights), args.num_hidden_layers), args)


FAMILY = Family(
    name="glm4v_moe", model_types=("glm4v_moe", "glm4v_moe_text"), hf_module="glm4v_moe",
    hf_class_name="Glm4vMoeTextModel", hf_config_name="Glm4vMoeTextConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, text_tower=TOWER,
    experts="n_routed_experts", rules=(*GROUPED, *FIRST_K_DENSE),
)
