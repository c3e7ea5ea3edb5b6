"""Bailing-hybrid (inclusionAI's Ling / Ring 3.0 hybrids, HF bailing_hybrid): Kimi delta attention on most layers
(models/layers/kda.py with Bailing's gates: one full-rank f_proj and g_proj each, the forget gate bounded,
g = kda_lower_bound * sigmoid(e^A_log * (f_proj(x) + dt_bias)) with kda_safe_gate, returned in the model's dtype),
DeepSeek's multi-head latent attention on every layer_group_size-th layer (q_proj directly, no q_lora_rank; interleaved
rotary pairs; each head's output times sigmoid(g_proj(x)), one gate per head: AttentionArgs.gate_act); the first
first_k_dense_replace layers (mlp_layer_types) a plain MLP, the others DeepSeek-V3's routing (sigmoid plus a
correction bias, group-limited, renormalised, times routed_scaling_factor) with always-on shared experts.
The release's names (HF's conversion mapping): model.word_embeddings, layers.N.attention, the MLA's output projection
`dense`, q/k/v_conv1d, the forget gate's f_proj / dt_bias / A_log on the attention, mlp.gate.expert_bias, per-expert
experts; its MTP layer model.layers.{num_hidden_layers} (left out, as HF does)."""

import re

from models.args import DENSE, FULL, KDA, LINEAR, MLA, SPARSE, AttentionArgs, KDAArgs, ModelArgs
from models.checkpoint import conv1d_from_mlx, unstack_experts
from models.deepseek_v3 import from_mlx as mla_from_mlx
from models.family import Family
from models.kimi_linear import joined_convs
from models.mapping import deepseek_router, drop_layers_from, hf_args, require, rope_of, rope_theta_any, sanitize_hf
from models.mapping import sigmoid_routing
from models.mlx_lm import COMMON_REQUIRE, YARN_REQUIRE, MlxLm, const, yarn_scaling

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4,
    # KDA, MLA, KDA, MLA (the release: groups of 6, the last of each MLA); the first layer dense (the release's 2)
    layer_group_size=2, first_k_dense_replace=1,
    head_dim=16,  # the KDA heads' width (HF: linear_head_dim; its config then sets head_dim to qk_rope_head_dim)
    # the bounded forget gate, its bound -1 (the release's -5: with the tiny checkpoint's decay parameters a memory of
    # e^-2 a token, -1 keeps 0.6-0.75 of the state a token: a state not carried shows)
    short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-1.0,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # the config.json names the release and save_pretrained write (HF's attribute_map: num_local_experts, ...);
    # 8 experts in 4 groups, the best 2 groups kept
    num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=4, topk_group=2,
    moe_renormalize=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0, model_max_length=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, LINEAR}, f"bailing_hybrid: unknown layer_types {sorted(set(c.layer_types))}")
    require(set(c.mlp_layer_types) <= {DENSE, SPARSE} and len(c.mlp_layer_types) == c.num_hidden_layers,
            f"bailing_hybrid: mlp_layer_types {list(c.mlp_layer_types)} (dense or sparse, one per layer)")
    require(c.hidden_act == "silu", f"bailing_hybrid: hidden_act {c.hidden_act!r} (the experts and the convs are silu)")
    # (HF's latent attention repeats its keys num_attention_heads / num_key_value_heads times over heads it already has)
    require(c.num_key_value_heads == c.num_attention_heads,
            "bailing_hybrid: num_key_value_heads other than num_attention_heads (the latent attention: a kv per head)")
    # (HF's BailingHybridForCausalLM ties nothing, _tied_weights_keys {}: a tied release would get a random head)
    require(not c.tie_word_embeddings, "bailing_hybrid: tie_word_embeddings (HF's model never ties its head)")
    require(not c.kda_safe_gate or c.kda_lower_bound < 0,
            f"bailing_hybrid: kda_lower_bound {c.kda_lower_bound} (the bounded forget gate's bound: negative)")
    return hf_args(
        c, "bailing_hybrid", layer_types=tuple(KDA if t == LINEAR else FULL for t in c.layer_types),
        rope=rope_of(c, interleave=True),  # (HF's apply_rotary_pos_emb_interleave over qk_rope_head_dim)
        attention=AttentionArgs("mla", MLA(kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                                           qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim),
                                qkv_bias=c.attention_bias, o_bias=c.attention_bias, gate_act="sigmoid",
                                gate_width="head"),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size, num_experts=c.num_local_experts,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0), shared_expert_gated=False,
        router=deepseek_router(c, **sigmoid_routing(c)),
        kda=KDAArgs(num_heads=c.linear_num_heads, head_dim=c.linear_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                    low_rank_gates=False, lower_bound=float(c.kda_lower_bound) if c.kda_safe_gate else 0.0,
                    decay_in_model_dtype=True),
    )


