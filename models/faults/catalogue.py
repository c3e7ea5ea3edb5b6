"""The catalogue of seeded faults in the production model: the bugs seen in real ports, by
mechanism (the modules beside this one), each with the block a correct oracle must name and the point
inside it the drill should name first."""

from __future__ import annotations

from models.args import NONE, RECURRENT, ModelArgs, has_sinks
from models.faults.attention import (attention_multiplier_missing, clip_qkv_missing, gate_sigmoid_for_softplus,
                                     gqa_repeat_wrong, kv_groups_of_the_model, kv_off_by_one, moa_kv_interleaved,
                                     not_causal, output_gate_no_sigmoid, qk_norm_before_rope, qk_norm_flat_for_per_head,
                                     qk_norm_missing, rope_of_the_model, value_scale_missing,
                                     qk_norm_per_head_for_flat, rope_interleaved, rope_on_nope_layer, rope_theta_wrong,
                                     rotary_fraction_wrong, scale_wrong, sinks_dropped, window_off_by_one)
from models.faults.experts import (clamp_missing, dense_layer_routed, expert_index_off_by_one, gate_up_swapped,
                                   has_shared, has_shared_beside, interleave_sparse, moe_bias_missing, moe_layer_as_dense,
                                   moe_output_norm_before_shared, moe_output_norm_missing, moe_output_upcast,
                                   one_expert_off, shared_beside_missing, shared_gate_no_sigmoid, shared_missing,
                                   shared_summed, stray_bf16, weights_not_applied)
from models.faults.dsa import (dsa_index_cache_not_carried, dsa_index_heads_rolled, dsa_rope_interleave_swapped,
                               dsa_topk_off_by_one)
from models.faults.dsa2 import DSA2
from models.faults.dsa2 import POINTS as DSA2_POINTS
from models.faults.block_sparse import BLOCK_SPARSE
from models.faults.block_sparse import POINTS as BLOCK_SPARSE_POINTS
from models.faults.doge import DOGE
from models.faults.doge import POINTS as DOGE_POINTS
from models.faults.fault import Fault
from models.faults.invariance import INVARIANCE
from models.faults.invariance import POINTS as INVARIANCE_POINTS
from models.faults.gemma4 import GEMMA4
from models.faults.hyper import HYPER
from models.faults.deepseek_v4 import DEEPSEEK_V4
from models.faults.deepseek_v4 import POINTS as DEEPSEEK_V4_POINTS
from models.faults.hyper import POINTS as HYPER_POINTS
from models.faults.gemma4 import POINTS as GEMMA4_POINTS
from models.faults.muse_spark import MUSE_SPARK
from models.faults.muse_spark import POINTS as MUSE_SPARK_POINTS
from models.faults.inkling import INKLING
from models.faults.inkling import NOT_FOR as NOT_FOR_INKLING
from models.faults.inkling import POINTS as INKLING_POINTS
from models.faults.qsa import QWEN4
from models.faults.qsa import POINTS as QWEN4_POINTS
from models.faults.zaya import NOT_FOR as NOT_FOR_ZAYA
from models.faults.zaya import POINTS as ZAYA_POINTS
from models.faults.zaya import ZAYA
from models.faults.gated_deltanet import gdn_chunked_prefill, gdn_conv_state_not_carried, gdn_state_not_carried
from models.faults.kda import (kda_conv_state_not_carried, kda_decay_per_head, kda_decay_sign, kda_gate_bound_dropped,
                               kda_output_gate_no_sigmoid, kda_state_not_carried)
from models.faults.lightning import (lightning_gate_no_sigmoid, lightning_slope_layer_factor_missing,
                                     lightning_state_not_carried)
from models.faults.mamba import (mamba_conv_state_not_carried, mamba_decay_sign, mamba_dt_bias_dropped,
                                 mamba_inner_norms_missing, mamba_state_not_carried)
from models.faults.mamba2 import (mamba2_chunk_boundary_off_by_one, mamba2_conv_state_not_carried, mamba2_decay_sign,
                                  mamba2_dt_bf16, mamba2_dt_bias_dropped, mamba2_state_not_carried)
