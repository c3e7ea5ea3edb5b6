"""ZAYA (zaya, Zyphra's ZAYA1): compressed convolutional attention (CCA: q and k through two causal convolutions plus
a residual path, the values half from the current token and half from the previous one, q and k l2-normed to
sqrt(head_dim) with a learned key scale per kv head; models/layers/cca.py) with partial rotary per layer type
("hybrid" full, "hybrid_sliding" sliding-window layers); an MLP router whose down-projection of the hidden state is
carried to the next layer's router (the cross-layer state, scaled there), softmax over the experts and one skip expert
(no computation, weight 0), the choice on the probabilities plus balancing biases (fp32), top-1; Qwen3-MoE's experts;
each residual add scaled with biases on both sides (ZayaResidualScaling), the stream kept in fp32; the embeddings
scaled with a bias; a tied head (optionally biased). Mechanisms: models/layers/cca.py, models/layers/zaya_router.py
(ModelArgs.zaya)."""

from __future__ import annotations

import functools

from models.args import FULL, SLIDING, AttentionArgs, ModelArgs, RopeArgs, RouterArgs, ZayaArgs
from models.family import Family
from models.mapping import hf_args, require, sanitize_hf

TYPES = {"hybrid": FULL, "hybrid_sliding": SLIDING}

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32, router_hidden_size=32, cca_time0=2, cca_time1=2,
    # a full layer, a sliding-window one (the window shorter than the prompts), a full one
    layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window=4, max_position_embeddings=256,
    # the release's partial rotary on half of each head, the tiny thetas low enough to rotate the tiny head's few
    # frequencies across a prompt
    rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                     "hybrid_sliding": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}},
    tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def rope(c) -> RopeArgs:
    """The "hybrid" layers' rope as the model's, the "hybrid_sliding" layers' as its `sliding` where it differs."""
    rp = c.rope_parameters

    def of(kind: str) -> RopeArgs:
        p = rp.get(kind) or rp.get("hybrid")
        require(p.get("rope_type", "default") == "default", f"zaya: rope_type {p.get('rope_type')!r} (default only)")
        return RopeArgs(float(p["rope_theta"]), partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)))

    full, sliding = of("hybrid"), of("hybrid_sliding")
    return full if sliding == full else RopeArgs(full.theta, partial_rotary_factor=full.partial_rotary_factor,
                                                 sliding=sliding)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"zaya: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(not c.attention_bias, "zaya: attention_bias (the release has none; CCA's first delayed value would be "
                                  "v_proj_delayed's bias)")
    require(set(c.layer_types) <= set(TYPES), f"zaya: unknown layer_types {sorted(set(c.layer_types))}")
    return hf_args(
        c, "zaya", layer_types=tuple(TYPES[t] for t in c.layer_types), rope=rope(c),
        attention=AttentionArgs(sliding_window=c.sliding_window),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        # softmax over the experts and the skip expert; the choice on the probabilities plus the balancing biases
        # (fp32, HF's buffer), the weight the chosen probability (not renormalised)
        router=RouterArgs(correction_bias=True), lm_head_bias=c.lm_head_bias,
        zaya=ZayaArgs(cca_time0=c.cca_time0, cca_time1=c.cca_time1, router_hidden_size=c.router_hidden_size),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """HF's names are the release's and the production model's (models/layers/cca.py, zaya_router.py): `model.`
    stripped, the tied head."""
    return sanitize_hf(weights, args)


def router_output(out, args: ModelArgs):
    """HF's ZayaRouter returns (logits [N, E + 1], the chosen probability [N, k], indices [N, k], its state) with the
    skip expert masked to index 0 at weight 0 for its experts' one-hot: the skip expert is a choice, restored as index
    E (a chosen probability is never 0 otherwise: a softmax's)."""
    logits, weights, idx = out[:3]
    return logits, weights, idx.masked_fill((weights == 0) & (idx == 0), args.num_experts)


def router_input(out, weights, idx, args: ModelArgs):
    """router_output's inverse: HF's output with the given choice, the skip expert masked as HF masks it."""
    skip = idx == args.num_experts
    return out[0], weights.masked_fill(skip, 0), idx.masked_fill(skip, 0), *out[3:]


# the router's output projection drawn wide (the probabilities of its MLP's logits at std 0.1 differ by ~0.02: the
# balancing biases would make every choice), the balancing biases (HF's fp32 buffer, the choice only) at 0.02: both
# decide, and every expert and the skip expert are chosen on some tokens; the scales around 1
TINY_STD = {"out_proj.weight": 1.0, "balancing_biases": 0.02, "residual_scale": (1.0, 0.2),
            "hidden_states_scale": (1.0, 0.2), "router_states_scale": (1.0, 0.3), "qk_norm.temp": (1.0, 0.3)}

def point_view(points, args: ModelArgs, layer=None):
    """The drill's points of HF's CCA (Family.hf_point_view): its two convolutions' outputs are channels-first [B, C, L]
    with L the call's tokens plus the carried inputs still in the second's window (rows the drill cannot line up by
    token): the second's, trimmed to the call's tokens by its conv, is the `conv` point [B, T, C] (the production
    model's tap), the first's left out (inside the same composition on both sides)."""
    import copy

    import numpy as np

    out = copy.copy(points)
    out.clear()
    for name, values in points.items():
        if name.endswith("qkv_proj.conv_qk_grouped"):
            out["conv"] = [np.swapaxes(np.asarray(v), 1, 2) for v in values]
        elif not name.endswith("qkv_proj.conv_qk_depthwise"):
            out[name] = values
    return out


@functools.cache
def reference():
    """HF's ZayaForCausalLM keeping the checkpoint's skip-expert balancing bias. **HF 5.23 bug, measured:** its
    _init_weights, which from_pretrained runs on every module after loading, writes balancing_biases[-1] = -1.0 outside
    the guarded init functions (`# trf-ignore: TRF012`), over the value loaded: the model HF runs is not the
    checkpoint's (the tiny checkpoint's logits 0.10 max abs apart from the checkpoint's model, seed 0; the production
    model reads the checkpoint). Here a loaded bias is put back after HF's init; a fresh model keeps HF's -1.0."""
    from transformers.models.zaya import modeling_zaya as z

    class ZayaForCausalLM(z.ZayaForCausalLM):
        def _initialize_missing_keys(self, *args, **kwargs):
            routers = [m for m in self.modules() if isinstance(m, z.ZayaRouter)]
            loaded = [r.balancing_biases.detach().clone() for r in routers]
            super()._initialize_missing_keys(*args, **kwargs)
            for r, bias in zip(routers, loaded):
                if getattr(r.balancing_biases, "_is_hf_initialized", False):  # (loaded, not missing)
                    r.balancing_biases.copy_(bias)

    ZayaForCausalLM.__module__ = z.__name__  # (its architectures entry and class are HF's)
    ZayaForCausalLM.__qualname__ = "ZayaForCausalLM"
    return ZayaForCausalLM


FAMILY = Family(
    name="zaya", model_types=("zaya",), hf_module="zaya", hf_class_name="ZayaForCausalLM", hf_config_name="ZayaConfig",
    tiny_config=TINY, to_args=to_args, sanitize=sanitize, tiny_std=TINY_STD, router_output=router_output,
    router_input=router_input, hf_router_bias="mlp.gate.balancing_biases", hf_reference=reference,
    hf_point_view=point_view,
)
