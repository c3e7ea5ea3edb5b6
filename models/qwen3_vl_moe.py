"""Qwen3-VL-MoE's text tower (qwen3_vl_moe), on text input: Qwen3-MoE's mechanisms (per-head q/k RMSNorm,
softmax top-k routing, always renormalised, no shared expert, every layer MoE) under interleaved MRoPE.
On text MRoPE is 1-D rope: the text model gives every axis (temporal, height, width) the token's position
(its default without position ids; get_rope_index gives text tokens the same), so each frequency of the
mrope_section interleave is rotated by that one position, as plain rope with the same rope_theta does
(tests/test_text_tower.py). DeepStack's visual features are added only at image positions: none on text.

The reference is HF's Qwen3VLMoeTextModel with the release's lm_head (models.text_tower). The tiny
checkpoint has the release's layout: config.json the composite qwen3_vl_moe one (text_config nested,
architectures Qwen3VLMoeForConditionalGeneration), the language model at model.language_model.*, lm_head
at the top, the experts fused and transposed as the release stores them (gate_up_proj [E, H, 2I] gate
columns then up, down_proj [E, I, H]: transformers' qwen3_vl_moe conversion), no vision tower."""

from models.args import AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, UNTIED, MlxLm, const, head_dim
from models.text_tower import TextTower

TINY = dict(
    # moe_intermediate_size 24: 2I (48) differs from hidden_size (64), so the release's transposed
    # gate_up_proj [E, H, 2I] cannot be read untransposed without a shape error
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256,
    # the release's interleaved MRoPE sections, scaled to head_dim 16 (8 frequencies: 4 + 2 + 2)
    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)



def release_conversion(transforms: list) -> list:
    """HF's qwen3_vl_moe conversion (Transpose(1, 2, check_dims=True) of the fused experts), saving the release's
    layout: HF transposes on load only where the shape is not the parameter's, so its reverse never transposes
    and transformers 5.23's save_pretrained writes the in-memory [E, 2I, H], which mlx-lm's sanitize() and
    llama.cpp's converter (both split the last axis into gate and up) do not read; here saving transposes."""
    from transformers.core_model_loading import Transpose

    class SavedTransposed(Transpose):
        @property
        def reverse_op(self):
            return Transpose(dim0=self.dim1, dim1=self.dim0)

    for t in transforms:
        t.operations = [SavedTransposed(op.dim0, op.dim1, check_dims=True) if isinstance(op, Transpose) else op
                        for op in t.operations]
    return transforms


TOWER = TextTower(model="Qwen3VLMoeTextModel", composite="qwen3_vl_moe",
                  architecture="Qwen3VLMoeForConditionalGeneration", composite_config="Qwen3VLMoeConfig",
                  conversion=release_conversion)


def to_args(c) -> ModelArgs:
    require(not c.mlp_only_layers and c.decoder_sparse_step == 1,
            "qwen3_vl_moe: dense MLP layers (mlp_only_layers / decoder_sparse_step > 1) are not supported yet")
    return hf_args(
        c, "qwen3_vl_moe", attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=True),  # HF's Qwen3VLMoeTextTopKRouter always renormalises
    )


def release_names(weights: dict) -> dict:
    """The release's model.language_model.* (and a text-only model.*) as model.*, without the vision tower."""
    return {k.replace("model.language_model.", "model.", 1): t for k, t in weights.items()
            if not k.startswith(("model.visual.", "visual."))}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's fused experts are x @ W: gate_up_proj [E, H, 2I] (gate columns, then up), down_proj
    [E, I, H]; read as HF reads them (Transpose(check_dims=True)): transposed unless already the in-memory
    [E, 2I, H] / [E, H, I] that transformers 5.23's save_pretrained writes."""
    want = {"mlp.experts.gate_up_proj": (2 * args.moe_intermediate_size, args.hidden_size),
            "mlp.experts.down_proj": (args.hidden_size, args.moe_intermediate_size)}
    w = {}
    for k, t in release_names(weights).items():
        shape = next((s for end, s in want.items() if k.endswith(end)), None)
        w[k] = t.transpose(1, 2).contiguous() if shape and t.ndim == 3 and tuple(t.shape[1:]) != shape else t
    return sanitize_hf(w, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names (language_model.model.*, language_model.lm_head, switch_mlp [E, out, in]) -> the release's."""
    import torch

    out = {}
    for name, v in weights.items():
        k = name.replace("language_model.model.", "model.language_model.", 1).replace("language_model.lm_head.", "lm_head.")
        if k.endswith("switch_mlp.gate_proj.weight"):
            up = weights[name.replace("gate_proj", "up_proj")]
            out[k.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj")] = \
                torch.cat([v, up], dim=1).transpose(1, 2).contiguous()
        elif k.endswith("switch_mlp.down_proj.weight"):
            out[k.replace("switch_mlp.down_proj.weight", "experts.down_proj")] = v.transpose(1, 2).contiguous()
        elif not k.endswith("switch_mlp.up_proj.weight"):
            out[k] = v
    return out


MLX = MlxLm(
    module="qwen3_vl_moe",
    args_class=("qwen3_moe", "ModelArgs"),  # the text_config of qwen3_vl_moe's ModelArgs: a qwen3_moe model
    config=dict(
        model_type=const("qwen3_moe"), hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", head_dim=head_dim, rms_norm_eps="rms_norm_eps",
        vocab_size="vocab_size", max_position_embeddings="max_position_embeddings",
        num_experts="num_experts", num_experts_per_tok="num_experts_per_tok",
        norm_topk_prob=const(True),  # HF's router always renormalises; the text config has no such field
        decoder_sparse_step="decoder_sparse_step", mlp_only_layers="mlp_only_layers",
        moe_intermediate_size="moe_intermediate_size", tie_word_embeddings="tie_word_embeddings",
        rope_theta=rope_theta, rope_scaling=const(None),  # mlx-lm's qwen3_moe: 1-D rope (text positions)
    ),
    require=COMMON_REQUIRE + UNTIED + (
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's qwen3_moe has no attention biases)"),
    ),
    convert=lambda weights: weights,  # its sanitize() takes the release's names and transposed experts
)

FAMILY = Family(
    name="qwen3_vl_moe", model_types=("qwen3_vl_moe", "qwen3_vl_moe_text"), hf_module="qwen3_vl_moe",
    hf_class_name="Qwen3VLMoeTextModel", hf_config_name="Qwen3VLMoeTextConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, from_mlx=from_mlx, mlx=MLX, text_tower=TOWER,
    rules=(("positive", "moe_intermediate_size", "decoder_sparse_step"), ("layer_index", "mlp_only_layers")),
)