from models.faults.short_conv import short_conv_gate_missing, short_conv_state_not_carried, short_conv_taps_reversed
from models.faults.layer import (final_norm_eps, input_norm_eps, layernorm_as_rmsnorm, logits_scaling_missing,
                                 logits_to_float, norm_offset_missing, post_norm_misplaced, post_norm_missing,
                                 residual_missing, residual_multiplier_missing)
from models.faults.mla import (mla_cache_not_carried, mla_head_gate_no_activation, mla_rope_nope_swapped,
                               q_position_scale_missing, yarn_mscale_missing)
from models.faults.router import (bias_in_weights, is_scaled, is_sigmoid, no_renorm, rerouted,
                                  router_logit_bias_ignored, second_expert_unmasked, sigmoid_router, softcap_missing,
                                  softmax_after_topk, wrong_num_experts)
from models.layers import routing

def _dsa(a: ModelArgs) -> bool:  # a DeepSeek sparse attention model
    return a.attention.dsa is not None


def _rotary_dims(a: ModelArgs) -> bool:  # not an MLA without rotary dims (GLM-5.3's qk_rope_head_dim 0: nothing rotates)
    return a.attention.mla is None or a.attention.mla.qk_rope_head_dim > 0


# every MoE family's mechanisms: softmax top-k routing, SwiGLU experts, GQA attention with rope and
# q/k norms, RMSNorm, KV and recurrent state, Gated DeltaNet, dtypes
COMMON: tuple[Fault, ...] = (
    Fault("router_softmax_after_topk", "router", "last", "softmax over the top-k logits instead of over all experts",
          softmax_after_topk, lambda a: not a.router.norm_topk_prob),
    Fault("router_no_renorm", "router", "last", "missing norm_topk_prob renormalisation", no_renorm,
          lambda a: a.router.norm_topk_prob),
    Fault("router_wrong_num_experts", "router", "last", "router sees one expert fewer than the checkpoint has",
          wrong_num_experts, lambda a: not routing.grouped(a)),
    Fault("router_sigmoid", "router", "last", "sigmoid scoring instead of softmax", sigmoid_router,
          lambda a: a.router.scoring == "softmax"),
    # (relu^2 experts have no gate; Doge's one-neuron embedding experts (product_key_moe) no stacked projections)
    Fault("expert_gate_up_swapped", "moe", "last", "expert gate and up projections swapped", gate_up_swapped,
          lambda a: a.experts.activation != "relu2" and not a.product_key_moe),
    Fault("expert_weights_off_1e-3", "moe", "last", "one (used) expert's weights off by 1e-3", one_expert_off,
          lambda a: not a.product_key_moe),
    Fault("expert_index_off_by_one", "moe", "last", "expert weights gathered at index + 1", expert_index_off_by_one,
          lambda a: not a.product_key_moe),
    # (sparsemixer's weights are 1 but inside its jitter band: nothing to see there)
    Fault("expert_weights_not_applied", "moe", "last", "expert outputs summed without routing weights",
          weights_not_applied, lambda a: a.router.scoring != "sparsemixer"),
    Fault("shared_expert_gate_no_sigmoid", "moe", "last", "shared-expert gate used without sigmoid",
          shared_gate_no_sigmoid, lambda a: has_shared(a) and a.shared_expert_gated),
    Fault("shared_expert_missing", "moe", "last", "shared expert dropped", shared_missing, has_shared),
    Fault("stray_bf16_downcast", "moe", "last", "a stray downcast to bf16 inside an fp32 program", stray_bf16),
    Fault("rope_theta_wrong", "attention", "rope", "wrong rope theta (1e4 vs the checkpoint's)", rope_theta_wrong,
          attention=("gqa", "mla")),
    Fault("rope_interleaved", "attention", "rope", "interleaved (GPT-J) rotation instead of rotate-half",
          rope_interleaved, lambda a: not a.rope.interleave),
    Fault("rotary_fraction_wrong", "attention", "rope", "partial-rotary fraction wrong", rotary_fraction_wrong),
    Fault("qk_norm_missing", "attention", "rope", "q/k RMSNorm missing", qk_norm_missing,
          lambda a: a.attention.qk_norm != "none"),
    Fault("qk_norm_per_head_for_flat", "attention", "full", "per-head q/k norm where the family's is flat",
          qk_norm_per_head_for_flat, lambda a: a.attention.qk_norm == "flat"),
    Fault("qk_norm_flat_for_per_head", "attention", "full", "flat q/k norm where the family's is per head",
          qk_norm_flat_for_per_head, lambda a: a.attention.qk_norm == "head"),
    Fault("qk_norm_before_rope", "attention", "rope", "per-head q/k norm before the rotation where the family's is "
          "after it", qk_norm_before_rope, lambda a: a.attention.qk_norm == "head" and a.attention.qk_norm_after_rope),
    Fault("kv_cache_write_off_by_one", "attention", "full", "KV cache written one position late", kv_off_by_one),
    Fault("attention_not_causal", "attention", "full", "attention mask not causal", not_causal),
    Fault("attention_scale_wrong", "attention", "full", "softmax scale 1/d instead of 1/sqrt(d)", scale_wrong),
    Fault("gqa_kv_heads_tiled", "attention", "full", "kv heads tiled instead of repeated for GQA",
          # (one kv head: tiled is repeated; Doge's dynamic mask attends through its own attend_biased)
          gqa_repeat_wrong, lambda a: a.num_attention_heads != a.num_key_value_heads and a.num_key_value_heads > 1
          and not a.attention.keep_window),
    Fault("attention_gate_no_sigmoid", "attention", "full", "attention output gate without sigmoid",
          output_gate_no_sigmoid, lambda a: a.attention.output_gate),
    Fault("gdn_state_not_carried", "attention", "linear", "Gated DeltaNet recurrent state not carried",
          gdn_state_not_carried),
    Fault("gdn_conv_state_not_carried", "attention", "linear", "Gated DeltaNet conv state not carried",
          gdn_conv_state_not_carried),
    Fault("gdn_chunked_prefill_differs", "attention", "linear", "chunked prefill differs from one-shot prefill",
          gdn_chunked_prefill),
    Fault("short_conv_state_not_carried", "attention", "conv", "short-conv state not carried into decode",
          short_conv_state_not_carried),
    Fault("short_conv_gate_missing", "attention", "conv", "short-conv output not gated by C", short_conv_gate_missing),
    Fault("short_conv_taps_reversed", "attention", "conv", "short-conv kernel taps in reverse order",
          short_conv_taps_reversed),
    Fault("lightning_state_not_carried", "attention", "lightning", "lightning attention state not carried into decode",
          lightning_state_not_carried),
    # (a slope of the last layer: its factor is 1e-5, so the fault is the first layer's slope, far from it)
    Fault("lightning_slope_layer_factor_missing", "attention", "lightning",
          "lightning attention slopes without their per-layer factor", lightning_slope_layer_factor_missing),
    Fault("lightning_gate_no_sigmoid", "attention", "lightning", "lightning attention output gate without sigmoid",
          lightning_gate_no_sigmoid),
    Fault("kda_state_not_carried", "attention", "kda", "Kimi delta attention recurrent state not carried into decode",
          kda_state_not_carried),
    Fault("kda_conv_state_not_carried", "attention", "kda", "Kimi delta attention conv state not carried into decode",
          kda_conv_state_not_carried),
    Fault("kda_decay_sign_flipped", "attention", "kda", "Kimi delta attention decay e^(+e^A_log softplus): its sign "
          "dropped", kda_decay_sign),
    Fault("kda_decay_per_head", "attention", "kda", "Kimi delta attention decay one per head (its channels' mean) "
          "instead of one per channel", kda_decay_per_head),
    Fault("kda_output_gate_no_sigmoid", "attention", "kda", "Kimi delta attention output gate without its sigmoid",
          kda_output_gate_no_sigmoid),
    Fault("kda_gate_bound_dropped", "attention", "kda", "Kimi delta attention's bounded forget gate "
          "(lower_bound * sigmoid) computed as the unbounded -e^A_log softplus", kda_gate_bound_dropped,
          lambda a: a.kda is not None and a.kda.lower_bound != 0),
    Fault("mamba_state_not_carried", "attention", "mamba", "Mamba scan state not carried into decode",
          mamba_state_not_carried),
    Fault("mamba_conv_state_not_carried", "attention", "mamba", "Mamba conv state not carried into decode",
          mamba_conv_state_not_carried),
    Fault("mamba_decay_sign_flipped", "attention", "mamba", "Mamba decay e^(+dt e^A_log): A's sign dropped",
          mamba_decay_sign),
    Fault("mamba_dt_bias_dropped", "attention", "mamba", "Mamba time step without dt_proj's bias", mamba_dt_bias_dropped),
    Fault("mamba_inner_norms_missing", "attention", "mamba", "Jamba's RMSNorms of dt, B and C left out",
          mamba_inner_norms_missing, lambda a: a.mamba is not None and a.mamba.inner_norms),
    Fault("mamba2_state_not_carried", "attention", "mamba2", "Mamba2 scan state not carried into decode",
          mamba2_state_not_carried),
    Fault("mamba2_conv_state_not_carried", "attention", "mamba2", "Mamba2 conv state not carried into decode",
          mamba2_conv_state_not_carried),
    Fault("mamba2_decay_sign_flipped", "attention", "mamba2", "Mamba2 decay e^(+dt e^A_log): A's sign dropped",
          mamba2_decay_sign),
    Fault("mamba2_dt_bias_dropped", "attention", "mamba2", "Mamba2 time step without dt_bias", mamba2_dt_bias_dropped),
    Fault("mamba2_dt_bf16", "attention", "mamba2", "Mamba2 time step rounded to bf16 in an fp32 model", mamba2_dt_bf16),
    Fault("mamba2_chunk_boundary_off_by_one", "attention", "mamba2",
          "Mamba2 prefill's decay at the chunk boundary a token late", mamba2_chunk_boundary_off_by_one),
    Fault("rmsnorm_eps_wrong", "layer", "last", "input RMSNorm eps 1000x too large", input_norm_eps,
          # (post-norm layers have no input norm; with q, k and v each RMS-normed (Gemma 4's v_norm) the attention
          # does not see its input's scale, all the eps changes)
          lambda a: a.norm.placement != "post" and not a.attention.v_norm),
    Fault("norm_offset_missing", "layer", "last", "(1 + w) RMSNorm offset missing", norm_offset_missing,
          lambda a: a.norm.offset),
    Fault("residual_missing", "layer", "last", "attention residual connection dropped", residual_missing),
    Fault("final_norm_eps_wrong", "final_norm", "model", "final RMSNorm eps 1000x too large", final_norm_eps),
    Fault("moe_output_upcast", "moe", "last", "an unconditional cast that changes the MoE output dtype (bf16 model)",
          moe_output_upcast, precision="bf16"),
    Fault("logits_cast_to_float", "logits", "model", "final logits cast to float where the model's dtype is bf16",
          logits_to_float, precision="bf16"),
)


