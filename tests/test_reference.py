"""The HF reference, whole or streamed: the same modules and weights give the same bytes."""

from pathlib import Path

import numpy as np
import pytest
import torch

from models import FAMILY_NAMES, get_family
from oracle.source.seeded import tiny_checkpoint
from oracle.reference.run import capture
from oracle.reference.streaming import load_hf_model
from tests.depth import IN_DEPTH


def _tensors(ref):
    out = [*ref.logits]
    for key in ref.outputs:
        for o in ref.outputs[key]:
            out += list(o) if isinstance(o, tuple) else [o]
        out += [c.x_array for c in ref.inputs[key]]
    return out


def _hf_whole_and_streamed(monkeypatch, **spec):
    """(the reference, the `hf` candidate in memory, the same streamed) of a tiny checkpoint's check; the
    layer another test read last forgotten (its reads are not this test's)."""
    from oracle.backend import CheckSpec, resolve
    from oracle.reference.streaming import forget_reads
    from oracle.reference.cached import reference_of
    from oracle.source.sources import model_source, prompt_tokens

    forget_reads()
    spec = CheckSpec(backend="hf", **spec)
    src = model_source(spec)
    ref = reference_of(spec, src, prompt_tokens(spec, src.args.vocab_size))
    monkeypatch.setenv("MOE_ORACLE_REFERENCE", "whole")
    whole = resolve("hf").load(src, spec)
    monkeypatch.setenv("MOE_ORACLE_REFERENCE", "streamed")
    return ref, whole, resolve("hf").load(src, spec)


# Real widths (item 1 of issue 54): OLMoE-1B-7B's published config cut to two decoder layers (hidden 2048,
# 64 experts of 1024, top 8; 2.0 GB at bf16, 4.2 GB whole at fp32), seeded, built once into the cache.
REAL = [pytest.param("olmoe", "olmoe-1b-7b-0924", id="olmoe-1b-7b-0924-L2")]
TINY = [(family, None) for family in FAMILY_NAMES]


def _checkpoint(fam, config):
    from oracle.source.seeded import config_checkpoint

    return tiny_checkpoint(fam, 0) if config is None else config_checkpoint(fam, config, 2, 0)


# the streamed reference of ERNIE-4.5-VL's text tower reads each decode step's sparse layer whole (its release stores
# 2E experts, the text ones then the vision ones, and HF's text model holds E: the per-expert read is not taken);
# the bytes are right, the economy is not (open)
STREAM_WHOLE_OPEN = {"ernie4_5_vl_moe": "decode steps read the layer whole: the release's vision experts"}


@pytest.mark.parametrize("family,config", [
    pytest.param(f, c, marks=pytest.mark.xfail(reason=STREAM_WHOLE_OPEN[f], strict=True)) if f in STREAM_WHOLE_OPEN
    else (f, c) for f, c in TINY] + REAL)
def test_streamed_reference_is_bitwise_the_whole_one(family, config, monkeypatch):
    """Decoder layers read from the checkpoint's shards for each forward by HF's own loading step
    (load_streamed; the expert probes read the router inside one) capture exactly what the in-memory
    model captures: tokens, logits, every block's inputs and outputs. A decode step (1 token, top 2 of 8)
    of a layer whose checkpoint stores its experts one by one converts only the experts it chose
    (LayerStream.read_experts), never the whole layer's with the others as zeros."""
    from oracle.reference.streaming import LayerStream

    calls = {"chosen": 0, "whole": 0}
    read_experts, read = LayerStream.read_experts, LayerStream.read

    def counted_experts(self, module, chosen):
        calls["chosen"] += 1
        return read_experts(self, module, chosen)

    def counted_read(self, names=None, absent=frozenset()):
        calls["whole"] += bool(absent)
        return read(self, names, absent)

    monkeypatch.setattr(LayerStream, "read_experts", counted_experts)
    monkeypatch.setattr(LayerStream, "read", counted_read)
    fam = get_family(family)
    d = _checkpoint(fam, config)
    prompt = [3, 17, 99, 5, 200, 42, 7, 1]
    whole = capture(load_hf_model(fam, d), fam, prompt, 4)
    model = load_hf_model(fam, d, streamed=True)
    streamed = capture(model, fam, prompt, 4)
    sparse = sum(bool(s.experts) for s in model._oracle_streams)  # layers stored per expert, routed by HF's module
    assert calls == {"chosen": 4 * sparse, "whole": 0}, calls  # 4 decode steps, each layer once
    assert streamed.tokens == whole.tokens and streamed.coverage == whole.coverage
    a, b = _tensors(whole), _tensors(streamed)
    assert len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


