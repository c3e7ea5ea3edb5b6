"""ExecuTorch backends: the CPU program checked against HF fp32 through the real runtime,
and the CUDA / Metal exporters tested as far as this host allows (the exported program before
lowering, the refusals).

Frugal: a .pte is cached by content hash (tests/conftest.py points the cache into the
checkout) and each family is lowered at most once per session: olmoe's check program with
XNNPACK (the backend as shipped); with portable kernels only (`partitioner=portable`, faster
to lower): mixtral's check program with a seeded fault and Qwen3.5's production program (the
state tests, and `oracle export`, which finds it in the cache). That every family
passes the full check with XNNPACK is measured by benchmarks/executorch_bench.py."""

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from exporters.executorch.backend import BACKEND
from exporters.executorch.candidate import ExecutorchCandidate
from exporters.executorch.export import op_histogram
from exporters.executorch.cuda import BACKEND as CUDA
from exporters.executorch.metal import BACKEND as METAL
from models.faults import catalogue as faults
from models.layers.transformer import reset_state
from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.source.sources import model_source
from oracle.reference.run import BlockCall

needs_executorch = pytest.mark.skipif(not BACKEND.availability()[0], reason=BACKEND.availability()[1])
PORTABLE = {"partitioner": "portable"}


def timed_check(spec, backend=None):
    t = time.perf_counter()
    r = run_check(spec, backend)
    return r, time.perf_counter() - t


@pytest.fixture(scope="session")
def olmoe_check():
    return timed_check(CheckSpec(family="olmoe", backend="executorch"))


@pytest.fixture(scope="session")
def qwen35_program():
    """Qwen3.5's production program (prefill + decode, portable kernels, S = 10) and eager."""
    spec = CheckSpec(family="qwen3_5_moe", backend="executorch", prompt_len=6, decode_tokens=4, options=PORTABLE)
    src = model_source(spec)
    art = BACKEND.artifact(src, spec, check=False)
    return ExecutorchCandidate(Path(art.path), {}), src.build_production(torch.float32)


def candidate(spec):
    src = model_source(spec)
    return BACKEND.load(src, spec), src.build_production(torch.float32)


# ------------------------------------------------------------------ CPU: the check
@needs_executorch
def test_olmoe_passes_with_block_rows_from_the_runtime(olmoe_check):
    r, _ = olmoe_check
    assert r.status == "pass", r.worst or r.error
    assert r.e2e.token_exact and len(r.e2e.steps) == 9  # prefill + 8 decode steps
    kinds = {b.kind for b in r.blocks}
    assert kinds == {"attention", "router", "moe", "layer", "final_norm", "logits"}
    assert all(b.status == "pass" and b.mode.startswith("in-situ") for b in r.blocks)
    backend = r.provenance["backend"]
    assert "XNNPACK" in backend["executor"]
    assert backend["block_modes"]["moe"].endswith("isolated (expert probes)")
    assert r.cache["artifacts"][0]["name"] == "olmoe.check.pte"
    # the goldens: tokens, and the ops of the lowered prefill and decode (stable names only)
    gates = {g.name: g.status for g in r.gates}
    assert gates["golden_tokens"] == "pass" and gates["structure:ops"] == "pass"
    ops = r.structures["ops"]
    assert "decode executorch_call_delegate" in ops and " at 0x" not in ops


@needs_executorch
def test_second_check_reuses_the_pte(olmoe_check):
    first, _ = olmoe_check
    again, _ = timed_check(CheckSpec(family="olmoe", backend="executorch"))
    assert again.status == "pass" and again.cache["all_cached"]
    assert again.cache["artifacts"][0]["path"] == first.cache["artifacts"][0]["path"]
    assert again.cache["artifacts"][0]["build_s"] == 0  # nothing lowered (speed: benchmarks/, not a timed test)


@needs_executorch
def test_prefill_and_decode_share_the_state(olmoe_check):
    """decode continues the KV cache written by prefill (another method of the program), and a
    prefill at position 0 starts a new sequence."""
    cand, eager = candidate(CheckSpec(family="olmoe", backend="executorch"))
    a, b = [3, 17, 99, 5, 200, 42, 7, 1], [9, 8, 250, 4, 4]
    with torch.no_grad():
        reset_state(eager)
        assert torch.allclose(cand.prefill(a), eager(torch.tensor([a]), torch.arange(8))[0], atol=1e-5)
        for pos, tok in enumerate([11, 12, 13], start=8):
            want = eager(torch.tensor([[tok]]), torch.tensor([pos]))[0, -1]
            assert torch.allclose(cand.decode(tok, pos), want, atol=1e-5)
        reset_state(eager)  # without the prefill's state, decode would be far off
        assert (eager(torch.tensor([[11]]), torch.tensor([8]))[0, -1] - want).abs().max() > 1e-2
        reset_state(eager)
        assert torch.allclose(cand.prefill(b), eager(torch.tensor([b]), torch.arange(5))[0], atol=1e-5)