# biased routing (sigmoid scores with a correction bias, groups, routed scaling), dense layers, MLA, YaRN
BIASED_ROUTING_AND_MLA: tuple[Fault, ...] = (
    Fault("router_bias_in_weights", "router", "last", "correction bias added to the weights too (not only the choice)",
          bias_in_weights, lambda a: a.router.correction_bias),
    Fault("router_bias_ignored", "router", "last", "correction bias left out of the expert choice",
          rerouted(lambda a: {"correction_bias": False}), lambda a: a.router.correction_bias),
    Fault("router_group_limit_ignored", "router", "last", "group limit ignored (top-k over every expert)",
          rerouted(lambda a: {"n_group": 1, "topk_group": 1}), routing.grouped),
    Fault("routed_scaling_missing", "router", "last", "routed_scaling_factor not applied",
          rerouted(lambda a: {"routed_scaling_factor": 1.0}), is_scaled),
    Fault("routed_scaling_twice", "router", "last", "routed_scaling_factor applied twice",
          rerouted(lambda a: {"routed_scaling_factor": a.router.routed_scaling_factor ** 2}), is_scaled),
    Fault("router_softmax_for_sigmoid", "router", "last", "softmax scores where the family's are sigmoid",
          rerouted(lambda a: {"scoring": "softmax"}), is_sigmoid),
    Fault("router_choice_on_scores", "router", "last", "the choice ranks the scores plus the correction bias where "
          "the family's ranks the logits plus it (Kolibri-1)", rerouted(lambda a: {"choice_on": "scores"}),
          lambda a: a.router.choice_on == "logits" and a.router.correction_bias),
    Fault("dense_layer_routed", "mlp", "dense", "a dense layer's MLP treated as routed (scaled by routed_scaling_factor)",
          dense_layer_routed, is_scaled),
    Fault("mla_rope_nope_swapped", "attention", "full", "MLA: q's rope and no-rope parts swapped",
          mla_rope_nope_swapped, _rotary_dims, attention=("mla",)),
    Fault("mla_cache_not_carried", "attention", "full", "MLA: compressed KV cache not carried across calls",
          mla_cache_not_carried, attention=("mla",)),
    Fault("mla_head_gate_no_activation", "attention", "full", "MLA: the head gate applied without its activation "
          "(sigmoid)", mla_head_gate_no_activation, lambda a: a.attention.gate_act != "none", attention=("mla",)),
    Fault("q_position_scale_missing", "attention", "full", "the position-dependent query scale "
          "(1 + beta log(1 + floor(pos / period)), Mistral 4's llama_4_scaling_beta) left out", q_position_scale_missing,
          lambda a: bool(a.attention.q_position_beta), attention=("mla",)),
    Fault("yarn_mscale_missing", "attention", "full", "YaRN mscale missing from the softmax scale",
          yarn_mscale_missing, lambda a: a.rope.kind == "yarn" and bool(a.rope.scaling.mscale_all_dim),
          attention=("mla",)),
    # DeepSeek sparse attention's indexer (models/faults/dsa.py)
    Fault("dsa_index_heads_rolled", "attention", "full", "DSA: the indexer's head weights (weights_proj) on the "
          "wrong heads (rolled by one)", dsa_index_heads_rolled, _dsa, attention=("mla",)),
    Fault("dsa_topk_off_by_one", "attention", "full", "DSA: the indexer chooses index_topk - 1 keys",
          dsa_topk_off_by_one, _dsa, attention=("mla",)),
    Fault("dsa_index_cache_not_carried", "attention", "full", "DSA: the indexer's key cache not carried into decode",
          dsa_index_cache_not_carried, _dsa, attention=("mla",)),
    Fault("dsa_rope_interleave_swapped", "attention", "full", "DSA: the indexer's rotation on the other pairs "
          "(interleaved for half-split, or back)", dsa_rope_interleave_swapped,
          lambda a: _dsa(a) and _rotary_dims(a), attention=("mla",)),
)


