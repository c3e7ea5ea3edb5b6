"""DBRX (Databricks): GQA whose q, k and v come from one fused projection `Wqkv` and are clamped to
[-clip_qkv, clip_qkv] (AttentionArgs.clip_qkv), default RoPE, bias-free LayerNorms (eps 1e-5, HF's
nn.LayerNorm default); routing: softmax over the experts, top-k, the k weights divided by their p-norm
(moe_normalize_expert_weights; 1 in the release: their sum; None: not renormalised, RouterArgs.norm_p);
SwiGLU experts, no shared expert. HF nests the model under `transformer` (wte, blocks, norm_f; each
block's norm_attn_norm.{norm_1, attn, norm_2} and ffn.{router.layer, experts}) and keeps each layer's
experts fused over the experts in the rows: w1 (gate) and v1 (up) [E*I, H], w2 (down) [E*I, H], the
down projection's transpose stacked (x @ w2[e]). HF's router returns the logits alone: the routing
is its MoE block's (router_output reads it the same way)."""

import re

from models.args import FULL, AttentionArgs, ModelArgs, NormArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import require, rope_theta, tie_embeddings
from models.mlx_lm import DEFAULT_ROPE, UNTIED, MlxLm

TINY = dict(
    vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
    # the clip must bite: the tiny projections (LayerNorm's output times weights of std 0.1 over 64 inputs) are
    # about N(0, 0.8), so 1.0 clamps about a fifth of q, k and v (the release: 8)
    attn_config=dict(kv_n_heads=2, clip_qkv=1.0, rope_theta=500000.0),
    ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2, moe_normalize_expert_weights=1.0,
                    ffn_act_fn={"name": "silu"}),
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

LAYER_NORM_EPS = 1e-5  # HF's nn.LayerNorm(d_model, bias=False): torch's default eps


def to_args(c) -> ModelArgs:
    f, at = c.ffn_config, c.attn_config
    require((f.ffn_act_fn or {}).get("name", "silu") == "silu",
            f"dbrx: ffn_act_fn {f.ffn_act_fn!r} (the experts are SwiGLU: silu only)")
    p = f.moe_normalize_expert_weights
    return ModelArgs(
        family="dbrx", vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=at.kv_n_heads, head_dim=c.d_model // c.n_heads,
        rms_norm_eps=LAYER_NORM_EPS, num_experts=f.moe_num_experts, num_experts_per_tok=f.moe_top_k,
        moe_intermediate_size=f.ffn_hidden_size, layer_types=(FULL,) * c.n_layers,
        rope=RopeArgs(rope_theta(c)), tie_word_embeddings=c.tie_word_embeddings,
        attention=AttentionArgs(clip_qkv=None if at.clip_qkv is None else float(at.clip_qkv)),
        router=RouterArgs(norm_topk_prob=p is not None, norm_p=1.0 if p is None else float(p)),
        norm=NormArgs(kind="layer", bias=False),
    )


RENAMES = ((r"^transformer\.wte\.", "embed_tokens."), (r"^transformer\.norm_f\.", "norm."),
           (r"^transformer\.blocks\.", "layers."),
           (r"\.norm_attn_norm\.norm_1\.", ".input_layernorm."), (r"\.norm_attn_norm\.norm_2\.", ".post_attention_layernorm."),
           (r"\.norm_attn_norm\.attn\.out_proj\.", ".self_attn.o_proj."),
           (r"\.norm_attn_norm\.attn\.Wqkv\.", ".self_attn.Wqkv."), (r"\.ffn\.router\.layer\.", ".mlp.gate."))
EXPERTS = re.compile(r"(.*)\.ffn\.experts\.mlp\.(w1|v1|w2)$")


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's names -> the production model's; Wqkv split into q/k/v (its rows: q, then k, then v);
    the experts' w1/v1 [E*I, H] stacked as gate_up_proj [E, 2I, H], w2 [E*I, H] as down_proj [E, H, I]."""
    import torch

    E, I, H = args.num_experts, args.moe_intermediate_size, args.hidden_size
    kv = args.num_key_value_heads * args.head_dim
    out, experts = {}, {}
    for k, t in weights.items():
        if m := EXPERTS.match(k):
            experts.setdefault(m.group(1).replace("transformer.blocks.", "layers.", 1), {})[m.group(2)] = t
            continue
        for pattern, new in RENAMES:
            k = re.sub(pattern, new, k)
        if k.endswith(".self_attn.Wqkv.weight"):
            out.update(split_wqkv(k, t, args.num_attention_heads * args.head_dim, kv))
        else:
            out[k] = t
    for layer, w in experts.items():
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [w["w1"].reshape(E, I, H), w["v1"].reshape(E, I, H)], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = w["w2"].reshape(E, I, H).transpose(1, 2)
    return tie_embeddings(out, args)


def profile_view(sd: dict, cfg: dict) -> dict:
    """The trained profile's names for HF's DBRX tensors (Family.hf_profile_view): the RENAMES under model.,
    Wqkv as views of its q, k and v rows; the router and experts keep their names (Family.hf_router reads them)."""
    hd = cfg["d_model"] // cfg["n_heads"]
    out = {}
    for k, t in sd.items():
        for pattern, new in RENAMES[:-1]:  # (not the router's)
            k = re.sub(pattern, new, k)
        k = k if k.startswith("lm_head.") else "model." + k
        if k.endswith(".self_attn.Wqkv.weight"):
            out.update(split_wqkv(k, t, cfg["n_heads"] * hd, cfg["attn_config"]["kv_n_heads"] * hd))
        else:
            out[k] = t
    return out


