"""Full depth by schedule (oracle/schedule.py): a streamed checkpoint's candidates run layer by layer, in
turn with HF's noise measurement, with the same numbers as call by call and each layer read once."""

import numpy as np
import pytest
import torch

from tests.depth import IN_DEPTH
from oracle.backend import CheckSpec, InputError, resolve
from oracle.schedule import lockstep


def test_lockstep_runs_each_pass_one_step_at_a_time_in_turn():
    order = []

    def g(name, n):
        for i in range(n):
            order.append((name, i))
            yield
        return name.upper()

    assert lockstep([g("a", 2), g("b", 3)]) == ["A", "B"]
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2)]
    assert lockstep([]) == []


def _load(family, precision, mode, monkeypatch, backend="eager"):
    from oracle.reference.cached import reference_of
    from oracle.source.sources import model_source, prompt_tokens

    spec = CheckSpec(family=family, backend=backend, precision=precision, decode_tokens=4)
    src = model_source(spec)
    ref = reference_of(spec, src, prompt_tokens(spec, src.args.vocab_size))
    monkeypatch.setenv("MOE_ORACLE_REFERENCE", mode)
    return ref, resolve(backend).load(src, spec)


@pytest.mark.parametrize("family", IN_DEPTH)  # the other families: tests/depth.py
def test_the_streamed_production_model_computes_ahead_exactly_what_the_whole_one_does(family, monkeypatch):
    """The production model streamed from the checkpoint (exporters/torch/ build_streamed: each layer's weights
    read, sanitized and converted by the family's rules when in use), its block rows and e2e steps computed
    ahead layer by layer (Candidate.ahead): every block output, the routes of every block and step, and the
    logits of the prefill and each decode step are bitwise the whole model's, call by call; each decoder
    layer read once for all of them; asked again (the drill), a block runs again with the same bytes."""
    from models.checkpoint import LAYER, tensor_index
    from oracle.reference.streaming import forget_reads, streamed_bytes, tensor_bytes

    forget_reads()
    ref, whole = _load(family, "bf16", "whole", monkeypatch)
    _, streamed = _load(family, "bf16", "streamed", monkeypatch)
    assert type(streamed).__name__ == "StreamedTorchCandidate" and whole.ahead(ref) is None
    lockstep([streamed.ahead(ref)])
    layers = sum(tensor_bytes(e) for n, e in tensor_index(streamed.model._oracle_streams[0].index[
        streamed.model._oracle_streams[0].names[0]][0].parent).items() if LAYER.search(n))
    assert streamed_bytes(streamed.model) == layers
    for key in ref.block_keys():
        a = whole.run_block(*key, ref.inputs[key])
        ra = whole.block_routes()
        b = streamed.run_block(*key, ref.inputs[key])
        assert [(k, np.asarray(r[k][0]).tolist()) for r in ra for k in r] == \
            [(k, np.asarray(r[k][0]).tolist()) for r in streamed.block_routes() for k in r], key
        for x, y in zip(a, b):
            for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
                assert u.dtype == v.dtype and torch.equal(u, v), key
        again = streamed.run_block(*key, ref.inputs[key])  # not kept twice: run again
        assert all(torch.equal(torch.as_tensor(x if not isinstance(x, tuple) else x[0]),
                               torch.as_tensor(y if not isinstance(y, tuple) else y[0])) for x, y in zip(b, again))
    P, n = ref.prompt_len, len(ref.logits)
    steps, routes = [whole.prefill(ref.tokens[:P])], [whole.last_routes()]
    for k in range(1, n):
        steps.append(whole.decode(ref.tokens[P + k - 1], P + k - 1))
        routes.append(whole.last_routes())
    got, got_routes = streamed.teacher_forced(ref.tokens, P, n)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(steps, got)) and len(got) == n
    assert [sorted(r) for r in routes] == [sorted(r) for r in got_routes]
    assert all(np.array_equal(a[layer][i], b[layer][i]) for a, b in zip(routes, got_routes) for layer in a for i in (0, 1))
    again, _ = streamed.teacher_forced(ref.tokens, P, n)  # not kept twice: layer by layer again, the same bytes
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("backend,family,precision", [("eager", "qwen3_5_moe", "bf16"), ("eager", "deepseek_v3", "bf16"),
                                                      ("eager", "olmoe", "fp32"), ("hf", "phimoe", "bf16")])
def test_a_streamed_check_reports_what_the_whole_one_does_and_its_schedule(backend, family, precision, monkeypatch):
    """A check whose candidate streams its checkpoint (run layer by layer with the noise) reports the same
    rows, steps, routing and tokens as with the model in memory, and says which schedule ran. Streamed, the
    noise and the routing replays share one HF model per precision and attention (what each keeps resident
    is its embedding and head: one per use was 8 of them at bf16), forgotten at the check's end."""
    from oracle.verdict import noise as N
    from oracle.check import run_check
    from oracle.reports.markdown import markdown

    def run(mode):
        monkeypatch.setenv("MOE_ORACLE_REFERENCE", mode)
        models, hf_at = {}, N.hf_at

        def counted(src, spec, attention="eager"):
            hf = hf_at(src, spec, attention)
            models.setdefault((spec.precision, attention), set()).add(id(hf))
            return hf

        monkeypatch.setattr(N, "hf_at", counted)
        r = run_check(CheckSpec(family=family, backend=backend, precision=precision, decode_tokens=3))
        assert r.status == "pass", r.error
        assert not N.SHARED
        if mode == "streamed":  # (the whole run finds the measurements in memory)
            assert models and all(len(ids) == 1 for ids in models.values()), models
        assert r.provenance["backend"].get("schedule", "").startswith("layer by layer") == (mode == "streamed")
        assert ("Schedule: layer by layer" in markdown(r.to_dict())) == (mode == "streamed")  # the PR comment says it
        return [(b.layer, b.kind, b.status, b.metrics) for b in r.blocks], r.e2e.candidate_tokens, r.e2e.steps, r.e2e.routing

    assert run("streamed") == run("whole")


