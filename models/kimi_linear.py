"""Kimi-Linear (Moonshot's kimi_linear): Kimi delta attention on most layers (models/layers/kda.py: the gated delta
rule with a decay per channel, short convs on q, k and v, the low-rank forget and output gates; HF's layer kind
"linear_attention", its module self_attn), DeepSeek's multi-head latent attention without any rotary embedding on the
rest (NoPE MLA: the qk_rope dims of q and of the shared key kept unrotated); the layers mlp_layer_types names "dense" a
plain MLP, the others DeepSeek-V3's routing (sigmoid plus a correction bias, group-limited, renormalised, times
routed_scaling_factor) with always-on shared experts. The release's names: block_sparse_moe with per-expert
w1 / w3 / w2, q/k/v_conv1d (HF concatenates them into one conv1d), the forget gate's f_a_proj, f_b_proj, dt_bias and
A_log on the attention (HF: under forget_gate)."""

import re
from types import SimpleNamespace

from models.args import DENSE, FULL, KDA, LINEAR, SPARSE, KDAArgs, ModelArgs, RopeArgs
from models.checkpoint import stack_experts, unstack_experts
from models.deepseek_v3 import from_mlx as mla_from_mlx
from models.family import Family
from models.mapping import deepseek_router, hf_args, mla, require, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4,
    # KDA, NoPE MLA, KDA, KDA (the release: 3 KDA to 1 MLA); the first layer dense (the release's
    # first_k_dense_replace 1)
    layer_types=[LINEAR, FULL, LINEAR, LINEAR], mlp_layer_types=[DENSE, SPARSE, SPARSE, SPARSE],
    linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    # the config.json names the release and save_pretrained write (HF's attribute_map: num_local_experts, ...)
    num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_renormalize=True, num_expert_group=1,
    topk_group=1, routed_scaling_factor=2.446, model_max_length=256, rms_norm_eps=1e-5,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def mlp_types(c) -> tuple[str, ...]:
    types = tuple(c.mlp_layer_types)
    require(len(types) == c.num_hidden_layers,
            f"mlp_layer_types has {len(types)} entries, num_hidden_layers is {c.num_hidden_layers}")
    require(set(types) <= {DENSE, SPARSE},
            f"mlp_layer_types {sorted(set(types) - {DENSE, SPARSE})} (only dense, sparse)")
    return types


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, LINEAR}, f"kimi_linear: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.hidden_act == "silu", f"kimi_linear: hidden_act {c.hidden_act!r} (the experts and the convs are silu)")
    # (HF's latent attention repeats its keys num_attention_heads / num_key_value_heads times over heads it already
    # has: only equal counts run)
    require(c.num_key_value_heads == c.num_attention_heads,
            "kimi_linear: num_key_value_heads other than num_attention_heads (the latent attention: a kv per head)")
    n = c.num_hidden_layers
    return hf_args(
        c, "kimi_linear", layer_types=tuple(KDA if t == LINEAR else FULL for t in c.layer_types),
        rope=RopeArgs(10000.0, per_layer=(0,) * n),  # NoPE: no layer rotates (the base is never read)
        attention=mla(c), mlp_types=mlp_types(c), intermediate_size=c.intermediate_size,
        num_experts=c.num_local_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0), shared_expert_gated=False,
        # DeepSeek-V3's routing; HF's Kimi router keeps no parameter in fp32 (no _keep_in_fp32_modules_strict)
        router=deepseek_router(c, scoring="sigmoid", correction_bias=True, n_group=c.n_group or 1,
                               topk_group=c.topk_group or 1, group_score="top2", norm_topk_prob=bool(c.norm_topk_prob)),
        kda=KDAArgs(num_heads=c.linear_num_heads, head_dim=c.linear_head_dim, conv_kernel=c.linear_conv_kernel_dim),
    )