# the variants: attention sinks, sliding windows, clamped SwiGLU, router logit bias, sparsemixer,
# LayerNorm, interleaved MoE layers, Granite's multipliers, NoPE layers
VARIANTS: tuple[Fault, ...] = (
    Fault("attention_sinks_dropped", "attention", "full", "attention sinks left out of the softmax",
          sinks_dropped, lambda a: a.attention.sinks and has_sinks(a, max(i for i, t in enumerate(a.layer_types)
                                                                          if t not in RECURRENT and t != NONE)),
          attention=("gqa", "mla")),  # (HY-V4's latent attention has them)
    Fault("sliding_window_off_by_one", "attention", "sliding", "sliding window one position too wide",
          window_off_by_one),
    Fault("swiglu_clamp_missing", "moe", "last", "the experts' SwiGLU without its clamp", clamp_missing,
          lambda a: a.experts.activation in ("clamped_swiglu", "cswiglu")),
    Fault("router_logit_bias_ignored", "router", "last", "the router's bias left out of its logits",
          router_logit_bias_ignored, lambda a: a.router.logit_bias),
    Fault("sparsemixer_first_unmasked", "router", "last", "sparsemixer's second expert chosen without masking the first",
          second_expert_unmasked, lambda a: a.router.scoring == "sparsemixer"),
    Fault("layernorm_as_rmsnorm", "layer", "last", "LayerNorm computed as RMSNorm (no mean, no bias)",
          layernorm_as_rmsnorm, lambda a: a.norm.kind == "layer"),
    Fault("moe_interleave_wrong", "moe", "last", "an MoE layer taken for a dense one (wrong MoE/dense interleave)",
          moe_layer_as_dense, interleave_sparse),
    Fault("residual_multiplier_missing", "layer", "last", "residual_multiplier not applied",
          residual_multiplier_missing, lambda a: a.multipliers.residual != 1.0),
    Fault("attention_multiplier_missing", "attention", "full", "attention_multiplier replaced by 1/sqrt(head_dim)",
          attention_multiplier_missing, lambda a: bool(a.multipliers.attention)
          and a.multipliers.attention != a.head_dim**-0.5),
    Fault("logits_scaling_missing", "logits", "model", "logits not divided by logits_scaling",
          logits_scaling_missing, lambda a: a.multipliers.logits_scaling != 1.0),
    Fault("rope_on_nope_layer", "attention", "nope", "rope applied on a no-rope layer", rope_on_nope_layer,
          _rotary_dims),
    Fault("clip_qkv_missing", "attention", "full", "clip_qkv left out (q, k and v not clamped)", clip_qkv_missing,
          lambda a: a.attention.clip_qkv is not None),
    Fault("shared_expert_summed", "moe", "last", "the shared expert summed with the routed experts (not averaged)",
          shared_summed, lambda a: has_shared(a) and a.shared_expert_average),
    Fault("moa_kv_heads_interleaved", "attention", "full", "mixture of attention: the shared kv heads interleaved "
          "over the experts' query heads instead of tiled", moa_kv_interleaved,
          lambda a: a.num_key_value_heads > 1 and a.num_experts_per_tok > 1, attention=("moa",)),
    Fault("moe_bias_missing", "moe", "last", "the bias on the MoE block's output left out", moe_bias_missing,
          lambda a: a.moe_bias),
    Fault("shared_mlp_missing", "layer", "last", "the shared MLP beside the MoE block dropped",
          shared_beside_missing, has_shared_beside),
    # per-layer ropes and head counts (Mellum, GraniteMoE-SWA, MiMo-V2-Flash, Laguna)
    Fault("rope_of_the_model_on_own_layer", "attention", "ownrope",
          "the model's rope (the full layers' theta, the global theta) on a layer with its own (per type or per layer)",
          rope_of_the_model, lambda a: a.attention.kind != "compressed"),  # (DeepSeek-V4's: dsv4_sliding_rope_compress)
    Fault("kv_groups_of_the_model", "attention", "ownheads",
          "a layer with its own head counts grouping its q heads by the model's num_attention_heads / num_key_value_heads",
          kv_groups_of_the_model),
    Fault("value_scale_missing", "attention", "full", "the values' scale (attention_value_scale) left out",
          value_scale_missing, lambda a: a.attention.value_scale != 1.0),
    Fault("attention_gate_sigmoid_for_softplus", "attention", "full",
          "the attention output's projected gate through a sigmoid where the family's is a softplus",
          gate_sigmoid_for_softplus, lambda a: a.attention.gate_act == "softplus"),
    Fault("router_softcap_missing", "router", "last", "the router logits' tanh softcap left out",
          softcap_missing, lambda a: bool(a.router.logit_softcap)),
    Fault("post_norm_misplaced", "layer", "last", "the attention's post-norm in the wrong place (on the block's "
          "input: post; on the residual sum: sandwich)", post_norm_misplaced, lambda a: a.norm.placement != "pre"),
    Fault("post_norm_missing", "layer", "last", "the attention's post-norm left out", post_norm_missing,
          lambda a: a.norm.placement != "pre"),
    Fault("moe_output_norm_missing", "moe", "last", "the MoE block's output norm left out", moe_output_norm_missing,
          lambda a: a.moe_output_norm),
    Fault("moe_output_norm_before_shared", "moe", "last",
          "the MoE block's output norm applied to the routed experts alone, before the shared experts are added",
          moe_output_norm_before_shared, lambda a: a.moe_output_norm and has_shared(a)),
)