# A sharded bf16 checkpoint whose layers dominate it: 10 decoder layers of ~218 MB each in fp32
# (32 experts of 3 x 1024 x 512) and a small embedding and head (vocab 1024).
WIDE = dict(vocab_size=1024, hidden_size=1024, intermediate_size=512, num_hidden_layers=10,
            num_attention_heads=8, num_key_value_heads=8, num_experts=32, num_experts_per_tok=8,
            norm_topk_prob=False, max_position_embeddings=256, initializer_range=0.02,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
            model_type="olmoe")

CHILD = """
import json, sys
from pathlib import Path
from models import get_family
from oracle.reference.run import capture, first_nonfinite
from oracle.reference.streaming import load_hf_model, streamed_bytes
fam = get_family("olmoe")
model = load_hf_model(fam, Path(sys.argv[1]), streamed=True)
ref = capture(model, fam, [3, 17, 99, 5, 200, 42, 7, 1], 3)
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
routed = {layer: [sorted(set(i.reshape(-1).tolist())) for _, i in ref.outputs[layer, "router"][1:4]]
          for layer in ref.router_probs}  # the experts each decode step chose
print(json.dumps({"peak": peak, "tokens": ref.tokens, "bad": first_nonfinite(ref), "blocks": len(ref.inputs),
                  "read": streamed_bytes(model), "routed": routed}))
"""


def test_streamed_reference_memory_stays_under_the_bound(tmp_path):
    """The streamed reference's peak resident memory (VmHWM of a fresh process: imports, load,
    capture of prefill + 3 decode steps and every expert probe) stays under the issue's bound,
    two fp32 decoder layers + the fp32 embedding and head + 1 GiB, on a checkpoint whose
    whole-model fp32 weights alone are larger than that bound; no file is written beside the
    checkpoint (no offload copy); each decoder layer is read from it whole once (for the prefill and the
    expert probes inside it; at load HF's key and shape checks read only the header) and, for each of the 3
    decode steps, all but its experts and then the experts that step chose (1 token, top 8 of 32)."""
    import json
    import math
    import os
    import subprocess
    import sys

    from models.checkpoint import tensor_index
    from oracle.source.seeded import write_seeded_checkpoint

    fam = get_family("olmoe")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_seeded_checkpoint(fam, WIDE, 0, ckpt, torch.bfloat16, shard_bytes=400 << 20)
    index = tensor_index(ckpt)
    assert len({s for s, _, _ in index.values()}) > 1  # sharded, with an index
    assert {d for _, d, _ in index.values()} == {"BF16"}
    fp32 = {n: 4 * math.prod(shape) for n, (_, _, shape) in index.items()}
    layer = sum(v for n, v in fp32.items() if ".layers.0." in n)
    outside = sum(v for n, v in fp32.items() if ".layers." not in n)
    bound = 2 * layer + outside + (1 << 30)
    assert sum(fp32.values()) > bound  # the whole model in fp32 would not fit under it
    before = sorted(p for p in tmp_path.rglob("*"))
    out = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(tmp_path)], capture_output=True, text=True,
                         cwd=Path(__file__).parents[1], timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["bad"] is None and len(got["tokens"]) == 8 + 3 + 1 and got["blocks"] == 4 * 10 + 2
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written: no offload
    stored = {n: math.prod(shape) * 2 for n, (_, _, shape) in index.items()}  # bf16
    layers = sum(v for n, v in stored.items() if ".layers." in n)
    rest = sum(v for n, v in stored.items() if ".layers.0." in n and ".experts." not in n)  # one layer's
    one_expert = sum(v for n, v in stored.items() if ".layers.0.mlp.experts.0." in n)
    decode = sum(rest + one_expert * len(step) for steps in got["routed"].values() for step in steps)
    assert 0 < decode < layers  # three decode steps read less than one whole pass
    assert got["read"] == layers + decode
    assert got["peak"] < bound, f"peak {got['peak'] / 2**30:.2f} GiB over the bound {bound / 2**30:.2f} GiB"
    print(f"streamed reference peak {got['peak'] / 2**30:.2f} GiB, bound {bound / 2**30:.2f} GiB, "
          f"whole fp32 weights {sum(fp32.values()) / 2**30:.2f} GiB")


