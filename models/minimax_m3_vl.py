"""MiniMax-M3 (minimax_m3_vl's text model, MiniMaxM3VLForCausalLM): GQA with a per-head (1+w) q/k RMSNorm and
partial rotary (the rope's partial_rotary_factor; the release's rotary_dim), on the `minimax_m3_sparse` layers
block-sparse (models/layers/block_sparse.py: a block indexer keeps, per query and kv head, the topk_blocks best
blocks of index_block_size keys plus the local one); (1+w) RMSNorms with the gain in fp32; dense layers by
mlp_layer_types (a clamped SwiGLU MLP, gate/up fused), the others experts chosen on sigmoid scores plus a
correction bias, the chosen scores renormalised (fp32), the routed sum times routed_scaling_factor, plus an
always-on shared expert; every MLP gpt-oss's clamped SwiGLU (gate <= limit, |up| <= limit,
gate · sigmoid(alpha · gate) · (up + 1)), gate and up not interleaved.

The tiny config makes the sparsity bite: blocks of 2 keys, 2 of them kept (the query's own and one more), so from
the fifth position on each query attends to 4 of its keys or fewer; two indexer heads over two kv heads of two q
heads each (a choice per group)."""

import re

from models.args import DENSE, FULL, SPARSE, AttentionArgs, BlockSparse, ExpertArgs, ModelArgs, NormArgs, RopeArgs, RouterArgs
from models.family import Family
from models.checkpoint import stack_experts
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import DEFAULT_ROPE, MlxLm, const, head_dim, rope_parameters

SPARSE_ATTN = "minimax_m3_sparse"  # HF's layer type of a block-sparse layer

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
    num_experts_per_tok=2, max_position_embeddings=256, routed_scaling_factor=2.0,
    # half of each head rotated (the release's rotary_dim 64 of 128), written both ways as the release's re-save does
    rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    # a dense full layer, then two block-sparse MoE layers
    layer_types=[FULL, SPARSE_ATTN, SPARSE_ATTN], mlp_layer_types=[DENSE, SPARSE, SPARSE],
    # the sparsity bites on the 8-token prompt: blocks of 2, the query's own and the best other kept
    index_n_heads=2, index_head_dim=16, index_block_size=2, index_topk_blocks=2, index_local_blocks=1,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def partial_rotary(c) -> float:
    return float((c.rope_parameters or {}).get("partial_rotary_factor", 1.0))


def block_sparse(c) -> BlockSparse:
    require(set(c.layer_types) <= {FULL, SPARSE_ATTN}, f"minimax_m3_vl: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.num_key_value_heads % c.index_n_heads == 0 or c.index_n_heads % c.num_key_value_heads == 0,
            f"index_n_heads {c.index_n_heads} and num_key_value_heads {c.num_key_value_heads}")
    require(c.num_attention_heads % c.index_n_heads == 0,
            f"num_attention_heads {c.num_attention_heads} not a multiple of index_n_heads {c.index_n_heads} "
            "(each indexer head's choice serves a group of q heads)")
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    require(int(head_dim * partial_rotary(c)) <= c.index_head_dim,
            f"index_head_dim {c.index_head_dim} below the rotary dims (HF's indexer takes cos[..., :index_head_dim])")
    return BlockSparse(index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim, block_size=c.index_block_size,
                       topk_blocks=c.index_topk_blocks, local_blocks=c.index_local_blocks,
                       layers=tuple(t == SPARSE_ATTN for t in c.layer_types))


def to_args(c) -> ModelArgs:
    require(set(c.mlp_layer_types) <= {DENSE, SPARSE}, f"minimax_m3_vl: unknown mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    require((c.rope_parameters or {}).get("rope_type", "default") == "default",
            f"rope_type {(c.rope_parameters or {}).get('rope_type')!r} (HF's MiniMax-M3 is checked with default RoPE)")
    return hf_args(
        c, "minimax_m3_vl", rope=RopeArgs(rope_theta(c), partial_rotary_factor=partial_rotary(c)),
        norm=NormArgs(offset=True),
        attention=AttentionArgs(qk_norm="head", block_sparse=block_sparse(c)),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.dense_intermediate_size,
        num_experts=c.num_local_experts, moe_intermediate_size=c.intermediate_size,
        shared_expert_intermediate_size=c.shared_intermediate_size, shared_expert_gated=False,
        mlp_activation="clamped_swiglu",
        experts=ExpertArgs("clamped_swiglu", swiglu_limit=float(c.swiglu_limit), swiglu_alpha=float(c.swiglu_alpha)),
        # HF: logits in the model's dtype, sigmoid in fp32, the choice on scores + bias, the chosen scores
        # renormalised and kept in fp32; its MoE block scales the routed sum (router_output)
        router=RouterArgs(scoring="sigmoid", correction_bias=True, norm_topk_prob=True,
                          routed_scaling_factor=float(c.routed_scaling_factor), weights_in_model_dtype=False),
    )


