"""MiniMax-M2 (minimax_m2): GQA with a flat q/k RMSNorm over each whole projection, partial rotary (the
release's `rotary_dim`, HF's partial_rotary_factor), experts chosen on sigmoid scores plus a correction
bias and their sigmoid scores renormalised as weights (kept in fp32), no shared expert. HF keeps the
correction bias on the MoE block and passes it to the router (Family.hf_router_bias); the release names
the block `block_sparse_moe` with Mixtral's per-expert w1/w3/w2."""

from models.args import AttentionArgs, ModelArgs, RopeArgs, RouterArgs
from models.checkpoint import stack_experts, unstack_experts
from models.family import Family
from models.mapping import hf_args, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, DEFAULT_ROPE, MlxLm, const, head_dim, rope_parameters

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    # the release's own fields: its rotary width `rotary_dim` (HF derives partial_rotary_factor from it) and
    # `scoring_func` (HF always takes the sigmoid; llama.cpp's converter reads both, mlx-lm the first)
    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}, rotary_dim=8, scoring_func="sigmoid",
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def partial_rotary(c) -> float:
    return float(rope_parameters(c).get("partial_rotary_factor", 1.0))


def to_args(c) -> ModelArgs:
    return hf_args(
        c, "minimax_m2", attention=AttentionArgs(qk_norm="flat"),
        rope=RopeArgs(rope_theta(c), partial_rotary_factor=partial_rotary(c)),
        num_experts=c.num_local_experts, moe_intermediate_size=c.intermediate_size,
        # HF: logits in the model's dtype, sigmoid in fp32, the choice on scores + bias, the weights the
        # chosen sigmoid scores renormalised, kept in fp32 into the experts' sum (as Mixtral's)
        router=RouterArgs(scoring="sigmoid", correction_bias=True, norm_topk_prob=True, weights_in_model_dtype=False),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # the release's block_sparse_moe.{gate, e_score_correction_bias, experts.{e}.w1/w3/w2} (gate/up/down)
    w = {k.replace(".block_sparse_moe.", ".mlp."): t for k, t in weights.items()}
    w = {k.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"): t for k, t in w.items()}
    w = stack_experts(w, r"(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight", ("w1", "w3", "w2"))
    return sanitize_hf(w, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's block_sparse_moe.switch_mlp.{gate,up,down}_proj -> experts.{e}.w1/w3/w2."""
    return unstack_experts(weights, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})


def rotary_dim(c) -> int:
    return int(head_dim(c) * partial_rotary(c))


MLX = MlxLm(
    module="minimax",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", intermediate_size="intermediate_size",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        max_position_embeddings="max_position_embeddings", num_experts_per_tok="num_experts_per_tok",
        num_local_experts="num_local_experts", shared_intermediate_size=const(0),  # no shared expert
        num_hidden_layers="num_hidden_layers", rms_norm_eps="rms_norm_eps", rope_theta=rope_theta,
        rotary_dim=rotary_dim, vocab_size="vocab_size", tie_word_embeddings="tie_word_embeddings",
        scoring_func=const("sigmoid"), head_dim=head_dim, use_qk_norm=const(True),
    ),
    require=COMMON_REQUIRE + DEFAULT_ROPE,
    moe="block_sparse_moe", expert_names={"gate": "w1", "up": "w3", "down": "w2"},
)

FAMILY = Family(
    name="minimax_m2", model_types=("minimax_m2",), hf_module="minimax_m2", hf_class_name="MiniMaxM2ForCausalLM",
    hf_config_name="MiniMaxM2Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize, from_mlx=from_mlx,
    mlx=MLX, hf_router_bias="mlp.e_score_correction_bias", experts="num_local_experts",
    rules=(("positive", "intermediate_size"),),
)
