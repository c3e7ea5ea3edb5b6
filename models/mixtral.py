"""Mixtral: plain attention, softmax top-k routing always renormalised (weights kept in fp32)."""

from models import Family, ModelArgs, hf_args, sanitize_hf
from models.checkpoint import stack_experts
from models.quantized import unstack_experts

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    sliding_window=None, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    return hf_args(
        c, "mixtral", sliding_window=c.sliding_window, num_experts=c.num_local_experts,
        moe_intermediate_size=c.intermediate_size, norm_topk_prob=True, router_weights_in_model_dtype=False,
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # original Mixtral layout: block_sparse_moe.{gate, experts.{e}.w1/w3/w2} (gate/up/down)
    w = {k.replace(".block_sparse_moe.", ".mlp."): t for k, t in weights.items()}
    w = stack_experts(w, r"(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight", ("w1", "w3", "w2"))
    return sanitize_hf(w, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's block_sparse_moe.switch_mlp.{gate,up,down}_proj -> experts.{e}.w1/w3/w2."""
    return unstack_experts(weights, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})


FAMILY = Family(
    name="mixtral", model_types=("mixtral",), hf_module="mixtral", hf_class_name="MixtralForCausalLM",
    hf_config_name="MixtralConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, from_mlx=from_mlx,
)