# (Gemma 4's: models/faults/gemma4.py; A.X-K2's and dots3's: models/faults/dsa2.py)
CATALOGUE: tuple[Fault, ...] = COMMON + BIASED_ROUTING_AND_MLA + VARIANTS + GEMMA4 + DSA2 + BLOCK_SPARSE + DOGE + INKLING + MUSE_SPARK + HYPER + INVARIANCE + DEEPSEEK_V4 + QWEN4 + ZAYA


def get(name: str) -> Fault:
    for f in CATALOGUE:
        if f.name == name:
            return f
    raise KeyError(f"unknown fault {name!r}; known: {', '.join(f.name for f in CATALOGUE)}")


def applicable(a: ModelArgs) -> list[Fault]:
    # (Inkling's router and attention do not run the code of NOT_FOR_INKLING's faults: models/faults/inkling.py; ZAYA's
    # router NOT_FOR_ZAYA's: models/faults/zaya.py)
    return [f for f in CATALOGUE if f.is_applicable(a) and not (a.inkling is not None and f.name in NOT_FOR_INKLING)
            and not (a.zaya is not None and f.name in NOT_FOR_ZAYA)]


# The point inside its block each fault breaks (oracle/drill/points.py): what the drill-down should name
# first (a tuple: any of these, where families differ). `output` where the fault is in the block's
# own arithmetic after its last point (a combine, a cast) or where no finer point exists (a final
# norm, the head); the first point after a residual sum for a residual fault. None: a dtype fault
# whose numbers agree (the drill compares values; the dtype gate and the block's dtype check name it).
POINTS: dict[str, str | tuple | None] = {
    # router
    "router_softmax_after_topk": "scores", "router_no_renorm": "weights", "router_wrong_num_experts": "scores",
    "router_sigmoid": "scores", "router_bias_in_weights": "weights", "router_bias_ignored": "selection",
    "router_group_limit_ignored": "selection", "router_choice_on_scores": "selection", "routed_scaling_missing": "weights", "routed_scaling_twice": "weights",
    "router_softmax_for_sigmoid": "scores", "router_logit_bias_ignored": "logits",
    "sparsemixer_first_unmasked": "weights",
    # experts and the MoE block
    "expert_gate_up_swapped": "experts", "expert_weights_off_1e-3": "experts", "expert_index_off_by_one": "experts",
    "expert_weights_not_applied": "experts", "swiglu_clamp_missing": "experts",
    # the routed experts and their router never run: the router's logits come first where HF's router is
    # inside the block (measured: the DeepSeek-style families, ERNIE, Llama 4), else the experts' output
    "moe_interleave_wrong": ("logits", "experts"),
    "stray_bf16_downcast": "output", "shared_expert_gate_no_sigmoid": "output",
    # the shared expert never runs: its first projection, which HF computes (an always-on one: DeepSeek's
    # shared_experts); where the module is gone from the candidate, the block's output
    # (relu^2 shared experts, Nemotron-H's, have no gate: their up projection comes first)
    "shared_expert_missing": ("shared_expert.gate_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "output"),
    "moe_output_upcast": None, "dense_layer_routed": "output",
    # the norm's own output (its input without the shared experts, or not normalised at all)
    "moe_output_norm_missing": "post_mlp_layernorm", "moe_output_norm_before_shared": "post_mlp_layernorm",
    # attention
    # (MLA's rotation has no tap: the attention's context there)
    "rope_theta_wrong": ("q_rope", "context"), "rope_interleaved": "q_rope", "rotary_fraction_wrong": "q_rope",
    "yarn_mscale_missing": ("q_rope", "context"), "q_position_scale_missing": "context",
    "rope_on_nope_layer": ("q_rope", "context"),  # (Kimi-Linear's NoPE MLA: the context)
    "clip_qkv_missing": "q_rope", "qk_norm_missing": "q_norm", "qk_norm_before_rope": ("q_norm", "q_rope"),
    "qk_norm_per_head_for_flat": "q_norm", "qk_norm_flat_for_per_head": "q_norm",
    "kv_cache_write_off_by_one": "context", "attention_not_causal": "context", "attention_scale_wrong": "context",
    "gqa_kv_heads_tiled": "context", "attention_gate_no_sigmoid": "context", "attention_sinks_dropped": "context",
    "sliding_window_off_by_one": "context", "attention_multiplier_missing": "context",
    "mla_rope_nope_swapped": "context", "rope_of_the_model_on_own_layer": "q_rope", "kv_groups_of_the_model": "context",
    "value_scale_missing": "context", "attention_gate_sigmoid_for_softplus": "context",
    "router_softcap_missing": "logits", "mla_cache_not_carried": "context",
    "gdn_state_not_carried": "recurrence", "gdn_chunked_prefill_differs": "recurrence",
    "gdn_conv_state_not_carried": "conv",
    # (HF's lightning attention computes its scan inline: the first point after it is its norm)
    "lightning_state_not_carried": ("recurrence", "norm"), "lightning_slope_layer_factor_missing": ("recurrence", "norm"),
    "lightning_gate_no_sigmoid": "context",
    # (the forget gate is HF's module: its output, the per-channel log decay, before the `g` tap; the output gate's
    # sigmoid is inside HF's gated norm, o_norm)
    "kda_state_not_carried": "recurrence", "kda_conv_state_not_carried": "conv", "kda_decay_sign_flipped": "forget_gate",
    "kda_decay_per_head": "forget_gate", "kda_output_gate_no_sigmoid": "o_norm",
    "kda_gate_bound_dropped": "forget_gate",
    "mla_head_gate_no_activation": "context",  # (the gate's projection agrees: its activation is inline)
    # the keys the indexer chose (its output; its projections agree)
    "dsa_index_heads_rolled": "indexer", "dsa_topk_off_by_one": "indexer", "dsa_index_cache_not_carried": "indexer",
    # (the rotation: q_rope where HF's indexer rotates with the function the drill reads, DeepSeek-V3.2's half-split)
    "dsa_rope_interleave_swapped": ("q_rope", "indexer"),
    "mamba_state_not_carried": "recurrence", "mamba_conv_state_not_carried": "conv",
    "mamba_decay_sign_flipped": "decay", "mamba_dt_bias_dropped": "dt", "mamba_inner_norms_missing": "dt_layernorm",
    "mamba2_state_not_carried": "recurrence", "mamba2_conv_state_not_carried": "conv",
    "mamba2_decay_sign_flipped": "decay", "mamba2_dt_bias_dropped": "dt", "mamba2_dt_bf16": "dt",
    "mamba2_chunk_boundary_off_by_one": "recurrence",
    "short_conv_state_not_carried": "conv", "short_conv_gate_missing": "context", "short_conv_taps_reversed": "conv",
    # layer, final norm, head
    # (rmsnorm_eps_wrong on a layer with an MLP alone, Nemotron-H's: its one norm)
    "rmsnorm_eps_wrong": ("input_layernorm", "post_attention_layernorm"), "norm_offset_missing": "post_attention_layernorm",
    "layernorm_as_rmsnorm": "input_layernorm",
    # (a parallel block has no post-attention norm: its layer's output; sandwich norms: the attention's post-norm is
    # before the residual sum, whose first point is the MLP's pre-norm)
    # (ZAYA's scaled residual add: its module's output)
    "residual_missing": ("post_attention_layernorm", "output", "pre_feedforward_layernorm", "post_attention_residual_scale"),
    "residual_multiplier_missing": "post_attention_layernorm", "shared_mlp_missing": ("shared_mlp", "output"),
    "shared_expert_summed": "output", "moe_bias_missing": "output",
    # (the attention experts' outputs have no output projection named o_proj: the block's output)
    "moa_kv_heads_interleaved": "output",
    # the post-norm computed on another value than HF's (post: before the attention, on the stream)
    "post_norm_misplaced": "post_attention_layernorm", "post_norm_missing": "post_attention_layernorm",
    "final_norm_eps_wrong": "output", "logits_cast_to_float": None, "logits_scaling_missing": "output",
    **GEMMA4_POINTS,
    **HYPER_POINTS,
    **DEEPSEEK_V4_POINTS,
    **INKLING_POINTS,
    **DSA2_POINTS,
    **BLOCK_SPARSE_POINTS,
    **DOGE_POINTS,
    **MUSE_SPARK_POINTS,
    **INVARIANCE_POINTS,
    **QWEN4_POINTS,
    **ZAYA_POINTS,
}
