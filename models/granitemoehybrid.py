"""GraniteMoeHybrid (IBM Granite 4.0-H): GraniteMoeShared's layer (models/granitemoeshared.py: the four multipliers,
top-k logits then softmax over those k, an always-on shared MLP beside the routed experts) with most layers' attention
replaced by a Mamba2 mixer (HF's layer type "linear_attention", its module `mamba`: models/layers/mamba2.py). The
attention layers have no rotary embedding unless position_embedding_type is "rope" (the release: none)."""

from models.args import FULL, LINEAR, MAMBA2, AttentionArgs, Mamba2Args, ModelArgs, RopeArgs
from models.family import Family
from models.granitemoeshared import sanitize
from models.granitemoeshared import to_args as granitemoeshared_args
from models.checkpoint import conv1d_from_mlx
from models.granitemoe import from_mlx as granitemoe_from_mlx
from models.mapping import require
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    layer_types=[LINEAR, FULL, LINEAR],  # Mamba2, NoPE attention, Mamba2 (the release: 9 Mamba2 to 1 attention)
    position_embedding_type="nope",
    # the Mamba2 mixer: inner width 2 x 64 = 8 heads of 16, B and C in one group (the release's), a state of 16;
    # chunks of 6 tokens, so a prompt spans chunks and the last one is padded (the release: 256)
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=6, mamba_conv_bias=True, mamba_proj_bias=False,
    # granitemoe's tiny multipliers (the release's, the attention one scaled to head_dim 16)
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=6.0,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, LINEAR}, f"granitemoehybrid: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.num_local_experts > 0, "granitemoehybrid: num_local_experts 0 (a dense Granite 4.0-H: no experts to "
                                     "check)")
    require(c.position_embedding_type in (None, "nope", "rope"),
            f"granitemoehybrid: position_embedding_type {c.position_embedding_type!r} (HF reads 'rope' or no rotation)")
    require(c.mamba_n_heads * c.mamba_d_head == c.mamba_expand * c.hidden_size,
            f"granitemoehybrid: mamba_n_heads x mamba_d_head {c.mamba_n_heads} x {c.mamba_d_head} is not mamba_expand "
            f"x hidden_size {c.mamba_expand} x {c.hidden_size}")
    a = granitemoeshared_args(c)
    n = c.num_hidden_layers
    rope = a.rope if c.position_embedding_type == "rope" else RopeArgs(a.rope.theta, per_layer=(0,) * n)
    limit = tuple(float(x) for x in (c.time_step_limit or (0.0, float("inf"))))
    return ModelArgs(**{
        **a.__dict__, "family": "granitemoehybrid", "rope": rope,
        "layer_types": tuple(MAMBA2 if t == LINEAR else FULL for t in c.layer_types),
        "attention": AttentionArgs(qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        "mamba2": Mamba2Args(num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head, state_size=c.mamba_d_state,
                            n_groups=c.mamba_n_groups, conv_kernel=c.mamba_d_conv, chunk_size=c.mamba_chunk_size,
                            time_step_limit=limit, conv_bias=bool(c.mamba_conv_bias),
                            proj_bias=bool(c.mamba_proj_bias)),
    })


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names and layouts -> the release's: input_linear / output_linear (granitemoe's), conv1d [C, 1, K]."""
    return conv1d_from_mlx(granitemoe_from_mlx(weights, config))


# the release's config.json spells the layer kinds as before transformers 5 ("mamba", "attention": HF reads them so,
# llama.cpp's converter finds the attention layers by "attention") and has no time_step_limit (the default)
RELEASE = dict(layer_types=["mamba" if t == LINEAR else "attention" for t in TINY["layer_types"]],
               position_embedding_type="nope")

MLX = MlxLm(
    module="granitemoehybrid",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", num_hidden_layers="num_hidden_layers",
        max_position_embeddings="max_position_embeddings", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", attention_bias="attention_bias",
        embedding_multiplier="embedding_multiplier", attention_multiplier="attention_multiplier",
        logits_scaling="logits_scaling", residual_multiplier="residual_multiplier", rms_norm_eps="rms_norm_eps",
        layer_types=lambda c: ["mamba" if t == LINEAR else "attention" for t in c.layer_types],
        num_local_experts="num_local_experts", num_experts_per_tok="num_experts_per_tok",
        shared_intermediate_size="shared_intermediate_size", mamba_n_heads="mamba_n_heads",
        mamba_d_head="mamba_d_head", mamba_proj_bias="mamba_proj_bias", mamba_d_state="mamba_d_state",
        mamba_d_conv="mamba_d_conv", mamba_n_groups="mamba_n_groups", mamba_conv_bias="mamba_conv_bias",
        mlp_bias=const(False), tie_word_embeddings="tie_word_embeddings",
        # mlx-lm rotates unless "nope"; HF rotates only for "rope"
        position_embedding_type=lambda c: "rope" if c.position_embedding_type == "rope" else "nope",
        # HF's limits (its default: none). mlx-lm's own default, where a config.json has none (the release's),
        # is (0.001, 100): see the issue-78 note in docs/architecture.md
        time_step_limit=lambda c: tuple(c.time_step_limit or (0.0, float("inf"))),
        rope_theta=lambda c: (c.rope_parameters or {}).get("rope_theta", 10000.0), rope_parameters=const(None),
    ),
    require=COMMON_REQUIRE + (
        (lambda c: (c.rope_parameters or {}).get("rope_type", "default") == "default",
         "rope scaling (mlx-lm's granitemoehybrid reads no rope_scaling)"),
    ),
    moe="block_sparse_moe", experts="fused", fused_names=("input_linear.weight", "output_linear.weight"),
)

FAMILY = Family(
    name="granitemoehybrid", model_types=("granitemoehybrid",), hf_module="granitemoehybrid",
    hf_class_name="GraniteMoeHybridForCausalLM", hf_config_name="GraniteMoeHybridConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, mlx=MLX, from_mlx=from_mlx, hf_attention=("self_attn", "mamba"), hf_moe="block_sparse_moe",
    hf_router="block_sparse_moe.router", experts="num_local_experts", release_config=RELEASE,
    release_drops=("time_step_limit",),
    rules=(("positive", "intermediate_size", "logits_scaling", "mamba_n_heads", "mamba_d_head", "mamba_d_state",
            "mamba_n_groups", "mamba_d_conv", "mamba_chunk_size"),
           ("at_least", "mamba_d_conv", 2), ("divides", "mamba_n_groups", "mamba_n_heads")),
)