@needs_executorch
def test_probe_methods_run_one_moe_block_on_given_inputs(olmoe_check):
    """The expert-coverage probes: the layer's MoE block alone, fed the caller's inputs, each input run alone (as the
    reference calls it: Doge's router mixes the rows of one call), one of them more rows than one call of the probe
    method takes (8 rows), each layer with its own weights (the probe methods share the weights file with prefill by
    name: layers never collide)."""
    cand, eager = candidate(CheckSpec(family="olmoe", backend="executorch"))
    x = torch.randn(11, 1, 1, 64, generator=torch.Generator().manual_seed(0))
    calls = [BlockCall(x[i].numpy(), np.array([0]), [], probe=True) for i in range(11)]
    whole = BlockCall(x.reshape(1, 11, 64).numpy(), np.arange(11), [], probe=True)
    for layer in range(len(eager.layers)):
        moe, router = cand.run_block(layer, "moe", calls), cand.run_block(layer, "router", calls)
        mlp = eager.layers[layer].mlp
        with torch.no_grad():
            assert torch.allclose(torch.cat(moe, dim=1), mlp(x.reshape(1, 11, 64)), atol=1e-5)
            assert torch.allclose(cand.run_block(layer, "moe", [whole])[0], mlp(x.reshape(1, 11, 64)), atol=1e-5)
            w, idx = mlp.gate(x.reshape(11, 64))
        assert torch.equal(torch.cat([i for _, i in router]), idx)
        assert torch.allclose(torch.cat([w for w, _ in router]), w, atol=1e-6)