@pytest.mark.parametrize("family,precision", [("qwen3_5_moe", "fp32"), ("qwen3_5_moe", "bf16"), ("deepseek_v3", "bf16")])
def test_streamed_hf_candidate_matches_the_whole_one(family, precision, monkeypatch):
    """The `hf` candidate streamed (as it is above 1 GiB) measures exactly what the whole one
    does: same rows, same numbers, same tokens (qwen3_5_moe: the composite-free hybrid family; deepseek_v3:
    a correction bias HF keeps in fp32), its block rows and e2e steps computed ahead layer by layer in turn
    with the noise (the report says so), the other way call by call."""
    from oracle.backend import CheckSpec
    from oracle.check import run_check

    def run(mode):
        monkeypatch.setenv("MOE_ORACLE_REFERENCE", mode)
        r = run_check(CheckSpec(family=family, backend="hf", precision=precision, decode_tokens=3))
        assert r.status == "pass", r.error
        assert ("schedule" in r.provenance["backend"]) == (mode == "streamed")
        return ([(b.layer, b.kind, b.status, b.metrics) for b in r.blocks], r.e2e.candidate_tokens,
                r.e2e.steps, r.e2e.routing)

    assert run("streamed") == run("whole")


def test_saved_reference_reads_back_as_the_same_numpy_arrays(tmp_path):
    """The on-disk reference cache (what a warm check reads, without torch): every array back with
    its dtype and bytes, the block calls' inputs as numpy and, for torch candidates, as tensors."""
    from oracle.reference.saved import load, save

    fam = get_family("qwen3_5_moe")
    ref = capture(load_hf_model(fam, tiny_checkpoint(fam, 0)), fam, [3, 17, 99, 5], 2)
    save(ref, tmp_path / "ref")
    back = load(tmp_path / "ref")
    assert back.tokens == ref.tokens and back.coverage == ref.coverage and back.block_keys() == ref.block_keys()
    a, b = _tensors(ref), _tensors(back)
    assert len(a) == len(b) and all(isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
                                    for x, y in zip(a, b))
    call = back.inputs[0, "attention"][0]
    assert call.x.dtype == torch.float32 and np.array_equal(call.x.numpy(), call.x_array)
    assert call.pos.tolist() == list(range(4))


@pytest.mark.parametrize("family", IN_DEPTH)  # the other families: tests/depth.py
def test_streamed_block_replay_reads_one_layer_once_and_gives_the_same_bytes(family, monkeypatch):
    """The `hf` candidate's block rows on a streamed model (exporters/torch/hf.py `_only_layer`): the block's
    own decoder layer loaded once for all its calls, every other layer skipped (its cache grown by
    placeholders), exactly the outputs and routes of the whole model's replay; the bytes read for a
    layer's blocks are that layer's once (the decode calls inside the same load, the layer's other blocks
    while it is held), not the model's per call."""
    from oracle.reference.streaming import release_held, streamed_bytes, tensor_bytes

    ref, whole, streamed = _hf_whole_and_streamed(monkeypatch, family=family)
    assert streamed.streamed and not whole.streamed
    layer_bytes, seen = {s.layer: None for s in streamed.model._oracle_streams}, set()
    for key in ref.block_keys():
        before = streamed_bytes(streamed.model)
        a, b = whole.run_block(*key, ref.inputs[key]), streamed.run_block(*key, ref.inputs[key])
        read = streamed_bytes(streamed.model) - before
        assert len(a) == len(b)
        for x, y in zip(a, b):
            for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
                assert torch.equal(u, v), key
        if key[1] in ("moe", "layer"):  # the block's own choice (what its row reads: compare.block_selection)
            own = [[np.asarray(t).tolist() for t in r[key[0]]] for r in whole.block_routes() if key[0] in r]
            assert own == [[np.asarray(t).tolist() for t in r[key[0]]] for r in streamed.block_routes() if key[0] in r]
        if key[0] is None:
            assert read == 0, key  # the final norm and the head: resident, no layer read
        else:
            stream = streamed.model._oracle_streams[key[0]]
            if key[0] in seen:  # kept loaded since the layer's first block (oracle.reference.streaming.hold)
                assert read == 0, key
            else:
                seen.add(key[0])
                assert read == sum(tensor_bytes(stream.index[n]) for n in stream.names), key  # the layer, once
    release_held()


