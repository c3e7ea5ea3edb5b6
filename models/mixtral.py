"""Mixtral: plain attention, softmax top-k routing always renormalised (weights kept in fp32)."""

from models import Family, ModelArgs, rope_theta, strip_prefix, tie_embeddings
from models.checkpoint import stack_experts, stack_hf_experts
from models.layers import FULL

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    sliding_window=None, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    return ModelArgs(
        family="mixtral", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=rope_theta(c), sliding_window=c.sliding_window,
        num_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.intermediate_size, norm_topk_prob=True,
        router_weights_in_model_dtype=False,
        layer_types=(FULL,) * c.num_hidden_layers, tie_word_embeddings=c.tie_word_embeddings,
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    w = strip_prefix(weights)
    # original Mixtral layout: block_sparse_moe.{gate, experts.{e}.w1/w3/w2} (gate/up/down)
    w = {k.replace(".block_sparse_moe.", ".mlp."): t for k, t in w.items()}
    w = stack_experts(w, r"(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight", ("w1", "w3", "w2"))
    w = stack_hf_experts(w)
    return tie_embeddings(w, args)


FAMILY = Family(
    name="mixtral", model_types=("mixtral",), hf_module="mixtral", hf_class_name="MixtralForCausalLM",
    hf_config_name="MixtralConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
)