@needs_executorch
def test_zaya_probe_methods_lower_with_the_router_run_once(tmp_path):
    """ZAYA's check program was refused by XNNPACK's partitioner ("Invalid partition, found dependency cycles", in its
    probe methods): the probe ran its router MLP twice, beside the block and inside it, and XNNPACK put both reads of
    its out_proj weight in one partition around the portable topk between them. The probe takes the router's outputs
    from its one call inside the block: lowered on XNNPACK, each layer's probe is the eager block and its router."""
    from exporters.executorch.export import export_probes, probe_rows
    from exporters.executorch.lower import lower_cpu
    from exporters.executorch.program import save

    src = model_source(CheckSpec(family="zaya", backend="executorch"))
    m, eager = src.build_production(torch.float32), src.build_production(torch.float32)
    save(lower_cpu(export_probes(m), m), tmp_path / "model.pte")
    cand = ExecutorchCandidate(tmp_path / "model.pte", {}, torch.float32, probe_rows(m.args))
    x = torch.randn(11, m.args.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer, block in enumerate(eager.layers):
        (moe, w, idx), = cand.probe(layer, [x])
        with torch.no_grad():
            want_w, want_idx = block.mlp.gate(x)
            assert torch.allclose(moe, block.mlp(x[None]), atol=1e-5)
        assert torch.equal(idx, want_idx) and torch.allclose(w, want_w, atol=1e-6)


@needs_executorch
def test_deepseek_v4_hash_layer_drill_reads_the_calls_token_ids():
    """The drill's points program of a hash-routed layer's MoE block (DeepSeek-V4's layer 0: experts by tid2eid of
    the call's token ids) is given the call's ids in its call_tokens state, as eager writes them (feed_tokens): every
    point is eager's (before, the state's zeros chose every token's experts from tid2eid[0]: the check's drill of
    that block failed at `experts`, max_abs 0.586, its shared experts passing)."""
    from exporters.torch.candidate import TorchCandidate

    import functools

    spec = CheckSpec(family="deepseek_v4", backend="executorch")
    src = model_source(spec)
    model = src.build_production(torch.float32)
    cand = object.__new__(ExecutorchCandidate)  # its drill alone: the points program, not the check's program
    cand.dtype, cand.points_program = torch.float32, functools.partial(BACKEND.points_program, src, spec)
    eager = TorchCandidate(model, torch.float32)
    x = torch.randn(1, 8, model.args.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = [BlockCall(x.numpy(), np.arange(8), [172, 47, 117, 192, 67, 251, 195, 103]),
             BlockCall(x[:, :1].numpy(), np.array([8]), [106])]
    got, want = cand.run_block_points(0, "moe", calls), eager.run_block_points(0, "moe", calls)
    assert "experts" in want and set(got) == set(want)
    for name in want:
        assert all(np.allclose(g, w, atol=1e-5) for g, w in zip(got[name], want[name], strict=True)), name


@needs_executorch
def test_probe_methods_lowered_before_are_taken_and_the_program_is_the_same(monkeypatch):
    """A process lowers each method once (exporters.executorch.lower.lowered_methods): with a fault in the last
    layer's experts, layer 0's probe method is the clean program's lowering, and the program (its .pte and
    its weights) is byte for byte the one lowered whole; a method lowered under one name is taken under
    another, and that program too is the one lowered whole. (The probes only: two small methods per program.
    The whole olmoe check program with expert_index_off_by_one, lowered after the clean one, was measured
    byte-identical to the lowering before lowered_methods existed.)"""
    import collections
    import copy

    import exporters.executorch.lower as ex
    from exporters.executorch.export import export_probes

    src = model_source(CheckSpec(family="olmoe", backend="executorch"))
    exported = {}

    def probes(fault=None):  # each model exported once; a lowering edits its programs: it gets a copy
        if fault not in exported:
            m = src.build_production(torch.float32)
            if fault:
                faults.get(fault).inject(m)
            exported[fault] = export_probes(m), m
        methods, m = exported[fault]
        return copy.deepcopy(methods), m

    def lowered(fault=None, only=None, order=None, named=None):  # `named`: method `only` under that name
        methods, m = probes(fault)
        chosen = {named or only: methods[only]} if only else {k: methods[k] for k in order or methods}
        prog = ex.lower_cpu(chosen, m)
        return prog.buffer, {k: bytes(v) for k, v in prog._tensor_data.items()}

    monkeypatch.setattr(ex, "LOWERED", collections.OrderedDict())
    clean = lowered(only="probe_0")
    assert len(ex.LOWERED) == 1 and lowered(only="probe_0") == clean  # all remembered: nothing lowered
    renamed = lowered(only="probe_0", named="other")
    assert len(ex.LOWERED) == 1 and renamed != clean  # taken under another name: nothing lowered
    # what the bound counts for the entry's graphs covers what a copy of them holds in Python objects
    # (tracemalloc: the tensors' storage is not Python's, and is the weights the bound counts apart)
    import tracemalloc

    (program, counted), = ex.LOWERED.values()
    tracemalloc.start()
    held = copy.deepcopy(program)
    python_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del held
    assert 0.3 * ex.lowered_bytes(program, 0) < python_bytes <= ex.lowered_bytes(program, 0) < counted
    mixed = lowered("expert_index_off_by_one")
    assert len(ex.LOWERED) == 2  # probe_1 lowered, probe_0 remembered
    # the new method first, and room for one method: remembering probe_1 evicts probe_0, which is taken before
    monkeypatch.setattr(ex, "LOWERED_BYTES", max(size for _, size in ex.LOWERED.values()))
    ex.LOWERED.popitem()  # probe_1
    first_new = lowered("expert_index_off_by_one", order=["probe_1", "probe_0"])
    assert len(ex.LOWERED) == 1
    monkeypatch.setattr(ex, "lowering_key", lambda ep, how: None)  # nothing remembered: lowered whole
    assert lowered(only="probe_0", named="other") == renamed
    assert lowered("expert_index_off_by_one") == mixed
    assert lowered("expert_index_off_by_one", order=["probe_1", "probe_0"]) == first_new


@needs_executorch
def test_qwen35_prefill_at_position_0_resets_the_gated_deltanet_state(qwen35_program):
    """The conv and recurrent state carry from prefill to decode, and a prefill at position 0
    zeroes them (the model's multiply when pos[0] == 0): after sequence a, sequence b matches
    a fresh eager run of b."""
    cand, eager = qwen35_program
    a, b = [5, 6, 7, 8, 9, 10], [200, 3, 77, 12]
    with torch.no_grad():
        reset_state(eager)
        assert torch.allclose(cand.prefill(a), eager(torch.tensor([a]), torch.arange(6))[0], atol=1e-4)
        want = eager(torch.tensor([[1]]), torch.tensor([6]))[0, -1]
        assert torch.allclose(cand.decode(1, 6), want, atol=1e-4)
        reset_state(eager)
        fresh = eager(torch.tensor([b]), torch.arange(4))[0]
        assert torch.allclose(cand.prefill(b), fresh, atol=1e-4)
        assert torch.allclose(cand.decode(2, 4), eager(torch.tensor([[2]]), torch.tensor([4]))[0, -1], atol=1e-4)
        reset_state(eager)  # the recurrent state matters: a decode without it is far off
        assert (eager(torch.tensor([[1]]), torch.tensor([6]))[0, -1] - want).abs().max() > 1e-2


@needs_executorch
def test_seeded_faults_survive_export_and_are_localised():
    """Two faults in the last layer, one lowering: the KV cache written one slot off (attention) and
    the expert outputs summed without the routing weights (moe). The second leaves no node computing
    the routing weights (nothing uses them), so the router row is the layer's probe method on the
    program's own input to the router (issue 33: the row was an exception, `null`, and the worst)."""
    both = [faults.get("kv_cache_write_off_by_one"), faults.get("expert_weights_not_applied")]
    # (the rows are what is tested, not the drill inside the worst: tests/test_drill.py; its points program is a lowering)
    spec = CheckSpec(family="mixtral", backend="executorch", options=PORTABLE, drill="off")
    r = run_check(spec, type(BACKEND)("executorch+2", lambda m: [f.inject(m) for f in both],
                                      "+".join(f.name for f in both)))
    assert r.status == "fail"
    layer = both[0].layer(model_source(spec).args)
    assert layer == both[1].layer(model_source(spec).args)
    rows = {(b.layer, b.kind): b for b in r.blocks}
    # in-situ rows fed their own inputs (Candidate.block_input: the norms' outputs, tapped): the
    # faulty attention fails first; the router after it is measured (not an exception): a correct
    # router on the program's own input, its weights what HF's router makes of that input (its
    # top-k, judged against the reference's, follows the attention's error)
    router = rows[layer, "router"].metrics
    assert "exception" not in router and rows[layer, "moe"].status == "fail"
    assert abs(router["weight_max_abs"] - router["upstream_weight_max_abs"]) < 1e-5 < router["weight_max_abs"]
    assert (r.worst["layer"], r.worst["kind"]) == (layer, "attention")
    assert all(b.status == "pass" for (lay, _), b in rows.items() if lay is not None and lay < layer)


def test_with_fault_needs_an_id_and_skips_other_precisions():
    with pytest.raises(ValueError, match="transform_id"):
        type(BACKEND)(transform=lambda m: None)
    assert BACKEND.with_fault(faults.get("logits_cast_to_float")) is None  # a bf16 fault


# ------------------------------------------------------------------ CPU: oracle export
@needs_executorch
def test_export_writes_the_production_program_and_a_manifest(cli, tmp_path, qwen35_program):
    """The same options as the qwen35_program fixture (S = 10, portable): served from the cache."""
    p = cli("export", "--family", "qwen3_5_moe", "--backend", "executorch", "--option", "partitioner=portable",
            "--max-seq-len", "10", "--prompt-len", "6", "--output-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    # the weights are outside the program, in model.ptd (shared by the methods)
    assert manifest["family"] == "qwen3_5_moe" and set(manifest["files"]) == {"model.pte", "model.ptd"}
    assert (tmp_path / "model.pte").stat().st_size < (tmp_path / "model.ptd").stat().st_size
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(tmp_path / "model.pte"), data_path=str(tmp_path / "model.ptd"))
    assert {"prefill", "decode"} <= program.method_names
    assert not any(n.startswith("probe_") for n in program.method_names)  # no check-only methods
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    assert len(prefill.execute([torch.tensor([[1, 2, 3]]), torch.arange(3)])) == 1  # logits only: no taps
    assert decode.execute([torch.tensor([[4]]), torch.tensor([3])])[0].shape == (1, 1, 256)


@needs_executorch
def test_export_refuses_an_unsupported_quantization(cli, tmp_path):
    p = cli("export", "--family", "olmoe", "--backend", "executorch", "--qlinear", "4w", "--output-dir", str(tmp_path))
    assert p.returncode == 2
    assert "backend executorch: --qlinear 4w: allowed values are 8da4w" in p.stderr


# ------------------------------------------------------------------ CUDA and Metal, without the device
def test_cuda_and_metal_are_unavailable_with_the_reason(cli):
    if torch.version.cuda is None:
        assert CUDA.availability() == (False, f"torch is a CPU build ({torch.__version__})")
    p = cli("backends")
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines()}
    assert lines["executorch-cuda"].split(None, 1)[1] == ("available" if CUDA.availability()[0]
                                                          else "unavailable: " + CUDA.availability()[1])
    assert lines["executorch-metal"].split(None, 1)[1] == ("available" if METAL.availability()[0]
                                                           else "unavailable: " + METAL.availability()[1])


@pytest.mark.parametrize("backend", ["executorch-cuda", "executorch-metal"])
def test_unavailable_device_backends_refuse(cli, tmp_path, backend):
    b = CUDA if backend == "executorch-cuda" else METAL
    ok, reason = b.availability()
    if ok:
        pytest.skip(f"{backend} is available here")
    p = cli("check", "--family", "olmoe", "--backend", backend, "--require")
    assert p.returncode == 3
    p = cli("export", "--family", "olmoe", "--backend", backend, "--tiny-test", "--qlinear", "4w",
            "--qlinear-group-size", "32", "--output-dir", str(tmp_path))
    assert p.returncode == 2 and reason in p.stderr
    assert "Traceback" not in p.stderr


def test_metal_refuses_sample():
    """The Metal export keeps the sampler on the host (the seed's Metal export): `sample` is not
    one of its options, refused before any work."""
    from oracle.backend import validate_options

    assert "sample" not in {o.name for o in METAL.option_schema}
    with pytest.raises(InputError, match="has no option 'sample'"):
        validate_options(METAL, {"sample": True}, "export")


# ------------------------------------------------------------------ the on-device sampler
SAMPLING = {"sampling": {"temperature": 0.8, "top_p": 0.9}}


@needs_executorch
def test_sampling_rows_pass_through_the_runtime():
    """`oracle check --sampling`: the fused sampler's methods and the head, run by the runtime
    (portable kernels: the sampler's int64 hash, sort and cumsum are portable ops either way)."""
    r = run_check(CheckSpec(family="olmoe", backend="executorch", options={**PORTABLE, **SAMPLING}))
    gates = {g.name: g for g in r.gates if g.name.startswith("sampling_")}
    assert len(gates) == 5 and all(g.status == "pass" for g in gates.values()), gates
    assert r.status == "pass", r.worst or r.error
    assert {"sample_prefill", "sample_decode", "sample_logits"} <= set(r.provenance["backend"]["methods"])


@needs_executorch
def test_export_sample_fuses_the_sampler(tmp_path):
    """`oracle export --sample`: prefill/decode take (tokens, pos, temperature, top_p, seed) and
    return the token the eager sampled model picks, and `use_sampling` tells the runner. Run in this
    process (oracle.cli.main): its prefill and decode are the check's `sample_prefill` and `sample_decode`
    of test_sampling_rows_pass_through_the_runtime, lowered before in it (lowered_methods), 19 s less."""
    from executorch.runtime import Runtime

    from models.layers.sampling import SampledModel
    from oracle.cli import main

    assert main(["export", "--family", "olmoe", "--backend", "executorch", "--sample", "--option",
                 "partitioner=portable", "--max-seq-len", "16", "--output-dir", str(tmp_path)]) == 0
    program = Runtime.get().load_program(str(tmp_path / "model.pte"), data_path=str(tmp_path / "model.ptd"))
    assert bool(program.load_method("use_sampling").execute([])[0])
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    eager = SampledModel(model_source(CheckSpec(family="olmoe", backend="executorch")).build_production(torch.float32))
    tokens = torch.tensor([[5, 17, 3, 99]])
    for seed, t in [(s, t) for s in range(4) for t in (0.0, 0.8)]:
        args = [torch.tensor(t), torch.tensor(0.9), torch.tensor(seed)]
        reset_state(eager.model)
        want = [int(eager(tokens, torch.arange(4), *args)[0]), int(eager(torch.tensor([[7]]), torch.tensor([4]), *args)[0])]
        got = prefill.execute([tokens, torch.arange(4), *args])[0]
        assert got.dtype == torch.int64 and got.shape == (1,)
        assert [int(got[0]), int(decode.execute([torch.tensor([[7]]), torch.tensor([4]), *args])[0][0])] == want


@needs_executorch
def test_cuda_sample_exports_the_fused_sampler():
    """What the CUDA exporter lowers with --sample: the seed's forward(tokens, input_pos,
    temperature, top_p, seed) -> token, strict, no data-dependent op, state in place."""
    spec = CheckSpec(family="olmoe", backend="executorch-cuda", precision="bf16", options={"sample": True})
    programs = CUDA.exported_programs(model_source(spec), spec)
    for name, ep in programs.items():
        inputs = [s for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        assert len(inputs) == 5, name
        out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
        user_out = out[len(ep.graph_signature.buffers_to_mutate):]
        assert len(user_out) == 1 and user_out[0].meta["val"].dtype == torch.int64
        h = op_histogram(ep)
        assert h["aten.argmax.default"] == 2  # the greedy and the Gumbel-max pick
        assert not {"aten.nonzero.default", "aten.item.default", "aten._local_scalar_dense.default"} & set(h)
        assert all(v.startswith("model.") for v in ep.graph_signature.buffers_to_mutate.values())


@needs_executorch
def test_cuda_exported_program_before_lowering():
    """What the CUDA exporter hands to the CudaPartitioner: strict export of the bf16
    Qwen3.5-MoE, state buffers updated in place, no data-dependent op, experts gathered."""
    spec = CheckSpec(family="qwen3_5_moe", backend="executorch-cuda", precision="bf16", decode_tokens=24)
    src = model_source(spec)
    programs = CUDA.exported_programs(src, spec)
    assert set(programs) == {"prefill", "decode"}
    a = src.args
    full = a.layer_types.count("full_attention")
    for name, ep in programs.items():
        h = op_histogram(ep)
        assert h["aten.index_put_.default"] == 2 * full  # k and v cache writes
        assert h["aten.index.Tensor"] == 2 * a.num_hidden_layers  # stacked expert gather (gate_up, down)
        assert h["aten.topk.default"] == a.num_hidden_layers
        linear = a.num_hidden_layers - full
        assert h["aten.embedding.default"] == 1 and h["aten.conv1d.default"] == linear
        assert h["aten.mul_.Tensor"] == 2 * linear  # the reset at position 0: conv and recurrent state
        assert not {"aten.nonzero.default", "aten.item.default", "aten._local_scalar_dense.default"} & set(h)
        weights = [p for p in ep.graph.nodes if p.op == "placeholder" and p.name.startswith("p_")]
        assert {p.meta["val"].dtype for p in weights} == {torch.bfloat16}
    T = next(iter(programs["prefill"].range_constraints.values()))
    assert (T.lower, T.upper) == (2, a.max_seq_len - 1)


@needs_executorch
def test_metal_exported_program_before_lowering():
    spec = CheckSpec(family="olmoe", backend="executorch-metal", precision="bf16")
    src = model_source(spec)
    programs = METAL.exported_programs(src, spec)
    h = op_histogram(programs["decode"])
    assert h["aten.index_put_.default"] == 2 * src.args.num_hidden_layers
    assert h["aten.linear.default"] == 4 * src.args.num_hidden_layers + 1 + src.args.num_hidden_layers


@needs_executorch
def test_a_partition_lowered_before_is_taken_from_the_cache_with_the_same_bytes(tmp_path, monkeypatch):
    """XNNPACK's preprocess of a partition is remembered by everything it reads (exporters/executorch/:
    remembered_partitions): the same module lowered again calls it for no partition and gives the same
    program; a changed weight or a changed op is a new partition, preprocessed (a fault's program takes
    the partitions it does not change from the clean program's)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.exir import to_edge_transform_and_lower

    from exporters.executorch.lower import PARTITIONS, remembered_partitions

    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    calls = []
    inner = XnnpackBackend.__dict__["preprocess"]

    def counted(ep, specs):
        calls.append(1)
        return inner.__func__(ep, specs)

    monkeypatch.setattr(XnnpackBackend, "preprocess", staticmethod(counted))

    class Two(torch.nn.Module):
        def __init__(self, scale=1.0, act=torch.relu):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.act = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), act
            with torch.no_grad():
                self.b.weight.mul_(scale)

        def forward(self, x):
            return self.b(self.act(self.a(x)))

    def lower(m):
        n = len(calls)
        ep = torch.export.export(m, (torch.ones(2, 8),))
        with remembered_partitions():
            prog = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        return prog.buffer, len(calls) - n

    first, n = lower(Two())
    assert n >= 1 and len(list((tmp_path / "artifacts" / PARTITIONS).iterdir())) == n
    again, n_again = lower(Two())
    assert n_again == 0 and again == first  # every partition from the cache, the program byte for byte
    assert lower(Two(scale=2.0))[1] >= 1  # another weight: preprocessed
    assert lower(Two(act=torch.sigmoid))[1] >= 1  # another op: preprocessed
