"""Nemotron-H (NVIDIA; Nemotron 3 Nano): each block one norm, one mixer, one residual, the mixer a Mamba2
(models/layers/mamba2.py; HF's layer kind "linear_attention"), a GQA attention without any rotary embedding
("full_attention"), an MoE ("moe": DeepSeek-V3's router, sigmoid scores plus a correction bias for the choice within
the best groups, renormalised and scaled, relu^2 experts with no gate, an always-on relu^2 shared expert) or a dense
relu^2 MLP ("mlp"). The production model's layer with a mixer alone or an MLP alone (layer type / MLP type "none");
HF's block names (`norm`, `mixer`) mapped per layer by the layer's kind, in the checkpoint (sanitize) and in the
drill (point_view). HF's Mamba2 clamps dt to time_step_min in the prefill only (its dt_limit)."""

import re

from models.args import (DENSE, FULL, LINEAR, MAMBA2, NONE, SPARSE, AttentionArgs, ExpertArgs, Mamba2Args, ModelArgs,
                         RopeArgs)
from models.checkpoint import conv1d_from_mlx, unstack_experts
from models.family import Family
from models.mapping import deepseek_router, hf_args, require, sigmoid_routing, strip_prefix, tie_embeddings
from models.mlx_lm import MlxLm, const
from models.rules import GROUPED

