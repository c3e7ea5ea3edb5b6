"""ERNIE 4.5 MoE: rotary pairs interleaved over the whole head, dense layers except every
moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index, a softmax router in fp32
whose correction bias (moe_statics) decides the choice only, the top-k weights divided by
max(sum, moe_norm_min), and always-on shared experts (no gate)."""

from models.args import DENSE, SPARSE, AttentionArgs, ModelArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, DEFAULT_ROPE, MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
    moe_num_shared_experts=2,
    # MoE on layers 1 and 3 (interval 2: an interleave off by one changes which layers are MoE)
    moe_layer_start_index=1, moe_layer_interval=2, moe_layer_end_index=3, moe_norm_min=1e-12,
    use_bias=False, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def mlp_types(c) -> tuple:
    """HF's rule (Ernie4_5_MoeDecoderLayer): experts where (i + 1) % interval == 0 and
    start <= i <= end (end -1 is the last layer: HF's config resolves it)."""
    end = c.moe_layer_end_index if c.moe_layer_end_index >= 0 else c.num_hidden_layers - 1
    return tuple(SPARSE if (i + 1) % c.moe_layer_interval == 0 and c.moe_layer_start_index <= i <= end else DENSE
                 for i in range(c.num_hidden_layers))


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"ernie4_5_moe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(isinstance(c.moe_layer_start_index, int) and isinstance(c.moe_layer_end_index, int),
            "ernie4_5_moe: per-modality moe_layer_start/end_index lists (the VL model) are not supported")
    return hf_args(
        c, "ernie4_5_moe", rope=RopeArgs(rope_theta(c), interleave=True, fp32=True),  # HF rotates q and k "in full precision"
        attention=AttentionArgs(qkv_bias=c.use_bias, o_bias=c.use_bias), mlp_bias=c.use_bias,
        lm_head_bias=c.use_bias, mlp_types=mlp_types(c), intermediate_size=c.intermediate_size,
        num_experts=c.moe_num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=True, norm_topk_min=float(c.moe_norm_min), correction_bias=True, fp32=True,
                          fp32_params=("weight", "e_score_correction_bias")),  # HF: _keep_in_fp32_modules_strict
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.moe_num_shared_experts or 0),
        shared_expert_gated=False,
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # the correction bias: mlp.moe_statics.e_score_correction_bias [1, E] on disk,
    # mlp.gate.moe_statics.e_score_correction_bias in transformers' memory
    w = {}
    for k, t in weights.items():
        if k.endswith("moe_statics.e_score_correction_bias"):
            k, t = k[: k.index(".mlp.")] + ".mlp.gate.e_score_correction_bias", t.reshape(-1)
        w[k] = t
    return sanitize_hf(w, args)


MLX = MlxLm(
    module="ernie4_5_moe",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", intermediate_size="intermediate_size",
        max_position_embeddings="max_position_embeddings", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", num_hidden_layers="num_hidden_layers",
        rms_norm_eps="rms_norm_eps", vocab_size="vocab_size", rope_theta=rope_theta, use_bias="use_bias",
        tie_word_embeddings="tie_word_embeddings", moe_num_experts="moe_num_experts", moe_k="moe_k",
        moe_intermediate_size="moe_intermediate_size", moe_num_shared_experts="moe_num_shared_experts",
        moe_layer_start_index="moe_layer_start_index", moe_layer_interval="moe_layer_interval",
        moe_layer_end_index=lambda c: c.moe_layer_end_index if c.moe_layer_end_index >= 0 else c.num_hidden_layers - 1,
        head_dim=lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        moe_gate_act=const("softmax"), moe_capacity=const([]), moe_use_aux_free=const(False),  # unused by mlx-lm
    ),
    require=COMMON_REQUIRE + DEFAULT_ROPE + (
        (lambda c: not c.use_bias, "use_bias (mlx-lm's ernie4_5_moe puts biases on the experts and none on lm_head)"),
        (lambda c: c.moe_norm_min == 1e-12, "moe_norm_min other than 1e-12 (mlx-lm hard-codes it)"),
    ),
    # mlx-lm's sanitize() removes it and its gate has none (goldens/known_divergences.toml): a shipped
    # directory's HF reference takes the original's
    dropped=("e_score_correction_bias",),
)

FAMILY = Family(
    name="ernie4_5_moe", model_types=("ernie4_5_moe",), hf_module="ernie4_5_moe",
    hf_class_name="Ernie4_5_MoeForCausalLM", hf_config_name="Ernie4_5_MoeConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, mlx=MLX,
    experts="moe_num_experts", top_k="moe_k",
    rules=(("positive", "moe_intermediate_size", "intermediate_size", "moe_layer_interval"),
           ("within_depth", "moe_layer_start_index"), ("within_depth", "moe_layer_end_index")),
)
