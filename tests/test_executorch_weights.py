"""executorch: another checkpoint's weights in a program already lowered (exporters/executorch/rebind.py).

Frugal: one program is lowered, olmoe's XNNPACK check program of seed 0 (cached: the one
tests/test_executorch.py checks); rebinding takes a second. That a rebound program is byte for byte the
lowered one is measured by benchmarks/executorch_rebind.py (two lowerings a program: docs/benchmarks.md);
here the rebound program's numbers are the new weights' (against eager), and the backend's own path runs
in a private cache where the first program's "lowering" is a copy of seed 0's lowered program. A weight the
delegate lays out in another axis order: a one-convolution program, lowered twice (seconds)."""

import filecmp
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import exporters.executorch.backend as ex
from exporters.executorch.candidate import ExecutorchCandidate
from exporters.executorch.lower import lower_cpu
from exporters.executorch.program import OPS_FILE, save
from exporters.executorch import rebind as ew
from models.faults import catalogue as faults
from models.layers.transformer import reset_state
from oracle.backend import CheckSpec
from oracle.source.sources import model_source

needs_executorch = pytest.mark.skipif(not ex.BACKEND.availability()[0], reason=ex.BACKEND.availability()[1])
FILES = ("model.pte", "model.ptd", "taps.json", OPS_FILE)


def lowered(seed: int) -> Path:
    """olmoe's check program for `seed`, lowered by the backend (from the shared cache)."""
    spec = CheckSpec(family="olmoe", backend="executorch", seed=seed)
    backend = ex.ExecutorchBackend()
    backend.rebinds_weights = False
    art = backend.artifact(model_source(spec), spec, True)
    assert not Path(art.path).with_name("rebound.json").exists()
    return Path(art.path)


def production(seed: int, fault: str | None = None):
    src = model_source(CheckSpec(family="olmoe", backend="executorch", seed=seed))
    m = src.build_production(torch.float32)
    if fault:
        faults.get(fault).inject(m)
    return m


def same_files(a: Path, b: Path) -> bool:
    return all(filecmp.cmp(a.with_name(n), b.with_name(n), shallow=False) for n in FILES)


@pytest.fixture(scope="module")
def program():
    return lowered(0)


def bound_of(pte: Path, m) -> dict:
    bound, why = ew.binding(pte.with_name("model.ptd"), ew.tensor_hashes(m), set(ew.model_tensors(m)))
    assert bound is not None, why
    return bound


def logits(pte: Path, eager, tokens) -> tuple[float, float]:
    """max |program - eager| over prefill's logits and two decode steps."""
    cand = ExecutorchCandidate(pte, {})
    with torch.no_grad():
        reset_state(eager)
        worst = float((cand.prefill(tokens) - eager(torch.tensor([tokens]), torch.arange(len(tokens)))[0]).abs().max())
        for pos, tok in enumerate([11, 12], start=len(tokens)):
            want = eager(torch.tensor([[tok]]), torch.tensor([pos]))[0, -1]
            worst = max(worst, float((cand.decode(tok, pos) - want).abs().max()))
    return worst


@needs_executorch
def test_rebound_program_computes_with_the_new_weights(program, tmp_path):
    """Seed 0's program with seed 1's weights computes seed 1's model (as the lowered program computes
    seed 0's, to 1e-5); seed 0's program does not (the weights are the difference); the delegate's
    entries are keyed by the new bytes' sha256 in both files."""
    bound = bound_of(program, production(0))
    assert bound["content"] and bound["named"]  # XNNPACK's weights by content and the portable ops' by name
    dest = tmp_path / "model.pte"
    m1 = production(1)
    assert ew.rebind(program, bound, m1, dest, ("taps.json", OPS_FILE)) is None
    tokens = [3, 17, 99, 5, 200, 42, 7, 1]
    assert logits(dest, m1, tokens) < 1e-5
    assert logits(program, production(0), tokens) < 1e-5
    assert logits(program, m1, tokens) > 1e-2
    t1 = ew.model_tensors(m1)
    keys = {hashlib.sha256(ew.tensor_bytes(t1[names[0]])).hexdigest() for names in bound["content"].values()}
    stored = ptd(dest).pop("__content__")
    assert set(stored) == keys
    pte = dest.read_bytes()
    assert all(k.encode() in pte for k in keys) and not any(k.encode() in pte for k in bound["content"])
    for n in ("taps.json", OPS_FILE):
        assert filecmp.cmp(dest.with_name(n), program.with_name(n), shallow=False)


@needs_executorch
def test_rebind_refuses_where_shared_bytes_differ(program, tmp_path):
    """Two tensors with one content entry where the program was lowered (a weight it reads twice) cannot
    take weights where they differ: refused, nothing written."""
    p0, m0 = program, production(0)
    bound = bound_of(p0, m0)
    key, names = next(iter(bound["content"].items()))
    other = next(n for n, t in ew.model_tensors(m0).items() if n not in names and t.dtype == torch.float32
                 and t.shape == ew.model_tensors(m0)[names[0]].shape)
    shared = {**bound, "content": {**bound["content"], key: [*names, other]}}
    dest = tmp_path / "model.pte"
    why = ew.rebind(p0, shared, production(1), dest, ())
    assert why and other in why
    assert not list(tmp_path.iterdir())