# the release's names (MiniMaxM3SparseForCausalLM's: what llama.cpp's converter and mlx-lm read) -> HF's
RELEASE_NAMES = ((r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
                 (r"\.block_sparse_moe\.", ".mlp."), (r"\.self_attn\.index_", ".self_attn.indexer."))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's layout (the seeded checkpoints': per-expert w1 / w3 / w2 under block_sparse_moe, the correction
    bias on the block, the indexer's index_* on the attention, gate_proj / up_proj apart) or HF's own (fused
    experts.gate_up_proj, the dense and shared MLPs' gate_up_proj [2I, H]: gate rows, then up) -> the production
    model's."""
    out = {}
    for k, t in weights.items():
        for pattern, to in RELEASE_NAMES:
            k = re.sub(pattern, to, k)
        if k.endswith(".gate_up_proj.weight"):
            p = k[: -len("gate_up_proj.weight")]
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = (x.contiguous() for x in t.chunk(2, dim=0))
        else:
            out[k] = t
    out = stack_experts(out, r"(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight", ("w1", "w3", "w2"))
    return sanitize_hf(out, args)


def reference():
    """HF's MiniMaxM3VLForCausalLM reading and writing the release's layout: transformers 5.23 registers the release's
    conversion (conversion_mapping "minimax_m3_vl": block_sparse_moe with per-expert w1 / w3 / w2, index_* on the
    attention, gate_proj / up_proj apart) for the composite model_type alone, not for this text model's
    (minimax_m3_vl_text), whose save_pretrained would write HF's fused names, which llama.cpp's converter does not
    read. Registered for this class (as models.text_tower does for a text tower): save_pretrained writes the release's
    layout, from_pretrained reads it (and HF's own names, which no conversion pattern matches) to the same model."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    # the composite's own renames (^language_model., the vision tower's, the projector's) left out: they would write
    # this model's lm_head as language_model.lm_head
    layers = [t for t in get_checkpoint_conversion_mapping("minimax_m3_vl")
              if not any(p.startswith("^") for p in t.source_patterns)]
    register_checkpoint_conversion_mapping("MiniMaxM3VLForCausalLM", layers, overwrite=True)
    return MiniMaxM3VLForCausalLM


def release_fields(c: dict) -> dict:
    """The release's config.json fields beside HF's flat ones (llama.cpp's converter reads these: the architecture,
    the shared experts' count, the router's scoring, the dense layers from moe_layer_freq, the indexer from
    sparse_attention_config; HF's MiniMaxM3VLTextConfig reads them to the same values as the flat fields)."""
    return dict(model_type="minimax_m3", architectures=["MiniMaxM3SparseForCausalLM"], n_shared_experts=1, scoring_func="sigmoid",
                use_routing_bias=True, moe_layer_freq=[int(t == SPARSE) for t in c["mlp_layer_types"]],
                sparse_attention_config=dict(
                    use_sparse_attention=True, sparse_num_index_heads=c["index_n_heads"],
                    sparse_index_dim=c["index_head_dim"], sparse_block_size=c["index_block_size"],
                    sparse_topk_blocks=c["index_topk_blocks"], sparse_local_block=c["index_local_blocks"],
                    sparse_score_type="max", sparse_init_block=0,
                    sparse_attention_freq=[int(t == SPARSE_ATTN) for t in c["layer_types"]]))


def router_output(out, args):
    """HF's router returns (logits, renormalised weights, indices); its MoE block scales the routed sum by
    routed_scaling_factor, the production router scales the weights (the same products)."""
    logits, weights, idx = out
    return logits, weights * args.router.routed_scaling_factor, idx


def router_input(out, weights, idx, args):
    """router_output's inverse: HF's triple with the given top-k, its weights unscaled."""
    return out[0], (weights / args.router.routed_scaling_factor).to(out[1].dtype), idx


def point_view(points, args: ModelArgs, layer=None):
    """HF's `experts` point (the sum by unscaled weights) times routed_scaling_factor: the production one."""
    import copy

    out = copy.copy(points)
    f = args.router.routed_scaling_factor
    for n in [n for n in points if n == "experts" or n.endswith(".experts")]:
        out[n] = [a * f for a in points[n]]
    return out


def to_mlx(weights: dict) -> dict:
    """The checkpoint's arrays (the release's layout, the seeded checkpoints', pass as they are; HF's own names are
    renamed) under the names mlx-lm's minimax_m3_vl sanitize() takes (the release's, as HF's conversion mapping reads
    them): language_model.model.* and language_model.lm_head, the MoE block
    block_sparse_moe with its correction bias on the block, the experts fused (switch_mlp.gate_up_proj, split by its
    sanitize), the indexer's tensors index_{q,k}_{proj,norm} on the attention, the dense MLP's gate/up split."""
    import mlx.core as mx

    out = {}
    for k, v in weights.items():
        k = "language_model." + k if k.startswith(("model.", "lm_head.")) else k
        k = (k.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
              .replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")
              .replace(".self_attn.indexer.", ".self_attn.index_"))
        if k.endswith(".mlp.experts.gate_up_proj") or k.endswith(".mlp.experts.down_proj"):
            k = k.replace(".mlp.experts.", ".block_sparse_moe.switch_mlp.") + ".weight"
        elif k.endswith(".mlp.gate_up_proj.weight"):  # a dense layer's (its sanitize splits the MoE block's alone)
            gate, up = mx.split(v, 2, axis=0)
            out[k.replace("gate_up_proj", "gate_proj")], out[k.replace("gate_up_proj", "up_proj")] = gate, up
            continue
        out[k] = v
    return out


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names (its directory: language_model.*, the experts stacked) -> the release's, the seeded checkpoints'
    layout: the text model at model.* and lm_head, the experts one by one as w1 / w3 / w2 (gate, up, down)."""
    from models.checkpoint import unstack_experts

    experts = unstack_experts(weights, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    return {k.removeprefix("language_model."): v for k, v in experts.items()}


def _text(c) -> dict:
    return dict(rope_parameters(c))


MLX = MlxLm(
    module="minimax_m3_vl",
    args_class=("minimax_m3_vl", "TextArgs"),  # the text_config of its ModelArgs, the text model at language_model
    config=dict(
        model_type=const("minimax_m3_vl_text"), hidden_size="hidden_size", intermediate_size="intermediate_size",
        dense_intermediate_size="dense_intermediate_size", shared_intermediate_size="shared_intermediate_size",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        num_hidden_layers="num_hidden_layers", num_local_experts="num_local_experts",
        num_experts_per_tok="num_experts_per_tok", max_position_embeddings="max_position_embeddings",
        rms_norm_eps="rms_norm_eps", rope_theta=rope_theta, rope_parameters=_text, head_dim=head_dim,
        rotary_dim=lambda c: int(head_dim(c) * partial_rotary(c)), partial_rotary_factor=partial_rotary,
        vocab_size="vocab_size", tie_word_embeddings="tie_word_embeddings",
        routed_scaling_factor="routed_scaling_factor", use_qk_norm=const(True), use_gemma_norm=const(True),
        swiglu_alpha="swiglu_alpha", swiglu_limit="swiglu_limit", mlp_layer_types=lambda c: list(c.mlp_layer_types),
        layer_types=lambda c: list(c.layer_types), index_n_heads="index_n_heads", index_head_dim="index_head_dim",
        index_block_size="index_block_size", index_topk_blocks="index_topk_blocks",
        index_local_blocks="index_local_blocks",
        # the release's own spellings of the same (mlx-lm reads them where the flat ones are absent)
        moe_layer_freq=const(None), sparse_attention_config=const(None), sparse_attention_freq=const(None),
    ),
    require=DEFAULT_ROPE,
    moe="block_sparse_moe", convert=to_mlx,
)

FAMILY = Family(
    name="minimax_m3_vl", model_types=("minimax_m3_vl_text", "minimax_m3"), hf_module="minimax_m3_vl",
    hf_class_name="MiniMaxM3VLForCausalLM", hf_config_name="MiniMaxM3VLTextConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, router_output=router_output, router_input=router_input,
    hf_point_view=point_view, mlx=MLX, from_mlx=from_mlx, experts="num_local_experts", hf_reference=reference,
    release_config=release_fields(TINY),
    # gate values beyond the clamp at 7 (as gpt_oss's), the experts' outputs kept near the stream's scale (with down_proj
    # at 0.1 the stream reaches RMS ~9 and a 1000x norm eps moves nothing: rmsnorm_eps_wrong, final_norm_eps_wrong missed)
    tiny_std={"experts.gate_up_proj": 0.5, "experts.down_proj": 0.02},
    rules=(("positive", "intermediate_size", "dense_intermediate_size", "shared_intermediate_size", "index_n_heads",
            "index_head_dim", "index_block_size", "index_topk_blocks"),
           ("per_layer", "mlp_layer_types", "layer_types")),
)