# the release's names of the forget gate's tensors (on the attention) -> HF's and the production model's
FORGET = re.compile(r"(.*\.self_attn)\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def joined_convs(weights: dict) -> dict:
    """The release's three short convs (P.q_conv1d, P.k_conv1d, P.v_conv1d [h d, 1, K]) as the production model's one
    conv over q | k | v (P.conv1d [3 h d, 1, K]); a KeyError names the ones missing beside a q_conv1d."""
    import torch

    out = {}
    for k, t in weights.items():
        if k.endswith(f".{CONVS[0]}.weight"):
            p = k[: -len(f"{CONVS[0]}.weight")]
            parts = [weights.get(f"{p}{c}.weight") for c in CONVS]
            if any(x is None for x in parts):
                raise KeyError(f"{p}k_conv1d.weight / v_conv1d.weight (beside {k})")
            k, t = p + "conv1d.weight", torch.cat(parts)
        elif k.endswith((f".{CONVS[1]}.weight", f".{CONVS[2]}.weight")):
            continue
        out[k] = t
    return out


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's layout (HF's save_pretrained writes it) or HF's own: block_sparse_moe -> mlp (save_pretrained
    names the dense layers' MLP so too), per-expert w1 / w3 / w2 stacked, q/k/v_conv1d concatenated into conv1d
    [3 h d, 1, K], the forget gate's tensors under forget_gate (dt_bias [h d], A_log [1, 1, h, 1])."""
    out = {}
    for k, t in weights.items():
        k = k.replace(".block_sparse_moe.", ".mlp.")
        if (m := FORGET.fullmatch(k)) is not None:
            k = f"{m[1]}.forget_gate.{m[2]}"
        if k.endswith(".forget_gate.dt_bias"):
            t = t.reshape(-1)
        elif k.endswith(".forget_gate.A_log"):
            t = t.reshape(1, 1, -1, 1)
        out[k] = t
    out = stack_experts(joined_convs(out), r"(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight", ("w1", "w3", "w2"))
    return sanitize_hf(out, args)


def first_dense(c) -> int:
    """mlx-lm's first_k_dense_replace: the dense layers of mlp_layer_types, which must all come first."""
    return sum(t == DENSE for t in c.mlp_layer_types)


def linear_attn_config(c) -> dict:
    """The release's linear_attn_config (mlx-lm reads its KDA layers, 1-indexed, from it)."""
    return dict(num_heads=c.linear_num_heads, head_dim=c.linear_head_dim,
                short_conv_kernel_size=c.linear_conv_kernel_dim,
                kda_layers=[i + 1 for i, t in enumerate(c.layer_types) if t == LINEAR],
                full_attn_layers=[i + 1 for i, t in enumerate(c.layer_types) if t == FULL])


DENSE_MLP = re.compile(r"(.*\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)")


def release_names(weights: dict) -> dict:
    """The release's layout (what mlx-lm's sanitize() and llama.cpp's converter take): a dense layer's MLP under `mlp`
    (transformers 5.23's save_pretrained names it block_sparse_moe too: its rename of the release's MoE blocks,
    reversed, takes every layer's `mlp`; the release, mlx-lm and llama.cpp name a dense layer's MLP mlp). The seeded
    checkpoints are written so (Family.release_names); an HF-saved directory given to mlx is read so too."""
    return {DENSE_MLP.sub(r"\1.mlp.\2", k): v for k, v in weights.items()}


def cut_layers(text: dict, layers: int) -> None:
    """A published config cut to its last `layers` layers (Family.cut_layers): the release's linear_attn_config lists
    its KDA and full-attention layers 1-based (HF derives layer_types from them), renumbered for the layers kept."""
    lac = text.get("linear_attn_config")
    if not isinstance(lac, dict):
        return
    lists = [k for k in ("kda_layers", "full_attn_layers") if isinstance(lac.get(k), list)]
    n = max((i for k in lists for i in lac[k]), default=0)  # the published depth: its last layer, 1-based
    for k in lists:
        lac[k] = [i - (n - layers) for i in lac[k] if i > n - layers]


# the release's config.json fields beside HF's (llama.cpp's converter reads the layer kinds and the conv from
# linear_attn_config, the dense layers from first_k_dense_replace, the router's sigmoid from
# moe_router_activation_func; HF reads them to the tiny config's model, or not at all)
RELEASE = dict(linear_attn_config=linear_attn_config(SimpleNamespace(**TINY)),
               first_k_dense_replace=TINY["mlp_layer_types"].count(DENSE), mla_use_nope=True,
               moe_router_activation_func="sigmoid", use_grouped_topk=True, moe_layer_freq=1)