# tiny widths only: the real width's layer-by-layer economy is test_streamed_reference_is_bitwise_the_whole_one's
# and the memory bound's (its own L2 case here cost 25 s of a cold suite on 2 cores: issue 76's budget)
@pytest.mark.parametrize("family,config", [(f, c) for f, c in TINY if f in IN_DEPTH])
def test_streamed_steps_layer_by_layer_are_bitwise_the_steps_one_by_one(family, config, monkeypatch):
    """A streamed `hf` candidate's e2e steps run layer by layer (HFCandidate.teacher_forced: each layer
    loaded once and run over the prefill and every decode step with its own cache, its outputs the next
    layer's inputs) give exactly the logits and the routes of the whole model's prefill and decode calls
    one by one, at bf16 (HF keeps some tensors in fp32 there, and a tied head must follow its embedding's
    cast), and read each decoder layer's bytes once in all."""
    from oracle.reference.streaming import streamed_bytes, tensor_bytes

    real = {} if config is None else {"config": config, "layers": 2}
    ref, whole, streamed = _hf_whole_and_streamed(monkeypatch, family=family, precision="bf16", decode_tokens=4,
                                                  **real)
    P, n = ref.prompt_len, len(ref.logits)
    assert whole.teacher_forced(ref.tokens, P, n) is None  # in memory: call by call
    steps = [whole.prefill(ref.tokens[:P])]
    routes = [whole.last_routes()]
    for k in range(1, n):
        steps.append(whole.decode(ref.tokens[P + k - 1], P + k - 1))
        routes.append(whole.last_routes())
    before = streamed_bytes(streamed.model)
    got, got_routes = streamed.teacher_forced(ref.tokens, P, n)
    assert len(got) == n and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(steps, got))
    assert [sorted(r) for r in routes] == [sorted(r) for r in got_routes]
    assert all(np.array_equal(a[layer][i], b[layer][i]) for a, b in zip(routes, got_routes) for layer in a for i in (0, 1))
    layers = sum(tensor_bytes(s.index[n]) for s in streamed.model._oracle_streams for n in s.names)
    assert streamed_bytes(streamed.model) - before == layers  # each decoder layer's tensors, once


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_streamed_model_holds_every_tensor_as_the_whole_one_does(family):
    """At bf16, every parameter and buffer of the streamed model (its layers loaded) has the whole model's
    dtype and value: HF keeps some in fp32 (DeepSeek-V3's e_score_correction_bias, a buffer, by the class's
    keep-in-fp32 names; ERNIE's gate), and a tied head is its embedding."""
    from oracle.reference.streaming import decoder_of, materialized

    fam = get_family(family)
    d = tiny_checkpoint(fam, 0)
    whole, streamed = load_hf_model(fam, d, torch.bfloat16), load_hf_model(fam, d, torch.bfloat16, streamed=True)
    with materialized(decoder_of(streamed)):
        theirs = dict([*streamed.named_parameters(), *streamed.named_buffers()])
        mine = dict([*whole.named_parameters(), *whole.named_buffers()])
        assert sorted(theirs) == sorted(mine)
        for name, t in mine.items():
            assert theirs[name].dtype == t.dtype and torch.equal(theirs[name], t), name
    assert (streamed.get_output_embeddings().weight is streamed.get_input_embeddings().weight) == \
        (whole.get_output_embeddings().weight is whole.get_input_embeddings().weight)
