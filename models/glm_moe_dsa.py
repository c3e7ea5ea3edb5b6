"""GLM-5 (glm_moe_dsa): DeepSeek-V3.2's layer stack (latent attention through q_lora_rank, interleaved rotary pairs;
DeepSeek sparse attention; dense first layers, DeepSeek-V3 routing with always-on shared experts) with two
differences in its indexer (models/layers/dsa.py): it rotates interleaved pairs (DeepSeek-V3.2's: half-split), and
it is shared across layers: `indexer_types` "shared" layers have no indexer and attend to the keys the previous
"full" layer's indexer chose (DSA.shared).

The tiny config: a full, a shared, then a full layer; index_topk 4 below the default prompt's 8 tokens."""

from models.args import ModelArgs
from models.deepseek_v3 import from_mlx
from models.deepseek_v32 import DSA_RULES, MLX_CONFIG, MLX_REQUIRE, dsa_args, sanitize
from models.family import Family
from models.mapping import require
from models.mlx_lm import MlxLm, const, rope_parameters

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    index_topk=4, index_head_dim=128, index_n_heads=16, indexer_types=["full", "shared", "full"],
    # the release's own fields (HF keeps them as they are; llama.cpp's converter takes the gating function from
    # scoring_func, and its loader refuses a GGUF without it)
    scoring_func="sigmoid", topk_method="noaux_tc",
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def shared_layers(c) -> tuple[bool, ...]:
    types = tuple(c.indexer_types)
    require(len(types) == c.num_hidden_layers,
            f"indexer_types has {len(types)} entries, num_hidden_layers is {c.num_hidden_layers}")
    require(set(types) <= {"full", "shared"},
            f"indexer_types {sorted(set(types) - {'full', 'shared'})} (only full, shared)")
    require(types[0] == "full", "indexer_types[0] 'shared' (HF: a shared layer needs a full one before it)")
    return tuple(t == "shared" for t in types)


def to_args(c) -> ModelArgs:
    return dsa_args(c, "glm_moe_dsa", rope_interleave=True, shared=shared_layers(c))


# mlx-lm's glm_moe_dsa (DeepSeek-V3.2's model with the interleaved indexer rotation) reads HF's rope_parameters as its
# rope_scaling and rope_theta (its __post_init__), and runs an indexer on every layer: no shared layers
MLX = MlxLm(
    module="glm_moe_dsa",
    config=dict(MLX_CONFIG, rope_parameters=rope_parameters, rope_scaling=const(None), rope_theta=const(None),
                indexer_rope_interleave=const(True)),
    require=MLX_REQUIRE + (
        (lambda c: "shared" not in c.indexer_types,
         "indexer_types 'shared' (mlx-lm's glm_moe_dsa runs an indexer on every layer: no cross-layer top-k sharing)"),
    ),
    array_mask=True,
)

FAMILY = Family(
    name="glm_moe_dsa", model_types=("glm_moe_dsa",), hf_module="glm_moe_dsa",
    hf_class_name="GlmMoeDsaForCausalLM", hf_config_name="GlmMoeDsaConfig", tiny_config=TINY, to_args=to_args,
    sanitize=sanitize, from_mlx=from_mlx, mlx=MLX, experts="n_routed_experts",
    rules=(*DSA_RULES, ("per_layer", "indexer_types")),
)
