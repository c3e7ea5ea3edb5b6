"""PhiMoE (Phi-3.5-MoE): LayerNorm with bias (eps from rms_norm_eps), biased q/k/v/o and lm_head,
LongRoPE, 16 experts routed by sparsemixer: the best expert, then the best of the others, each
weighted by its softmax among the experts within 2 * router_jitter_noise of it (relative)."""

from models.args import SLIDING, AttentionArgs, LongRoPE, ModelArgs, NormArgs, RopeArgs, RouterArgs
from models.checkpoint import CheckpointError, stack_experts, unstack_experts
from models.family import Family
from models.mapping import hf_args, require, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const, rope_parameters

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    attention_bias=True, lm_head_bias=True, router_jitter_noise=0.01, input_jitter_noise=0.0,
    max_position_embeddings=256, sliding_window=None,
    # LongRoPE as the release has it (per-dim factors, short_mscale == long_mscale), over 8 rotary pairs
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                     "short_factor": [1.0, 1.05, 1.1, 1.3, 1.7, 2.4, 3.6, 5.0],
                     "long_factor": [1.0, 1.2, 1.6, 2.4, 4.0, 7.0, 12.0, 20.0],
                     "short_mscale": 1.2, "long_mscale": 1.2},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def longrope(c) -> LongRoPE | None:
    """The LongRoPE scaling of a config with rope_type longrope; None for default RoPE."""
    rp = rope_parameters(c)
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "longrope":
        raise CheckpointError(f"phimoe: rope_type {kind!r} is not supported (only 'default' and 'longrope')")
    omp = getattr(c, "original_max_position_embeddings", None) or rp["original_max_position_embeddings"]
    return LongRoPE(int(omp), float(rp["short_mscale"]), float(rp["long_mscale"]), tuple(map(float, rp["short_factor"])))


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"phimoe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    rp = rope_parameters(c)
    window = c.sliding_window
    return hf_args(
        c, "phimoe", head_dim=c.hidden_size // c.num_attention_heads,
        rope=RopeArgs.scaled(float(rp["rope_theta"]), longrope(c)), norm=NormArgs("layer"),
        attention=AttentionArgs(qkv_bias=c.attention_bias, o_bias=c.attention_bias, sliding_window=window),
        lm_head_bias=c.lm_head_bias, num_experts=c.num_local_experts, moe_intermediate_size=c.intermediate_size,
        num_experts_per_tok=2,  # sparsemixer is top-2 whatever num_experts_per_tok says (HF and mlx-lm)
        router=RouterArgs("sparsemixer", norm_topk_prob=False, jitter_eps=float(c.router_jitter_noise)),
        layer_types=((SLIDING if window else "full_attention"),) * c.num_hidden_layers,
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # published: block_sparse_moe.{gate, experts.{e}.w1/w3/w2}; transformers' in-memory: mlp.router
    w = {k.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate."): t for k, t in weights.items()}
    w = stack_experts(w, r"(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight", ("w1", "w3", "w2"))
    return sanitize_hf(w, args)


def from_mlx(weights: dict, config: dict) -> dict:
    return unstack_experts(weights, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})


def _rope_scaling(c):
    """mlx-lm's SuScaledRoPE scales by long_factor and long_mscale at every length; HF 5.23 by
    short_factor always (and short_mscale up to original_max_position_embeddings): give mlx-lm HF's."""
    rp = rope_parameters(c)
    if rp.get("rope_type", "default") == "default":
        return None
    return {"type": "longrope", "short_factor": rp["short_factor"], "long_factor": rp["short_factor"],
            "short_mscale": rp["short_mscale"], "long_mscale": rp["short_mscale"]}


MLX = MlxLm(
    module="phimoe",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", num_hidden_layers="num_hidden_layers",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        max_position_embeddings="max_position_embeddings",
        original_max_position_embeddings=lambda c: longrope(c).original_max_position_embeddings if longrope(c)
        else c.max_position_embeddings,
        rms_norm_eps="rms_norm_eps", rope_theta=lambda c: float(rope_parameters(c)["rope_theta"]),
        rope_scaling=_rope_scaling, num_local_experts="num_local_experts", num_experts_per_tok=const(2),
        router_jitter_noise="router_jitter_noise",
    ),
    require=COMMON_REQUIRE + (
        (lambda c: c.attention_bias and c.lm_head_bias, "attention_bias or lm_head_bias False (mlx-lm's phimoe "
                                                        "always has them)"),
        (lambda c: not longrope(c) or longrope(c).short_mscale == longrope(c).long_mscale,
         "short_mscale != long_mscale (mlx-lm's SuScaledRoPE has one scale for every length)"),
        (lambda c: not c.sliding_window or c.sliding_window >= c.max_position_embeddings,
         "a sliding_window shorter than max_position_embeddings (mlx-lm's phimoe has none)"),
        (lambda c: getattr(c, "head_dim", None) in (None, c.hidden_size // c.num_attention_heads),
         "head_dim != hidden_size / num_attention_heads (mlx-lm's phimoe derives it)"),
        (lambda c: not c.tie_word_embeddings, "tie_word_embeddings (mlx-lm's phimoe has its own lm_head)"),
    ),
    moe="block_sparse_moe", expert_names={"gate": "w1", "up": "w3", "down": "w2"},
)

FAMILY = Family(
    name="phimoe", model_types=("phimoe",), hf_module="phimoe", hf_class_name="PhimoeForCausalLM",
    hf_config_name="PhimoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    hf_router="mlp.router", from_mlx=from_mlx, mlx=MLX,
    # sparsemixer routes every token to two experts, whatever num_experts_per_tok says
    experts="num_local_experts", rules=(("positive", "intermediate_size", "sliding_window"),
                                        ("at_least", "num_local_experts", 2)),
)