def split_wqkv(name: str, t, q_rows: int, kv_rows: int) -> dict:
    """A Wqkv [q + 2 kv, H] (its rows: q, then k, then v) as q_proj, k_proj and v_proj beside it (views of its rows)."""
    base = name[: -len("Wqkv.weight")]
    return dict(zip((base + "q_proj.weight", base + "k_proj.weight", base + "v_proj.weight"),
                    t.split([q_rows, kv_rows, kv_rows], dim=0)))


def router_output(logits, args: ModelArgs):
    """HF's router's logits [N, E] -> (logits, weights, indices) as DbrxFFN.route_tokens_to_experts
    computes them: softmax, top-k, the weights over their p-norm."""
    import torch

    probs = torch.softmax(logits, dim=1, dtype=logits.dtype)
    w, idx = torch.topk(probs, args.num_experts_per_tok, dim=-1)
    if args.router.norm_topk_prob:
        w = w / torch.norm(w, p=args.router.norm_p, dim=-1, keepdim=True)
    return logits, w, idx


def router_input(logits, weights, idx, args: ModelArgs):
    """router_output's inverse: logits whose routing gives `weights` at `idx`: log(weights) there, -inf
    elsewhere (weights already normalised come back as they are); without renormalisation the mass the
    weights leave spread evenly over the other experts."""
    import torch

    w = weights.to(logits.dtype).reshape(-1, idx.shape[-1])
    rest = torch.full_like(logits, float("-inf"))
    if not args.router.norm_topk_prob:
        left = (1 - w.sum(-1, keepdim=True)).clamp(min=0) / max(1, logits.shape[-1] - idx.shape[-1])
        rest = torch.log(left).expand_as(logits).clone()
    return rest.scatter(1, idx.reshape(-1, idx.shape[-1]), torch.log(w))


MLX_EXPERT = re.compile(r"(.*\.ffn\.experts)\.(\d+)\.(w1|v1|w2)\.weight")


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's per-expert `ffn.experts.{e}.{w1,v1,w2}.weight` ([I, H], w2 [H, I]) -> the release's fused
    `ffn.experts.mlp.{w1,v1,w2}` [E*I, H] (w2 each expert's transpose): the inverse of mlx-lm's sanitize.
    The other names are the release's (mlx-lm keeps transformer.blocks, norm_attn_norm, router.layer)."""
    import torch

    out, experts = {}, {}
    for k, v in weights.items():
        if m := MLX_EXPERT.fullmatch(k):
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = v.T if m[3] == "w2" else v
        else:
            out[k] = v
    for (prefix, name), per in experts.items():
        out[f"{prefix.rsplit('.', 1)[0]}.experts.mlp.{name}"] = torch.cat([per[e] for e in range(len(per))])
    return out


MLX = MlxLm(
    module="dbrx",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", d_model="d_model", n_layers="n_layers", n_heads="n_heads",
        ffn_config=lambda c: dict(ffn_hidden_size=c.ffn_config.ffn_hidden_size,
                                  moe_num_experts=c.ffn_config.moe_num_experts, moe_top_k=c.ffn_config.moe_top_k),
        attn_config=lambda c: dict(kv_n_heads=c.attn_config.kv_n_heads, clip_qkv=c.attn_config.clip_qkv,
                                   rope_theta=rope_theta(c)),
    ),
    # mlx-lm's dbrx hard-codes: the clamp (mx.clip of None fails), the weights over their sum, SwiGLU experts,
    # LayerNorm's eps 1e-5 (HF's nn.LayerNorm default, the same), its own lm_head, default RoPE
    require=DEFAULT_ROPE + UNTIED + (
        (lambda c: c.attn_config.clip_qkv is not None, "clip_qkv None (mlx-lm's dbrx always clamps q, k and v)"),
        (lambda c: c.ffn_config.moe_normalize_expert_weights == 1,
         "moe_normalize_expert_weights other than 1 (mlx-lm's dbrx divides the top-k weights by their sum)"),
        (lambda c: (c.ffn_config.ffn_act_fn or {}).get("name", "silu") == "silu",
         "ffn_act_fn other than silu (mlx-lm's dbrx experts are SwiGLU)"),
    ),
    moe="ffn",
    # the release's fused experts are what mlx-lm's sanitize splits (its `experts.mlp` names): passed as they are
    convert=lambda weights: weights,
)

FAMILY = Family(
    name="dbrx", model_types=("dbrx",), hf_module="dbrx", hf_class_name="DbrxForCausalLM",
    hf_config_name="DbrxConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    hf_attention=("norm_attn_norm.attn",), hf_moe="ffn", hf_router="ffn.router.layer", hf_mlp="ffn",
    router_output=router_output, router_input=router_input, hf_profile_view=profile_view,
    mlx=MLX, from_mlx=from_mlx,
    experts="ffn_config.moe_num_experts", top_k="ffn_config.moe_top_k",
    rules=(("positive", "d_model", "n_heads", "n_layers", "ffn_config.ffn_hidden_size", "attn_config.kv_n_heads",
            "attn_config.clip_qkv", "ffn_config.moe_normalize_expert_weights"),
           ("divides", "attn_config.kv_n_heads", "n_heads"), ("at_most", "n_heads", "d_model")),
)
