"""LFM2-MoE (lfm2_moe, Liquid AI's LFM2-8B-A1B): most layers are gated short convolutions (layer type "conv":
models/layers/short_conv.py, in_proj to B, C, x; C * causal_conv(B * x) with conv_L_cache taps and the conv state
carried for decode; out_proj), the rest GQA attention with a per-head q/k RMSNorm before the rotation (q_layernorm,
k_layernorm; the output projection out_proj); one operator norm before the mixer, one before the MLP (operator_norm,
ffn_norm), and the final norm named embedding_norm although it follows the layers. The first num_dense_layers have a
dense SwiGLU MLP (w1 gate, w3 up, w2 down), the rest experts chosen on sigmoid scores plus an expert_bias (the choice
only), the chosen scores renormalised (+1e-6) and times routed_scaling_factor. Embeddings tied (tie_embedding).
mlx-lm's lfm2_moe and llama.cpp's LFM2MoE have it."""

from models.args import CONV, DENSE, FULL, SPARSE, AttentionArgs, ModelArgs, RopeArgs, RouterArgs, ShortConvArgs
from models.family import Family
from models.checkpoint import unstack_experts
from models.mapping import hf_args, renamed, require, rope_theta, sanitize_hf
from models.mlx_lm import DEFAULT_ROPE, MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    # every layer kind: a dense conv layer, sparse conv and attention layers (the release: 2 dense, 6 attention of 24)
    num_dense_layers=1, layer_types=[CONV, FULL, CONV, FULL], conv_L_cache=3, conv_bias=False,
    use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, CONV}, f"lfm2_moe: unknown layer_types {sorted(set(c.layer_types))}")
    n, dense = c.num_hidden_layers, c.num_dense_layers or 0
    return hf_args(
        c, "lfm2_moe", layer_types=tuple(c.layer_types), rms_norm_eps=c.norm_eps, rope=RopeArgs(rope_theta(c)),
        short_conv=ShortConvArgs(kernel=c.conv_L_cache, bias=bool(c.conv_bias)),
        attention=AttentionArgs(qk_norm="head"),
        mlp_types=tuple(DENSE if i < dense else SPARSE for i in range(n)), intermediate_size=c.intermediate_size,
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        # HF: the logits and their sigmoid in the model's dtype, the choice on sigmoid + expert_bias (fp32), the
        # chosen sigmoids / (sum + 1e-6) * routed_scaling_factor
        router=RouterArgs(scoring="sigmoid", correction_bias=bool(c.use_expert_bias),
                          norm_topk_prob=bool(c.norm_topk_prob), norm_eps=1e-6,
                          routed_scaling_factor=float(c.routed_scaling_factor),
                          fp32_params=("e_score_correction_bias",)),  # HF's expert_bias: an fp32 buffer
    )


# HF's names (in memory and the release's) -> the production model's, part by part: the one map the checkpoint
# (sanitize) and the drill (hf_point_names) read. out_proj is o_proj in the conv mixer too (production ShortConv)
NAMES = {"operator_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "feed_forward": "mlp",
         "embedding_norm": "norm", "out_proj": "o_proj", "q_layernorm": "q_norm", "k_layernorm": "k_norm",
         "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf({renamed(k, NAMES).replace(".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"): t
                        for k, t in weights.items()}, args)


# the trained profile's names for HF's in-memory ones (Family.hf_profile_view): the residual-stream norms and the
# q/k norms by role, the attention's output projection (the conv mixer's out_proj is a writer under its own name)
PROFILE = {k: NAMES[k] for k in ("operator_norm", "ffn_norm", "q_layernorm", "k_layernorm")}


def profile_view(sd: dict, cfg: dict) -> dict:
    return {renamed(k, PROFILE).replace(".self_attn.out_proj.", ".self_attn.o_proj."): t for k, t in sd.items()}


# mlx-lm's sanitize: w1/w3/w2 -> gate/up/down_proj (dense and expert), experts stacked, conv.weight [H, K, 1]
TO_RELEASE = {NAMES[w]: w for w in ("w1", "w3", "w2")}


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names and layouts -> the release's: per-expert w1/w3/w2, the dense MLP's too, conv [H, 1, K]."""
    out = {}
    for k, v in unstack_experts(weights, TO_RELEASE).items():
        if k.endswith(".conv.weight") and v.ndim == 3 and v.shape[-1] == 1:
            v = v.moveaxis(2, 1)
        out[renamed(k, TO_RELEASE) if ".feed_forward." in k else k] = v
    return out


def attention_layers(c) -> list:
    return [i for i, t in enumerate(c.layer_types) if t == FULL]


MLX = MlxLm(
    module="lfm2_moe",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", moe_intermediate_size="moe_intermediate_size",
        num_hidden_layers="num_hidden_layers", num_experts="num_experts", num_experts_per_tok="num_experts_per_tok",
        norm_topk_prob="norm_topk_prob", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", max_position_embeddings="max_position_embeddings",
        use_expert_bias="use_expert_bias", num_dense_layers=lambda c: c.num_dense_layers or 0, norm_eps="norm_eps",
        conv_bias="conv_bias", conv_L_cache="conv_L_cache", rope_theta=rope_theta,
        routed_scaling_factor="routed_scaling_factor", rope_parameters=const(None),
        full_attn_idxs=attention_layers, layer_types=lambda c: list(c.layer_types),
    ),
    require=DEFAULT_ROPE + (
        (lambda c: c.tie_word_embeddings, "untied embeddings (mlx-lm's lfm2_moe always ties its head)"),
        (lambda c: FULL in c.layer_types, "layer_types without a full_attention layer (mlx-lm's lfm2_moe looks one up)"),
    ),
    expert_names={"gate": "w1", "up": "w3", "down": "w2"}, moe="feed_forward",
)

FAMILY = Family(
    name="lfm2_moe", model_types=("lfm2_moe",), hf_module="lfm2_moe", hf_class_name="Lfm2MoeForCausalLM",
    hf_config_name="Lfm2MoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX,
    from_mlx=from_mlx, hf_profile_view=profile_view,
    hf_attention=("self_attn", "conv"), hf_moe="feed_forward", hf_router="feed_forward.gate",
    hf_mlp="feed_forward", hf_router_bias="feed_forward.expert_bias", hf_point_names=NAMES,
    rules=(("positive", "intermediate_size", "moe_intermediate_size", "conv_L_cache"),
           ("within_depth", "num_dense_layers")),
)
