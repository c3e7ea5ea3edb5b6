"""DeepSeek-V3.2 (-Exp): DeepSeek-V3 with DeepSeek sparse attention (DSA). Each layer's latent attention (always
through the q_lora_rank bottleneck, interleaved rotary pairs, YaRN) attends only to the index_topk keys its
lightning indexer chooses per query (models/layers/dsa.py: its own queries from the MLA's q latent, one
LayerNorm-ed key per position, both rotated half-split on their first qk_rope_head_dim dims; relu'd head scores
weighted per head by weights_proj); the first `first_k_dense_replace` layers dense, the others DeepSeek-V3's
routing (sigmoid + correction bias, group-limited, renormalised, routed_scaling_factor) plus always-on shared
experts.

The tiny config makes the sparsity bite: index_topk 4 below the default prompt (8 tokens), so from the fifth
query on each attends to 4 of its keys (dense attention differs by 1.4-4 in the logits); 16 index heads, so that a
key's score is rarely relu'd to an exact 0 by every head (a tie topk would break arbitrarily; the fp32 gap between the
4th and 5th key at least 1.4e-3 at seeds 0-2); index_head_dim 128, the release's (with 16, llama.cpp's graph aborts at
load: GGML_ASSERT(ggml_can_mul_mat(a, b)))."""

from dataclasses import replace

from models.args import DENSE, DSA, SPARSE, ModelArgs
from models.deepseek_v3 import from_mlx
from models.family import Family
from models.glm4_moe_lite import first_dense, mlp_types
from models.mapping import (deepseek_router, drop_layers_from, hf_args, mla, require, rope_of, rope_theta_any,
                            sanitize_hf, sigmoid_routing)
from models.mlx_lm import COMMON_REQUIRE, MLA_NAMES, NOAUX, UNTIED, YARN_REQUIRE, MlxLm, const, yarn_scaling
from models.rules import GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=256,
    # YaRN as the release has it (factor 40 over 4096 positions, mscale 1 / 1), scaled to the tiny model
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    # the sparsity bites: 4 keys of the default prompt's 8 (and of every decode step's more)
    index_topk=4, index_head_dim=128, index_n_heads=16,  # (index_head_dim: the release's, which llama.cpp needs)
    # the release's own fields (HF keeps them as they are; llama.cpp's converter takes the gating function from
    # scoring_func, and its loader refuses a GGUF without it)
    scoring_func="sigmoid", topk_method="noaux_tc",
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def dsa(c, **how) -> DSA:
    """The indexer's dimensions of a DeepSeek-V3.2 config; `how`: GLM-5's interleaved rotation and shared layers."""
    require(c.index_head_dim >= c.qk_rope_head_dim,
            f"index_head_dim {c.index_head_dim} < qk_rope_head_dim {c.qk_rope_head_dim} "
            "(the indexer rotates that many dims)")
    return DSA(index_topk=c.index_topk, index_head_dim=c.index_head_dim, index_n_heads=c.index_n_heads, **how)


def dsa_args(c, family: str, **how) -> ModelArgs:
    """ModelArgs of a DSA model (DeepSeek-V3.2's layer stack; `how`: the indexer's options, dsa())."""
    require(c.hidden_act == "silu", f"{family}: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(bool(c.q_lora_rank), f"{family}: q_lora_rank {c.q_lora_rank!r} (HF's attention always has the bottleneck)")
    # HF's MLA always rotates interleaved pairs (DeepseekV32Config has no rope_interleave)
    return hf_args(c, family, rope=rope_of(c, interleave=True), attention=replace(mla(c), dsa=dsa(c, **how)),
                   mlp_types=mlp_types(c), intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
                   shared_expert_gated=False, router=deepseek_router(c, **sigmoid_routing(c)))


def to_args(c) -> ModelArgs:
    return dsa_args(c, "deepseek_v32")


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


# what mlx-lm's DeepSeek-V3.2 model (and its GLM-5 subclass) reads, beside MLA_NAMES
MLX_CONFIG = dict(
    **MLA_NAMES, index_head_dim="index_head_dim", index_n_heads="index_n_heads", index_topk="index_topk",
    topk_method=const("noaux_tc"), scoring_func=const("sigmoid"),  # what HF hard-codes
    norm_topk_prob="norm_topk_prob", moe_layer_freq=const(1), first_k_dense_replace=first_dense,
    rope_theta=rope_theta_any, rope_scaling=yarn_scaling,
)
MLX_REQUIRE = COMMON_REQUIRE + YARN_REQUIRE + NOAUX + UNTIED + (
    (lambda c: tuple(c.mlp_layer_types) == (DENSE,) * first_dense(c)
     + (SPARSE,) * (c.num_hidden_layers - first_dense(c)),
     "dense layers after a sparse one in mlp_layer_types (mlx-lm reads first_k_dense_replace)"),
)

MLX = MlxLm(module="deepseek_v32", config=dict(MLX_CONFIG, indexer_rope_interleave=const(False)), require=MLX_REQUIRE,
            array_mask=True)

DSA_RULES = (*GROUPED, ("positive", "moe_intermediate_size", "intermediate_size"), ("per_layer", "mlp_layer_types"),
             ("positive", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
              "index_topk", "index_head_dim", "index_n_heads"))

FAMILY = Family(
    name="deepseek_v32", model_types=("deepseek_v32",), hf_module="deepseek_v32",
    hf_class_name="DeepseekV32ForCausalLM", hf_config_name="DeepseekV32Config", tiny_config=TINY, to_args=to_args,
    sanitize=sanitize, from_mlx=from_mlx, mlx=MLX, experts="n_routed_experts", rules=DSA_RULES,
)
