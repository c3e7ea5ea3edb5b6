"""Gemma 4's MoE configuration (models/gemma4.py): the reference, HF's Gemma4ForCausalLM with its MoE block's modules
regrouped under one module, computes what HF's own class does, bit for bit; the mechanisms it brought (proportional
RoPE, the values as the keys' projection, the router on the normed stream) against HF's own modules; what the MoE
release does not use is refused by name."""

import pytest
import torch

from models import get_family
from models.checkpoint import CheckpointError
from oracle.source.seeded import tiny_checkpoint

FAM = get_family("gemma4")


def test_the_reference_is_hf_s_own_model_bit_for_bit():
    """Prefill then decode through the cache (the sliding window passed), the regrouped reference and HF's class on
    the tiny checkpoint: the same logits, exactly; and the regrouping writes HF's names (no tensor of its own)."""
    from transformers.models.gemma4 import Gemma4ForCausalLM

    d = tiny_checkpoint(FAM, 0)
    models = [cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
              for cls in (Gemma4ForCausalLM, FAM.hf_class())]
    assert type(models[1]) is not Gemma4ForCausalLM and models[1].state_dict().keys() == models[0].state_dict().keys()
    assert all(hasattr(layer, "moe") for layer in models[1].model.layers)
    tokens = torch.tensor([[3, 141, 59, 26, 5, 35, 89, 79]])
    outs = []
    with torch.no_grad():
        for m in models:
            out = m(input_ids=tokens, use_cache=True)
            logits = [out.logits]
            for t in (17, 200, 4):
                out = m(input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits)
            outs.append(torch.cat(logits, dim=1))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].abs().max() < FAM.tiny_config["final_logit_softcapping"]  # the cap bites: |logits| below it
    assert outs[0].abs().max() > 0.8 * FAM.tiny_config["final_logit_softcapping"]


def test_proportional_rope_is_hf_s():
    """The full layers' "proportional" RoPE: the production Rope's frequencies and rotation are HF's (rotate-half over
    the whole 512-wide head, the first quarter of its slots rotating at theta^(-2i/512))."""
    from types import SimpleNamespace

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    from models.args import RopeArgs
    from models.layers.rope import Rope

    p = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    cfg = SimpleNamespace(rope_parameters=p, head_dim=512, hidden_size=2816, num_attention_heads=16,
                          standardize_rope_params=lambda: None)
    inv, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg)
    rope = Rope(512, RopeArgs(1e6, "proportional", partial_rotary_factor=0.25))
    assert torch.equal(rope.inv_freq, inv) and int((inv > 0).sum()) == 64
    x, pos = torch.randn(1, 2, 5, 512), torch.arange(3, 8)
    emb = torch.cat((pos[:, None].float() * inv, pos[:, None].float() * inv), dim=-1)
    want = apply_rotary_pos_emb(x.transpose(1, 2), emb.cos()[None], emb.sin()[None], unsqueeze_dim=2).transpose(1, 2)
    torch.testing.assert_close(rope(x, pos), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("change, words", [
    ({"hidden_size_per_layer_input": 8}, "per-layer embeddings"),
    ({"num_kv_shared_layers": 1}, "KV sharing"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"enable_moe_block": False}, "enable_moe_block"),
])
def test_what_the_moe_release_does_not_use_is_refused_by_name(change, words):
    with pytest.raises(CheckpointError, match=words):
        FAM.args({**FAM.tiny_config, **change})


def test_mlx_routing_mirror_and_regrouped_layer_are_mlx_lm_s():
    """mlx-lm's gemma4_text: the routing mirror (exporters.mlx.model.route) gives the experts its Router chooses and
    their weights before the per-expert scale (what the production router returns; the block applies the scale);
    and the regrouped decoder layer (models.gemma4.mlx_regroup) computes what mlx-lm's own does, exactly."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import numpy as np

    from exporters.mlx.load import load_model
    from exporters.mlx.model import moe_block, route
    from oracle.backend import CheckSpec
    from oracle.source.sources import model_source

    src = model_source(CheckSpec(family="gemma4", backend="mlx"))
    model, _ = load_model(src)
    x = mx.random.normal((1, 6, src.args.hidden_size), key=mx.random.key(0))
    for layer in model.layers:
        moe = moe_block(layer)
        assert type(moe).__name__ == "Gemma4MoEBlock" and moe.router is layer.router
        w, idx = route(moe, x)
        idx_mlx, w_mlx = layer.router(x)
        assert np.array_equal(np.array(idx), np.array(idx_mlx))
        np.testing.assert_allclose(np.array(w * layer.router.per_expert_scale[idx]), np.array(w_mlx), rtol=1e-6)
        regrouped = layer(x)[0]
        stock = type(layer).__mro__[1].__call__(layer, x)[0]  # mlx-lm's DecoderLayer.__call__
        assert np.array_equal(np.array(regrouped), np.array(stock))


def test_iree_gelu_tanh_is_not_torch_s():
    """The cause of gemma4's known divergence on iree-llvm-cpu (goldens/known_divergences.toml): IREE 3.13 llvm-cpu
    computes torch's gelu(approximate="tanh") up to 5e-5 away from torch's, while its tanh and silu agree to 5e-7."""
    pytest.importorskip("iree.turbine")
    import numpy as np
    import iree.runtime as rt
    import iree.turbine.aot as aot
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, x):
            return F.gelu(x, approximate="tanh"), torch.tanh(x), F.silu(x)

    x = torch.linspace(-6, 6, 4096).reshape(64, 64)
    out = aot.export(M(), args=(x,)).compile(save_to=None, target_backends=["llvm-cpu"])
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, out.map_memory()))
    got = [np.asarray(o.to_host()) for o in ctx.modules.module.main(x.numpy())]
    err = [float(np.abs(g - r.numpy()).max()) for g, r in zip(got, M()(x))]
    assert err[0] > 1e-5  # the GeGLU's gelu: measured 5.1e-5
    assert err[1] < 1e-6 and err[2] < 1e-6  # tanh 1.8e-7, silu 4.8e-7


def test_xnnpack_gelu_tanh_is_the_erf_gelu(tmp_path):
    """The cause of gemma4's known divergence on executorch (goldens/known_divergences.toml): ExecuTorch 1.5.1's
    XNNPACK delegate computes torch's gelu(approximate="tanh") as the exact (erf) gelu: 4.7e-4 from torch's tanh form
    on [-6, 6], 1e-6 from its erf form."""
    pytest.importorskip("executorch")
    import torch.nn.functional as F
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    class M(torch.nn.Module):
        def forward(self, x):
            return F.gelu(x, approximate="tanh")

    x = torch.linspace(-6, 6, 4001).reshape(1, -1)
    lowered = to_edge_transform_and_lower(torch.export.export(M(), (x,)), partitioner=[XnnpackPartitioner()])
    (tmp_path / "gelu.pte").write_bytes(lowered.to_executorch().buffer)
    got = Runtime.get().load_program(str(tmp_path / "gelu.pte")).load_method("forward").execute([x])[0]
    assert (got - F.gelu(x, approximate="tanh")).abs().max() > 1e-4  # measured 4.7e-4
    assert (got - F.gelu(x)).abs().max() < 1e-5  # measured 9.5e-7: the erf form