def test_a_seeded_fault_or_the_gpu_on_a_streamed_production_model_is_refused(monkeypatch):
    """A fault edits the production model in memory, and the GPU control moves it there: neither can run on a
    streamed one (bad input, said why), rather than a crash on meta tensors."""
    from models.faults.catalogue import CATALOGUE
    from oracle.source.sources import model_source

    spec = CheckSpec(family="olmoe", backend="eager", precision="bf16")
    src = model_source(spec)
    monkeypatch.setenv("MOE_ORACLE_REFERENCE", "streamed")
    with pytest.raises(InputError, match="seeded fault needs the production model in memory"):
        resolve("eager").with_fault(CATALOGUE[0]).load(src, spec)
    with pytest.raises(InputError, match="streamed from disk"):
        resolve("eager").load(src, CheckSpec(family="olmoe", backend="eager", precision="bf16", options={"device": "cuda"}))


def test_the_e2e_routing_replay_run_ahead_is_the_one_run_after(monkeypatch, tmp_path):
    """The e2e routing replay run in the candidate's layer-by-layer pass (oracle/verdict/e2e.py ReplayAhead: each
    layer's plan from the candidate's selection once it ran that layer) keeps, under the key run_e2e's
    replay asks, exactly what HF run afterwards with the whole plan measures (fp32, and bf16 with each
    attention); each layer read once for the candidate and the three runs."""
    from oracle.verdict import noise as N
    from oracle.verdict.e2e import ReplayAhead
    from oracle.reference.streaming import READ

    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    ref, cand = _load("qwen3_5_moe", "bf16", "streamed", monkeypatch, backend="hf")
    from oracle.source.sources import model_source, prompt_tokens

    spec = CheckSpec(family="qwen3_5_moe", backend="hf", precision="bf16", decode_tokens=4)
    src = model_source(spec)
    prompt = prompt_tokens(spec, src.args.vocab_size)
    monkeypatch.setattr(N, "_MEMORY", {})
    replay = ReplayAhead(ref, src, spec, prompt)
    before = READ["bytes"]
    lockstep([cand.ahead(ref, None, replay.on_layer), *replay.passes()])
    once = READ["bytes"] - before
    assert set(replay.plan) == set(ref.router_probs) and replay.complete
    replay.differs = True  # kept even where the candidate chose as the reference did
    replay.finish()
    kept = [N._MEMORY.pop(k) for k in list(N._MEMORY)]
    assert len(kept) == 3
    after = N.replayed(ref, src, spec, prompt, replay.plan, replay.runs)  # from the cache replay.finish wrote
    monkeypatch.setattr(N, "_MEMORY", {})
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "fresh"))
    fresh = N.replayed(ref, src, spec, prompt, replay.plan, replay.runs)  # measured again, after the pass
    for a, b, c in zip(kept, after, fresh):
        assert len(a.logits) == len(c.logits) == len(ref.logits)
        assert all(np.array_equal(x, y) and np.array_equal(x, z) for x, y, z in zip(a.logits, b.logits, c.logits))
        assert all(np.array_equal(x, y) for k in c.e2e_scores for x, y in zip(a.e2e_scores[k], c.e2e_scores[k]))
    layers = sum(s.bytes for s in cand.model._oracle_streams)
    assert once == layers  # the candidate's reads: the three runs took the layers it had just read


def test_a_streamed_check_plans_its_memory_and_cache_before_it_starts(monkeypatch, tmp_path):
    """Before a streamed check starts (and what --validate-only says): its memory is the backend's streamed
    estimate + the embedding and head of the three HF models the harness shares beside it (fp32, and bf16 with
    each attention) + the base; a machine with less is refused with the sizes (bad input), not run out of
    memory. The cache it will write beside the checkpoint (reference and noise) is estimated from the shapes:
    at least what the check then writes, and not far above it."""
    from oracle.cache.store import size_of
    from oracle.backend import BASE_MEMORY
    from oracle.check import run_check
    from oracle.source.sources import model_source

    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    monkeypatch.setenv("MOE_ORACLE_REFERENCE", "streamed")
    spec = CheckSpec(family="qwen3_moe", backend="eager", precision="bf16")
    plan = run_check(spec, validate_only=True).provenance["plan"]
    src = model_source(spec)
    _, outside = src.layer_parameter_counts()
    own, _ = resolve("eager").memory_estimate(src, spec)
    assert plan["memory_bytes"] == own + (4 + 2 + 2) * outside + BASE_MEMORY
    assert "3 streamed HF model(s) beside it" in plan["memory"]
    assert run_check(spec).status == "pass"
    written = size_of(tmp_path / "references") + size_of(tmp_path / "noise")
    assert written <= plan["cache_bytes"] <= 3 * written, (written, plan["cache_bytes"])
    monkeypatch.setattr("oracle.memory.available_memory", lambda: plan["memory_bytes"] - 1)
    with pytest.raises(InputError, match=r"would need about .* beside it"):
        run_check(spec, validate_only=True)