KINDS = {LINEAR: (MAMBA2, NONE), FULL: (FULL, NONE), "moe": (NONE, SPARSE), "mlp": (NONE, DENSE)}

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    # the release's block kinds, an MoE last (the release: Mamba2 and MoE blocks alternating, an attention block
    # every ~6; its MoE models have no dense "mlp" block, and llama.cpp's converter reads none beside MoE blocks)
    layers_block_type=[LINEAR, "moe", FULL, LINEAR, "moe"], intermediate_size=48,
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=6,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    kinds = list(c.layers_block_type)
    require(set(kinds) <= set(KINDS), f"nemotron_h: unknown layers_block_type {sorted(set(kinds) - set(KINDS))}")
    require("moe" in kinds, "nemotron_h: no moe block (a dense Nemotron-H: no experts to check)")
    require(c.moe_latent_size is None, "nemotron_h: moe_latent_size (the latent MoE projections fc1/fc2_latent_proj "
                                       "are not implemented)")
    require(c.mlp_hidden_act == "relu2" and c.mamba_hidden_act == "silu",
            f"nemotron_h: mlp_hidden_act {c.mlp_hidden_act!r} / mamba_hidden_act {c.mamba_hidden_act!r} "
            "(relu2 and silu are implemented)")
    n = len(kinds)
    return hf_args(
        c, "nemotron_h", num_hidden_layers=n, rms_norm_eps=c.layer_norm_epsilon,
        layer_types=tuple(KINDS[k][0] for k in kinds), mlp_types=tuple(KINDS[k][1] for k in kinds),
        rope=RopeArgs(10000.0, per_layer=(0,) * n),  # (no block rotates: the base is never read)
        attention=AttentionArgs(qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        intermediate_size=c.intermediate_size, mlp_activation="relu2", mlp_bias=bool(c.mlp_bias),
        num_experts=c.n_routed_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size * (c.n_shared_experts or 0),
        shared_expert_gated=False, experts=ExpertArgs(activation="relu2"),
        router=deepseek_router(c, **sigmoid_routing(c)),
        mamba2=Mamba2Args(num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim, state_size=c.ssm_state_size,
                          n_groups=c.n_groups, conv_kernel=c.conv_kernel, chunk_size=c.chunk_size,
                          time_step_limit=(float(c.time_step_min), float("inf")),  # (HF's: time_step_limit unread)
                          conv_bias=bool(c.use_conv_bias), proj_bias=bool(c.use_bias)),
    )


BLOCK = re.compile(r"^layers\.(\d+)\.(norm|mixer)\b")
EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def production_name(name: str, args: ModelArgs) -> str:
    """HF's name of a block's module (layers.N.norm / layers.N.mixer..., relative to the decoder) -> the production
    model's: the norm before the block's mixer or MLP, the mixer under its kind's name."""
    m = BLOCK.match(name)
    if m is None:
        return name
    i, part = int(m.group(1)), m.group(2)
    mixer = args.layer_types[i] != NONE
    new = ("input_layernorm" if mixer else "post_attention_layernorm") if part == "norm" else (
        ("mamba" if args.layer_types[i] == MAMBA2 else "self_attn") if mixer else "mlp")
    return f"layers.{i}.{new}" + name[m.end():]


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's (backbone.*) or HF's (model.*) names -> the production model's, per-expert up / down stacked
    (experts.gate_up_proj holds the up rows of the relu^2 experts)."""
    import torch

    out, experts = {}, {}
    for k, t in strip_prefix(strip_prefix(weights, "backbone."), "model.").items():
        k = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}.get(k, k)
        k = production_name(k, args).replace(".mlp.experts.up_proj", ".mlp.experts.gate_up_proj")
        if m := EXPERT.match(k):
            experts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = t
        else:
            out[k] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        for proj, name in (("up_proj", "gate_up_proj"), ("down_proj", "down_proj")):
            missing = [e for e in range(n) if (e, proj) not in parts]
            require(not missing, f"missing tensor {prefix}.{missing[0] if missing else 0}.{proj}.weight")
            out[f"{prefix}.{name}"] = torch.stack([parts[e, proj] for e in range(n)])
    return tie_embeddings(out, args)


def point_view(points, args: ModelArgs, layer=None):
    """The drill's points of HF's whole block (its norm, mixer.*) under the production names of that layer's kind;
    a mixer's or an MLP's own points (a Mamba2's `norm` among them) as they are."""
    if layer is None or "mixer" not in points.registered:
        return points
    return points.renamed(lambda n: production_name(f"layers.{layer}.{n}", args).split(".", 2)[2]
                          if BLOCK.match(f"layers.{layer}.{n}") else n)


# the release's config.json spells the blocks as hybrid_override_pattern (M Mamba2, * attention, E MoE, - MLP: HF reads
# it so, llama.cpp's converter reads nothing else), with no layers_block_type
PATTERN = {LINEAR: "M", FULL: "*", "moe": "E", "mlp": "-"}
RELEASE = dict(hybrid_override_pattern="".join(PATTERN[k] for k in TINY["layers_block_type"]))

MLX = MlxLm(
    module="nemotron_h",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", max_position_embeddings="max_position_embeddings",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        attention_bias="attention_bias", mamba_num_heads="mamba_num_heads", mamba_head_dim="mamba_head_dim",
        mamba_proj_bias="mamba_proj_bias", ssm_state_size="ssm_state_size", conv_kernel="conv_kernel",
        n_groups="n_groups", mlp_bias="mlp_bias", layer_norm_epsilon="layer_norm_epsilon", use_bias="use_bias",
        use_conv_bias="use_conv_bias", hybrid_override_pattern=lambda c: [PATTERN[k] for k in c.layers_block_type],
        layers_block_type=const(None), layer_types=const(None), num_hidden_layers=lambda c: len(c.layers_block_type),
        head_dim="head_dim", moe_intermediate_size="moe_intermediate_size",
        moe_shared_expert_intermediate_size="moe_shared_expert_intermediate_size", moe_latent_size="moe_latent_size",
        n_group="n_group", n_routed_experts="n_routed_experts", n_shared_experts="n_shared_experts",
        topk_group="topk_group", num_experts_per_tok="num_experts_per_tok", norm_topk_prob="norm_topk_prob",
        routed_scaling_factor="routed_scaling_factor",
        # HF's Mamba2 limit (time_step_min, inf), which mlx-lm applies in decode too (HF in the prefill only)
        time_step_limit=lambda c: (float(c.time_step_min), float("inf")), time_step_min="time_step_min",
        time_step_max="time_step_max",
    ),
    # (mlx-lm's nemotron_h reads mlp_hidden_act from no field: relu^2, as to_args requires)
    require=((lambda c: LINEAR in c.layers_block_type,
              "no Mamba2 layer (mlx-lm 0.32.2's NemotronHModel takes its ssm mask from cache[ssm_idx], the first "
              "Mamba2 layer's, and raises IndexError past its caches without one)"),),
    moe="mixer",
)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names and layouts -> the release's: switch_mlp.fc1 / fc2 [E, out, in] back to per-expert up_proj /
    down_proj, conv1d [C, 1, K]."""
    return conv1d_from_mlx(unstack_experts(weights, {"fc1": "up_proj", "fc2": "down_proj"}))


def profile_view(sd: dict, cfg: dict) -> dict:
    """HF's tensors under the names the trained profile reads (Family.hf_profile_view): the norm before a mixer or an
    MLP by its role, an attention mixer as self_attn, a Mamba2 as linear_attn (its out_proj writes the stream), an
    MoE's mixer kept (Family.hf_router: mixer.gate), the embedding and the final norm by their usual names."""
    args = FAMILY.args(cfg)
    out = {}
    for k, t in sd.items():
        base = k[len("backbone."):] if k.startswith("backbone.") else k[len("model."):] if k.startswith("model.") else k
        base = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}.get(base, base)
        m = BLOCK.match(base)
        if m is not None:
            i = int(m.group(1))
            role = args.layer_types[i] if m.group(2) == "mixer" else None
            if m.group(2) == "norm":
                base = production_name(base, args)
            elif role == MAMBA2:
                base = f"layers.{i}.linear_attn" + base[m.end():]
            elif role == FULL:
                base = f"layers.{i}.self_attn" + base[m.end():]
        out[("model." + base) if base != k or not k.startswith("lm_head") else k] = t
    return out