# the release's names -> HF's (transformers 5.23 conversion_mapping "bailing_hybrid"), applied in order
RELEASE_NAMES = ((re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
                 (re.compile(r"\.attention\."), ".self_attn."),
                 (re.compile(r"\.self_attn\.(f_proj\.|dt_bias$|A_log$)"), r".self_attn.forget_gate.\1"),
                 (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
                 (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's layout (or HF's own, or what save_pretrained writes) -> the production model's: the names above,
    q/k/v_conv1d concatenated into conv1d [3 h d, 1, K], A_log [h] as [1, 1, h, 1], the MTP layer dropped, per-expert
    tensors stacked."""
    renamed = {}
    for k, t in drop_layers_from(weights, args.num_hidden_layers).items():
        for pattern, name in RELEASE_NAMES:
            k = pattern.sub(name, k)
        if k.endswith(".forget_gate.A_log"):
            t = t.reshape(1, 1, -1, 1)
        elif k.endswith(".forget_gate.dt_bias"):
            t = t.reshape(-1)
        renamed[k] = t
    return sanitize_hf(joined_convs(renamed), args)


def profile_view(sd: dict, cfg: dict) -> dict:
    """The same tensors under HF's in-memory names, which the trained weight profile reads (Family.hf_profile_view): a
    checkpoint's release names (what save_pretrained writes) renamed as HF's loader renames them, HF's own kept."""
    out = {}
    for k, t in sd.items():
        for pattern, name in RELEASE_NAMES:
            k = pattern.sub(name, k)
        out[k] = t
    return out


def first_dense(c) -> int:
    """mlx-lm's first_k_dense_replace: the dense layers of mlp_layer_types, which must all come first."""
    return sum(t == DENSE for t in c.mlp_layer_types)


def mlx_layer_types(c) -> list[str]:
    """mlx-lm's layer kinds (it reads no layer_types): MLA on every layer_group_size-th layer and on the layers after
    the last whole group, KDA on the others."""
    n, g = c.num_hidden_layers, c.layer_group_size
    return [FULL if (i + 1) % g == 0 or i >= n // g * g else LINEAR for i in range(n)]


def release_names(weights: dict) -> dict:
    """The release's layout (what mlx-lm's sanitize() takes): the KDA layers' output projection o_proj, the MLA layers'
    dense (mlx-lm's bailing_moe_v3 reads the release so; HF's loader renames dense to o_proj). transformers 5.23's
    save_pretrained writes dense for both: its rename, reversed, takes every o_proj. The seeded checkpoints are written
    so (Family.release_names); an HF-saved directory given to mlx is read so too."""
    kda = {k.split(".attention.")[0] for k in weights if k.endswith(".attention.f_proj.weight")}
    return {(k.replace(".attention.dense.", ".attention.o_proj.") if k.split(".attention.")[0] in kda else k): v
            for k, v in weights.items()}


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names and layouts -> the release's: per-expert experts, q/k/v_conv1d [C, 1, K] (mlx-lm's [C, K, 1]),
    kv_b_proj from mlx-lm's two halves of it (its embed_q / unembed_out under `attention`)."""
    out = {k.replace(".attention.", ".self_attn."): v for k, v in conv1d_from_mlx(unstack_experts(weights)).items()}
    return release_names({k.replace(".self_attn.", ".attention."): v for k, v in mla_from_mlx(out, config).items()})


MLX = MlxLm(
    module="bailing_moe_v3",  # (mlx-lm's load maps bailing_hybrid to it for the release's BailingMoeV3ForCausalLM only)
    config=dict(
        model_type=const("bailing_hybrid"), vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", moe_intermediate_size="moe_intermediate_size",
        # (mlx-lm's default 512; it multiplies it by num_shared_experts, as HF multiplies moe_intermediate_size)
        moe_shared_expert_intermediate_size="moe_intermediate_size",
        num_hidden_layers="num_hidden_layers", num_attention_heads="num_attention_heads",
        num_experts="num_local_experts", num_experts_per_tok="num_experts_per_tok",
        num_shared_experts="n_shared_experts", first_k_dense_replace=first_dense, n_group="n_group",
        topk_group="topk_group", routed_scaling_factor="routed_scaling_factor", layer_group_size="layer_group_size",
        head_dim="linear_head_dim",  # (mlx-lm's KDA heads' width; HF's config.head_dim is qk_rope_head_dim by then)
        q_lora_rank=const(None), kv_lora_rank="kv_lora_rank", qk_nope_head_dim="qk_nope_head_dim",
        qk_rope_head_dim="qk_rope_head_dim", v_head_dim="v_head_dim", short_conv_kernel_size="linear_conv_kernel_dim",
        kda_lower_bound="kda_lower_bound", kda_safe_gate="kda_safe_gate", no_kda_lora=const(True),
        rms_norm_eps="rms_norm_eps", rope_theta=rope_theta_any, rope_scaling=yarn_scaling,
        max_position_embeddings="max_position_embeddings", rope_interleave=const(True),
        tie_word_embeddings="tie_word_embeddings",
    ),
    require=COMMON_REQUIRE + YARN_REQUIRE + (
        (lambda c: list(c.layer_types) == mlx_layer_types(c),
         "layer_types other than mlx-lm's (MLA every layer_group_size-th layer and after the last whole group)"),
        (lambda c: list(c.mlp_layer_types) == [DENSE] * first_dense(c)
         + [SPARSE] * (c.num_hidden_layers - first_dense(c)),
         "dense layers after a sparse one (mlx-lm's first_k_dense_replace: the first layers only)"),
        (lambda c: c.kda_safe_gate, "kda_safe_gate=False (mlx-lm's bailing_moe_v3 refuses the unbounded gate)"),
        (lambda c: c.norm_topk_prob, "moe_renormalize=False (mlx-lm always renormalises the top-k)"),
        (lambda c: c.rms_norm_eps == 1e-6,
         "rms_norm_eps other than 1e-6 (mlx-lm's kv_a_layernorm takes rms_norm_eps, HF's its RMSNorm's default 1e-6)"),
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's latent attention has no biases)"),
    ),
    convert=release_names, array_mask=True,
)

# the release's config.json: the architecture BailingMoeV3ForCausalLM beside model_type bailing_hybrid (mlx-lm's loader
# picks bailing_moe_v3 by that pair, llama.cpp's converter registers that name; HF reads model_type), head_dim the KDA
# heads' width (HF's save_pretrained writes qk_rope_head_dim there, and reads it back as linear_head_dim), and the
# fields llama.cpp's converter requires of it (no_kda_lora, head-wise gates, the shared expert's width)
RELEASE = dict(architectures=["BailingMoeV3ForCausalLM"], head_dim=TINY["head_dim"], no_kda_lora=True,
               gated_attention_proj_granularity_type="head_wise",
               moe_shared_expert_intermediate_size=TINY["moe_intermediate_size"] * TINY["num_shared_experts"],
               norm_topk_prob=TINY["moe_renormalize"])

FAMILY = Family(
    name="bailing_hybrid", model_types=("bailing_hybrid",), hf_module="bailing_hybrid",
    hf_class_name="BailingHybridForCausalLM", hf_config_name="BailingHybridConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, mlx=MLX, from_mlx=from_mlx, experts="num_experts",
    top_k="num_experts_per_token", hf_profile_view=profile_view, release_names=release_names, release_config=RELEASE,
    rules=(("positive", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "moe_intermediate_size", "intermediate_size", "num_expert_group", "topk_group", "layer_group_size"),
           ("at_least", "short_conv_kernel_size", 2), ("per_layer", "mlp_layer_types"),
           ("at_most", "topk_group", "num_expert_group"), ("divides", "num_expert_group", "num_experts")),
)