@needs_executorch
def test_backend_lowers_once_per_identity(program, tmp_path, monkeypatch):
    """In a fresh cache: the first program of an identity is lowered (here: seed 0's lowered program copied
    in its place) and recorded; seed 1's and a weight-only fault's are rebound from it (no lowering), and
    compute with their weights; a fault that changes the computation is lowered."""
    p0 = program
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_lowering(m, lower, path, check, opts, dense_prefill=False):
        calls.append(path)
        if len(calls) > 1:
            raise RuntimeError("lowered again")
        for n in FILES:
            shutil.copyfile(p0.with_name(n), path.with_name(n))

    monkeypatch.setattr(ex, "build_program", fake_lowering)

    def built(seed, fault=None):
        spec = CheckSpec(family="olmoe", backend="executorch", seed=seed)
        backend = ex.BACKEND.with_fault(faults.get(fault)) if fault else ex.ExecutorchBackend()
        return Path(backend.artifact(model_source(spec), spec, True).path)

    first = built(0)
    assert len(calls) == 1 and same_files(first, p0)
    rebound = built(1)
    assert len(calls) == 1 and not rebound.with_name("model.ptd").samefile(p0.with_name("model.ptd"))
    assert logits(rebound, production(1), [3, 17, 99, 5, 200, 42, 7, 1]) < 1e-5
    assert json.loads(rebound.with_name("rebound.json").read_text())["lowered_for"] == first.parent.name

    off = built(0, "expert_weights_off_1e-3")  # weights alone: seed 0's program with the fault's weights
    assert len(calls) == 1
    m0 = production(0)
    t0, tf = ew.model_tensors(m0), ew.model_tensors(production(0, "expert_weights_off_1e-3"))
    faulted = {k for k in t0 if not torch.equal(t0[k], tf[k])}
    assert faulted
    stored, clean = ptd(off), ptd(p0)
    by_content = stored.pop("__content__")
    clean.pop("__content__")
    assert stored.keys() == clean.keys()
    changed = {k for k, (_, _, read) in stored.items() if read and not np.array_equal(read(), clean[k][2]())}
    assert changed == faulted & stored.keys()
    for k, (_, _, read) in stored.items():
        if read:
            assert np.array_equal(read(), tf[k].detach().numpy())
    assert set(by_content) == {hashlib.sha256(ew.tensor_bytes(tf[names[0]])).hexdigest()
                               for names in bound_of(p0, m0)["content"].values()}
    for key, (_, read) in by_content.items():
        assert hashlib.sha256(read()).hexdigest() == key

    with pytest.raises(RuntimeError, match="lowered again"):  # the computation changed: its own lowering
        built(0, "rope_theta_wrong")


def ptd(pte: Path) -> dict:
    from exporters.shared.weights import ptd_tensors

    return ptd_tensors(pte.with_name("model.ptd"))


# ------------------------------------------------------------------ executorch-mlx: the weights in the .pte
MLX_SAMPLING = {"sampling": {"temperature": 0.8, "top_p": 0.9}}  # tests/test_executorch_mlx.py's olmoe program


@pytest.fixture(scope="module")
def mlx_program():
    from exporters.executorch.mlx.backend import BACKEND as MLX

    if not MLX.availability()[0]:
        pytest.skip(MLX.availability()[1])
    spec = CheckSpec(family="olmoe", backend="executorch-mlx", options=MLX_SAMPLING)
    return Path(MLX.artifact(model_source(spec), spec, True, False).path)


def test_mlx_program_with_another_seeds_weights_passes_its_check(mlx_program, tmp_path, monkeypatch):
    """In a fresh cache whose first "lowering" is olmoe seed 0's lowered MLX program: seed 1's check program
    is rebound from it (no second lowering: the delegate's weights rewritten in the .pte's named data) and
    passes seed 1's check against HF; the same program with seed 0's weights left in fails it."""
    import exporters.executorch.mlx.export as export
    from exporters.executorch.mlx.backend import ExecutorchMlxBackend
    from oracle.check import run_check

    lowerings = []

    def fake_lower(methods, constant_methods=None):
        lowerings.append(1)
        return type("Prog", (), {"buffer": mlx_program.read_bytes(), "_tensor_data": {}})()

    monkeypatch.setattr(export, "export_methods", lambda *a, **k: {})
    monkeypatch.setattr(export, "lower", fake_lower)
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "rebound"))
    # (no drill: a failing check's points programs would be lowered too)
    spec = lambda seed: CheckSpec(family="olmoe", backend="executorch-mlx", seed=seed, options=MLX_SAMPLING,  # noqa: E731
                                  drill="off")
    assert run_check(spec(0)).status == "pass" and len(lowerings) == 1
    r = run_check(spec(1))
    assert len(lowerings) == 1 and r.status == "pass", (r.status, r.worst, r.error)

    stale = ExecutorchMlxBackend()
    stale.rebinds_weights = False  # seed 1's program "lowered": seed 0's, its weights left in
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "stale"))
    r = run_check(spec(1), stale)
    assert len(lowerings) == 2 and r.status == "fail"