def cut_layers(text: dict, layers: int) -> None:
    """A published config cut to `layers` layers (Family.cut_layers): the depth is the release's
    hybrid_override_pattern (HF ignores num_hidden_layers beside it). The layers kept are the last window of
    `layers` consecutive ones that holds an attention block, as the generic cut keeps the last ones: transformers
    5.23's NemotronH cache cannot run a model without one (get_seq_length "can only be called on Attention
    layers"), and the release's last two layers are a Mamba2 and an MoE block."""
    for key in ("hybrid_override_pattern", "layers_block_type"):
        kinds = text.get(key)
        if not isinstance(kinds, (str, list)) or len(kinds) <= layers:
            continue
        attention = PATTERN[FULL] if isinstance(kinds, str) else FULL
        last = max((i for i, k in enumerate(kinds) if k == attention), default=len(kinds) - 1)
        start = min(len(kinds) - layers, last)
        text[key] = kinds[start:start + layers]


FAMILY = Family(
    name="nemotron_h", model_types=("nemotron_h",), hf_module="nemotron_h", hf_class_name="NemotronHForCausalLM",
    hf_config_name="NemotronHConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX, from_mlx=from_mlx,
    hf_attention=("mixer",), hf_moe="mixer", hf_router="mixer.gate", hf_mlp="mixer", hf_point_view=point_view,
    hf_profile_view=profile_view,
    experts="n_routed_experts", release_config=RELEASE, release_drops=("layers_block_type", "time_step_limit"),
    cut_layers=cut_layers,
    rules=(*GROUPED, ("positive", "moe_intermediate_size", "intermediate_size", "mamba_num_heads", "mamba_head_dim",
                      "ssm_state_size", "n_groups", "conv_kernel", "chunk_size"),
           ("at_least", "conv_kernel", 2), ("divides", "n_groups", "mamba_num_heads")),
)
