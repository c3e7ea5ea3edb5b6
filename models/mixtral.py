"""Mixtral: plain attention, softmax top-k routing always renormalised (weights kept in fp32)."""

from models.args import FULL, SLIDING, AttentionArgs, ModelArgs, RouterArgs
from models.checkpoint import stack_experts, unstack_experts
from models.family import Family
from models.mapping import hf_args, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, rope

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    sliding_window=None, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    return hf_args(
        # a sliding_window applies to every layer (the layers that have one are SLIDING)
        c, "mixtral", attention=AttentionArgs(sliding_window=c.sliding_window),
        layer_types=((SLIDING if c.sliding_window else FULL),) * c.num_hidden_layers, num_experts=c.num_local_experts,
        moe_intermediate_size=c.intermediate_size,
        router=RouterArgs(norm_topk_prob=True, weights_in_model_dtype=False),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # original Mixtral layout: block_sparse_moe.{gate, experts.{e}.w1/w3/w2} (gate/up/down)
    w = {k.replace(".block_sparse_moe.", ".mlp."): t for k, t in weights.items()}
    w = stack_experts(w, r"(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight", ("w1", "w3", "w2"))
    return sanitize_hf(w, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's block_sparse_moe.switch_mlp.{gate,up,down}_proj -> experts.{e}.w1/w3/w2."""
    return unstack_experts(weights, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})


MLX = MlxLm(
    module="mixtral",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", rms_norm_eps="rms_norm_eps", vocab_size="vocab_size",
        num_local_experts="num_local_experts", num_experts_per_tok="num_experts_per_tok",
        tie_word_embeddings="tie_word_embeddings", **rope(rope_theta),
    ),
    require=COMMON_REQUIRE + (
        (lambda c: c.head_dim in (None, c.hidden_size // c.num_attention_heads),
         "head_dim != hidden_size / num_attention_heads (mlx-lm's mixtral derives it)"),
        (lambda c: c.sliding_window is None, "sliding_window (mlx-lm's mixtral has none)"),
    ),
    moe="block_sparse_moe", expert_names={"gate": "w1", "up": "w3", "down": "w2"},
)

FAMILY = Family(
    name="mixtral", model_types=("mixtral",), hf_module="mixtral", hf_class_name="MixtralForCausalLM",
    hf_config_name="MixtralConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, from_mlx=from_mlx, mlx=MLX,
    experts="num_local_experts", rules=(("positive", "intermediate_size", "sliding_window"),),
)