class DepthwiseConv(torch.nn.Module):
    """The Gated DeltaNet's causal conv1d (a depthwise convolution): XNNPACK keeps its [C, 1, K] filter as
    [1, K, C], bytes that are no tensor of the model in its own axis order."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv1d(8, 8, 4, groups=8, bias=False)

    def forward(self, x):  # [1, 8, T] -> [1, 8, T - 3]
        return self.conv(x)


def lowered_conv(m: torch.nn.Module, path: Path) -> Path:
    """`m` (x [1, 8, 16] -> ...) lowered by the backend's lowering (XNNPACK) at `path`."""
    from types import SimpleNamespace

    ep = torch.export.export(m, (torch.zeros(1, 8, 16),), strict=True)
    args = SimpleNamespace(max_seq_len=16, vocab_size=1, num_hidden_layers=1)  # the program's constant methods
    save(lower_cpu({"forward": ep}, SimpleNamespace(args=args)), path)
    return path


@needs_executorch
def test_a_weight_the_delegate_laid_out_in_another_axis_order_is_rebound(tmp_path):
    """The Qwen3.5 and Qwen3-Next programs could not take another checkpoint's weights on XNNPACK ("the
    delegate's weight f000e604... is no tensor of the model", 2026-11-28): the depthwise filter is the conv
    weight's axes reordered. binding() finds which tensor and which order; the program rebound with another
    model's weights is byte for byte the one lowered for them."""
    m0, m1 = DepthwiseConv(0), DepthwiseConv(1)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    p0 = lowered_conv(m0, tmp_path / "a" / "model.pte")
    tensors = ew.model_tensors(m0)
    names = set(tensors)
    assert ew.binding(p0.with_name("model.ptd"), ew.tensor_hashes(m0), names)[0] is None  # before: not bound
    bound, why = ew.binding(p0.with_name("model.ptd"), ew.tensor_hashes(m0), names, tensors=tensors)
    assert bound is not None, why
    (key, held), = bound["permuted"].items()
    assert held["kind"] == "content" and [n for n, _ in held["tensors"]] == ["conv.weight"]
    order = held["tensors"][0][1]
    assert torch.equal(m0.conv.weight.detach().permute(order).reshape(1, 4, 8), m0.conv.weight.detach()[:, 0].T[None])
    rebound_is_the_lowered(p0, bound, m1, tmp_path)


def rebound_is_the_lowered(p0, bound, m1, tmp_path):
    """p0 (lowered for another model) rebound to m1's weights in tmp_path/c is byte for byte the program lowered for m1
    (tmp_path/b) and computes m1 on a seeded input [1, 8, 16], which it returns."""
    from executorch.runtime import Runtime

    dest = tmp_path / "c" / "model.pte"
    assert ew.rebind(p0, bound, m1, dest, ()) is None
    p1 = lowered_conv(m1, tmp_path / "b" / "model.pte")
    assert all(filecmp.cmp(p1.with_name(n), dest.with_name(n), shallow=False) for n in ("model.pte", "model.ptd"))
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0))
    prog = Runtime.get().load_program(str(dest), data_path=str(dest.with_name("model.ptd")))
    with torch.no_grad():
        assert torch.allclose(prog.load_method("forward").execute([x])[0], m1(x), atol=1e-5)
    return x


class TwoLinears(torch.nn.Module):
    """Two weights of one shape, each its own XNNPACK entry keyed by the sha256 of its bytes."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):  # [1, 8, 16] -> [1, 8, 16]
        return self.b(torch.relu(self.a(x)))


@needs_executorch
def test_rebind_where_a_new_weight_is_another_entrys_old_one(tmp_path):
    """DeepSeek-V4's check program rebound from the one lowered for its tiny checkpoint before 580bffb failed
    (logits 3.33 off): the new draw had old tensors' bytes in other places, and the delegate's keys renamed one
    after another (a -> b's old key, then that key -> ...) left two entries under one key. Here the two weights
    swapped: the rebound program is byte for byte the one lowered for the swapped model, and computes it."""
    m0, m1 = TwoLinears(0), TwoLinears(0)
    with torch.no_grad():
        m1.a.weight.copy_(m0.b.weight), m1.b.weight.copy_(m0.a.weight)
    for d in "abc":
        (tmp_path / d).mkdir()
    p0 = lowered_conv(m0, tmp_path / "a" / "model.pte")
    bound, why = ew.binding(p0.with_name("model.ptd"), ew.tensor_hashes(m0), set(ew.model_tensors(m0)))
    assert bound is not None, why
    assert sorted(n for names in bound["content"].values() for n in names) == ["a.weight", "b.weight"]
    x = rebound_is_the_lowered(p0, bound, m1, tmp_path)
    with torch.no_grad():
        assert (m1(x) - m0(x)).abs().max() > 1e-2  # the weights are the difference
