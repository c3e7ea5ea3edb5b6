"""Jamba (AI21): most layers' mixer is Mamba (models/layers/mamba.py: its time step's input, B and C RMS-normed),
every attn_layer_period-th (from attn_layer_offset) GQA attention without any rotary embedding; every
expert_layer_period-th layer (from expert_layer_offset) routes to experts (softmax over all, top-k, the k weights
not renormalised), the others a dense SwiGLU MLP of intermediate_size. HF's names: feed_forward (the MLP or MoE
block, its router feed_forward.router), pre_ff_layernorm (the norm before it), final_layernorm."""

import math

from models.args import DENSE, FULL, MAMBA, SPARSE, MambaArgs, ModelArgs, RopeArgs, RouterArgs
from models.family import Family
from models.checkpoint import conv1d_from_mlx, unstack_experts
from models.mapping import hf_args, renamed, require, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    # layers 0, 2, 3 Mamba, 1 attention; 1 and 3 routed, 0 and 2 dense (the release: attention every 8th from 4,
    # experts every 2nd from 1)
    attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True,
    mamba_proj_bias=False, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def layer_kinds(c) -> list[str]:  # HF's layers_block_type: "attention" / "mamba"
    return ["attention" if i % c.attn_layer_period == c.attn_layer_offset else "mamba"
            for i in range(c.num_hidden_layers)]


def routed(c) -> list[bool]:  # HF's layers_num_experts > 1
    return [c.num_experts > 1 and i % c.expert_layer_period == c.expert_layer_offset for i in range(c.num_hidden_layers)]


def to_args(c) -> ModelArgs:
    require(any(routed(c)), "jamba: no layer has experts (num_experts 1 or no expert layer): a dense Jamba")
    n, dt_rank = c.num_hidden_layers, c.mamba_dt_rank
    dt_rank = math.ceil(c.hidden_size / 16) if dt_rank == "auto" else int(dt_rank)
    return hf_args(
        c, "jamba", head_dim=c.hidden_size // c.num_attention_heads,
        layer_types=tuple(FULL if t == "attention" else MAMBA for t in layer_kinds(c)),
        rope=RopeArgs(10000.0, per_layer=(0,) * n),  # (no layer rotates: the base is never read)
        mlp_types=tuple(SPARSE if r else DENSE for r in routed(c)), intermediate_size=c.intermediate_size,
        num_experts=c.num_experts, moe_intermediate_size=c.intermediate_size, router=RouterArgs(norm_topk_prob=False),
        mamba=MambaArgs(inner=c.mamba_expand * c.hidden_size, state_size=c.mamba_d_state, dt_rank=dt_rank,
                        conv_kernel=c.mamba_d_conv, conv_bias=bool(c.mamba_conv_bias),
                        proj_bias=bool(c.mamba_proj_bias)),
    )


# HF's names (in memory and the release's) -> the production model's, part by part: the checkpoint's (sanitize) and
# the drill's (hf_point_names)
NAMES = {"feed_forward": "mlp", "pre_ff_layernorm": "post_attention_layernorm", "final_layernorm": "norm",
         "router": "gate"}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf({renamed(k, NAMES): t for k, t in weights.items()}, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names and layouts -> the release's: per-expert experts.{e}.*, conv1d [d, 1, K]."""
    return conv1d_from_mlx(unstack_experts(weights))


MLX = MlxLm(
    module="jamba",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", intermediate_size="intermediate_size",
        num_hidden_layers="num_hidden_layers", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", attn_layer_offset="attn_layer_offset",
        attn_layer_period="attn_layer_period", expert_layer_offset="expert_layer_offset",
        expert_layer_period="expert_layer_period", mamba_d_conv="mamba_d_conv", mamba_d_state="mamba_d_state",
        mamba_expand="mamba_expand", num_experts="num_experts", num_experts_per_tok="num_experts_per_tok",
        rms_norm_eps="rms_norm_eps", max_position_embeddings="max_position_embeddings", vocab_size="vocab_size",
        mamba_dt_rank="mamba_dt_rank", mamba_proj_bias="mamba_proj_bias", mamba_conv_bias="mamba_conv_bias",
        layers_block_type=layer_kinds, tie_word_embeddings="tie_word_embeddings",
    ),
    require=COMMON_REQUIRE + (
        # mlx-lm routes layer i iff (i + expert_layer_offset) % expert_layer_period == 0, HF iff i % period == offset
        (lambda c: routed(c) == [(i + c.expert_layer_offset) % c.expert_layer_period == 0
                                 for i in range(c.num_hidden_layers)],
         "expert layers mlx-lm's jamba places otherwise ((i + expert_layer_offset) % expert_layer_period == 0)"),
    ),
    moe="feed_forward", expert_names={"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
)

FAMILY = Family(
    name="jamba", model_types=("jamba",), hf_module="jamba", hf_class_name="JambaForCausalLM",
    hf_config_name="JambaConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX, from_mlx=from_mlx,
    hf_attention=("self_attn", "mamba"), hf_moe="feed_forward", hf_router="feed_forward.router", hf_mlp="feed_forward",
    hf_point_names=NAMES,
    rules=(("positive", "intermediate_size", "mamba_d_state", "mamba_d_conv", "mamba_expand", "attn_layer_period",
            "expert_layer_period"), ("at_least", "mamba_d_conv", 2)),
)