MLX_NAMES = re.compile(r"(.*\.layers\.\d+)\.(?:(mlp)\.(.*)|self_attn\.([qkv])_conv\.conv\.weight)")


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names and layouts -> the release's: experts.{e}.w1 / w3 / w2 and a sparse layer's MLP under
    block_sparse_moe (a dense layer's under mlp), the correction bias under the gate, q/k/v_conv1d [C, 1, K]
    (mlx-lm's [C, K, 1]), kv_b_proj from mlx-lm's two halves of it."""
    out = {}
    for k, v in mla_from_mlx(unstack_experts(weights, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
                             config).items():
        m = MLX_NAMES.fullmatch(k)
        if m is not None and m[2]:
            rest = "gate.e_score_correction_bias" if m[3] == "e_score_correction_bias" else m[3]
            k = f"{m[1]}.block_sparse_moe.{rest}"
        elif m is not None:
            k, v = f"{m[1]}.self_attn.{m[4]}_conv1d.weight", v.moveaxis(2, 1)
        out[k] = v
    return release_names(out)


MLX = MlxLm(
    module="kimi_linear",
    config=dict(
        model_type=const("kimi_linear"), vocab_size="vocab_size", hidden_size="hidden_size",
        num_hidden_layers="num_hidden_layers", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", intermediate_size="intermediate_size", head_dim="head_dim",
        rope_theta=const(10000.0), rope_scaling=const(None), mla_use_nope=const(True),  # (no rotary: never read)
        rms_norm_eps="rms_norm_eps", linear_attn_config=linear_attn_config, model_max_length="max_position_embeddings",
        num_experts="num_local_experts", moe_intermediate_size="moe_intermediate_size", kv_lora_rank="kv_lora_rank",
        tie_word_embeddings="tie_word_embeddings", qk_nope_head_dim="qk_nope_head_dim",
        qk_rope_head_dim="qk_rope_head_dim", v_head_dim="v_head_dim", num_experts_per_token="num_experts_per_tok",
        num_shared_experts="n_shared_experts", moe_router_activation_func=const("sigmoid"),
        moe_renormalize="norm_topk_prob", routed_scaling_factor="routed_scaling_factor",
        first_k_dense_replace=first_dense, moe_layer_freq=const(1), use_grouped_topk=const(True),
        num_expert_group="n_group", topk_group="topk_group",
    ),
    require=COMMON_REQUIRE + (
        (lambda c: list(c.mlp_layer_types) == [DENSE] * first_dense(c)
         + [SPARSE] * (c.num_hidden_layers - first_dense(c)),
         "dense layers after a sparse one (mlx-lm's first_k_dense_replace: the first layers only)"),
        (lambda c: not c.q_lora_rank, "q_lora_rank (mlx-lm's Kimi latent attention projects q directly)"),
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's Kimi latent attention has no biases)"),
        (lambda c: not (c.norm_topk_prob and c.num_experts_per_tok == 1),
         "norm_topk_prob with num_experts_per_token=1 (mlx-lm skips renormalisation at top_k 1)"),
        (lambda c: c.num_experts_per_tok <= c.topk_group * (c.num_local_experts // c.n_group),
         "num_experts_per_token > the experts of the kept groups (mlx-lm masks groups with 0, HF with -inf)"),
    ),
    convert=release_names, array_mask=True,
)

FAMILY = Family(
    name="kimi_linear", model_types=("kimi_linear",), hf_module="kimi_linear", hf_class_name="KimiLinearForCausalLM",
    hf_config_name="KimiLinearConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX,
    from_mlx=from_mlx, release_names=release_names, release_config=RELEASE, cut_layers=cut_layers,
    experts="num_experts", top_k="num_experts_per_token",
    rules=(("positive", "linear_num_heads", "linear_head_dim", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "moe_intermediate_size", "intermediate_size", "num_expert_group", "topk_group"),
           ("at_least", "linear_conv_kernel_dim", 2), ("per_layer", "mlp_layer_types"),
           ("at_most", "topk_group", "num_expert_group"), ("divides", "num_expert_group", "num_experts")),
)
