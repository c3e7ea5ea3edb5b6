"""The precision's own error, measured: HF transformers run at the candidate's precision on the
same inputs as the candidate (every block's captured reference inputs; the teacher-forced e2e
steps), against the same fp32 reference. A reduced-precision candidate is then judged by the
rule of the best kernel test suites (FlashAttention's tests): its error may be at most a small
factor of this one, plus a floor (thresholds.toml: `noise_factor`, `noise_floor`), instead of by a
fixed table fitted on normal-law weights. Router near ties are read from it too: a token is a
near tie when the reference's k-th vs (k+1)-th selection-score gap is below `tie_factor` times
the precision's own error on that token's scores (a gap of scores is p·Δlogit, their error
p·δlogit: the comparison is the logit gap against the logit error, whatever the router's
sharpness).

HF at the precision is measured with each attention implementation it offers for the family (eager,
and PyTorch's fused scaled_dot_product_attention where the model supports it): both are HF computing
the same model at that precision, and a candidate whose attention is fused (the MLX delegate's sdpa,
Inductor's flash kernel) rounds as the second does. Row by row, the noise is whichever of the two is
farther from fp32 (`worse`): one sample of rounding may happen to land close, and a correct fused
kernel was measured at 3.9x HF eager's error on such a step (docs/noise.md, phimoe).

One run per checkpoint, prompt, precision and attention implementation, cached on disk like the
reference.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from oracle.cache.store import cache_root
from oracle.backend import hf_spec
from oracle.verdict.metrics import rounding, row_error  # noqa: F401  (re-exported: the precision's storage; a metric)


@dataclass
class Noise:
    precision: str
    outputs: dict = field(default_factory=dict)  # (layer|None, kind) -> [array | (weights, idx)] per call
    scores: dict = field(default_factory=dict)  # layer -> [selection scores [T, E]] per router call
    # layer -> [selection scores] per e2e call (prefill, decode steps): inside HF's own whole run at
    # this precision, whose router inputs carry the upstream layers' error (e2e near ties)
    e2e_scores: dict = field(default_factory=dict)
    logits: list = field(default_factory=list)  # per e2e step: [rows, V] (teacher-forced)
    # layer -> [indices [T, k] per e2e call]: what HF's own routers chose inside this run, before a
    # forced selection replaced it (oracle/verdict/replay.py: what the candidate is judged against there)
    e2e_selected: dict = field(default_factory=dict)
    # layer -> [weights [T, k] per e2e call], and where a discrete decision sets them (sparsemixer) that
    # decision's margin [T] per call: HF's own, before a forced selection replaced them
    e2e_weights: dict = field(default_factory=dict)
    e2e_weight_gaps: dict = field(default_factory=dict)
    # layer -> [the margin of the group choice [T] per e2e call] (group-limited routers): a candidate's
    # experts of a group HF left out are judged on it
    e2e_group_gaps: dict = field(default_factory=dict)
    # layer -> [the scores its sparse-attention indexer ranked [T, keys] per e2e call] (oracle/verdict/selection.py)
    e2e_index_scores: dict = field(default_factory=dict)


def score_error(ref_scores: list, noise_scores: list, n: int | None = None) -> np.ndarray:
    """Per token of a router's first n calls: the largest error of the precision's selection
    scores over the experts both rank (a group left out is -inf in both: not an error)."""
    return row_error(np.concatenate(ref_scores)[:n], np.concatenate(noise_scores)[:n])


ATTENTIONS = ("eager", "sdpa")  # HF's attention implementations the noise is measured with (where supported)
ATTENDING = ("attention", "layer")  # the block kinds whose output the attention implementation changes


def attentions(family) -> tuple[str, ...]:
    """The attention implementations HF offers for the family (eager always; sdpa where its model class
    supports it: gpt_oss's sinks do not)."""
    return tuple(a for a in ATTENTIONS if a == "eager" or getattr(family.hf_class(), f"_supports_{a}", False))


def worse(ref, a, b) -> np.ndarray:
    """Row by row, whichever of two measurements `a`, `b` (same shape) is farther from `ref`."""
    a2, b2 = np.reshape(a, (-1, np.shape(a)[-1])), np.reshape(b, (-1, np.shape(b)[-1]))
    return np.where((row_error(ref, b) > row_error(ref, a))[:, None], b2, a2).reshape(np.shape(a)).astype(np.asarray(a).dtype)


def merged(noises: list, logits: list, scores: dict, outputs: dict | None = None) -> Noise:
    """The first measurement (HF eager: its own selections, weights and margins), with its e2e logits,
    its e2e selection scores and its attending block outputs replaced, row by row, by whichever
    measurement is farther from the fp32 counterpart (`logits` per step, `scores` layer -> per call,
    `outputs` key -> per call)."""
    base, *others = noises
    out = replace(base, outputs=dict(base.outputs), e2e_scores=dict(base.e2e_scores), logits=list(base.logits))
    for other in others:
        if len(other.logits) == len(out.logits) == len(logits):
            out.logits = _worse_calls(logits, out.logits, other.logits)
        for theirs, mine, refs in ((other.e2e_scores, out.e2e_scores, scores), (other.outputs, out.outputs, outputs or {})):
            for key, calls in theirs.items():
                if key in mine and key in refs:
                    mine[key] = _worse_calls(refs[key], mine[key], calls)
    return out


def _worse_calls(refs: list, mine: list, theirs: list) -> list:
    """Per call, `worse` of the two measurements where they and the reference agree in shape; else mine."""
    return [worse(r, a, b) if np.shape(a) == np.shape(b) == np.shape(r) else a for r, a, b in zip(refs, mine, theirs)]


# The streamed HF models of the check running, one per (checkpoint, precision, options, attention): the noise,
# the block rows' and the e2e steps' routing replays share them (forget_models at the check's end).
SHARED: dict = {}
# Small HF models in memory, kept across the checks of this process (a self-test measures the noise and the
# replays of one checkpoint for each of its faults: the eager catalogue loaded HF 530 times, 31 s of its 155
# cold, 2026-11-29): at most KEEP, of at most KEEP_PARAMETERS parameters each. The same object again, not a
# copy: its weights as from_pretrained laid them out, the numbers of a fresh load bit for bit (a deep copy's
# are not: docs/architecture.md). Its users leave nothing on it (their forcing and recording hooks removed,
# its KV cache reset by each prefill).
KEPT: dict = {}
KEEP, KEEP_PARAMETERS = 4, 50_000_000


def hf_at(src, spec, attention: str = "eager"):
    """HF transformers loaded as the `hf` candidate on `spec` (an hf_spec), running that attention
    implementation. A streamed one (its decoder layers read for each use: what it keeps is its embedding and
    head, 2.4 GiB at fp32 for Qwen3-30B-A3B) is shared by every user in the check (SHARED): they run one layer
    at a time in turn (oracle.schedule.lockstep), each with its own state (a LayerByLayer's caches, its forcing
    hooks, removed before the next one's turn), so that the memory a check needs is one model per precision
    and attention, not one per use."""
    from oracle.backend import resolve
    from oracle.reference.streaming import mode_for

    parameters = src.parameter_count()
    key = (str(src.model_dir), src.checkpoint_sha256, spec.precision, repr(sorted(spec.options.items())), attention,
           mode_for(parameters))  # whole or streamed ($MOE_ORACLE_REFERENCE may force one)
    if key in SHARED:
        return SHARED[key]
    if key in KEPT:
        KEPT[key] = hf = KEPT.pop(key)  # the most recently used now
        return hf
    hf = resolve("hf").load(src, spec)
    if attention != "eager":
        hf.model.set_attn_implementation(attention)
    if hf.streamed:
        SHARED[key] = hf
    elif parameters <= KEEP_PARAMETERS:
        KEPT[key] = hf
        while len(KEPT) > KEEP:
            KEPT.pop(next(iter(KEPT)))
    return hf


def forget_models() -> None:
    """Drop the streamed models hf_at shared (the end of a check)."""
    SHARED.clear()


BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}  # per parameter of HF's model at an hf_spec precision


def shared_models_memory(src, spec) -> tuple[int, str]:
    """(bytes, how) the models hf_at shares in a check hold beside the candidate: for a streamed checkpoint
    (oracle.reference.streaming.mode_for), HF at fp32 (the routing replays) and at the precision with each attention
    where its limits are the precision's own error (the noise, the replays), each keeping its embedding and
    head resident (its layers are streamed, one at a time: the backend's streamed estimate counts them). In
    memory: nothing counted (HF's models there are the size the backend's estimate already scales with, one at
    a time)."""
    from oracle.verdict import thresholds
    from oracle.reference.streaming import mode_for

    if spec.precision not in BYTES or mode_for(src.parameter_count()) != "streamed":
        return 0, ""
    _, outside = src.layer_parameter_counts()
    sizes = [BYTES["fp32"]]
    if thresholds.noise_relative(spec.precision):
        sizes += [BYTES[spec.precision]] * len(attentions(src.family))
    return (sum(sizes) * outside, f"{len(sizes)} streamed HF model(s) beside it (fp32"
            + (f" and {spec.precision} x {len(sizes) - 1} attention(s)" if len(sizes) > 1 else "")
            + f"): their embedding and head, {outside / 1e9:.2f} B parameters each")


def _key(spec, src, prompt, routes: str = "reference", attention: str = "eager") -> str:
    from oracle.backend import builtin_source
    from oracle.cache.artifacts import key_of, versions
    from oracle.reference.run import capture_code
    from oracle.verdict import replay, selection

    # the code that measures: the reference's capture, the hf candidate, the routing and key replays and this file
    files = (builtin_source("hf"), replay.__file__, selection.__file__)
    code = hashlib.sha256(capture_code() + b"".join(Path(f).read_bytes() for f in files)
                          + Path(__file__).read_bytes()).hexdigest()
    return key_of({"family": spec.family, "sha": src.checkpoint_sha256, "prompt": list(prompt),
                   "n": spec.decode_tokens, "precision": spec.precision, "code": code, "routes": routes,
                   "attention": attention,
                   **versions("torch", "transformers", "safetensors")})


def reference_plan(ref) -> dict:
    """The reference's own selection at every e2e call (the sequence's router calls)."""
    from oracle.verdict.replay import reference_routes

    n = len(ref.logits)
    return {layer: calls[:n] for layer, calls in reference_routes(ref).items()}


def measure(ref, src, spec, blocks: bool = True, plan: dict | None = None, attention: str = "eager") -> Noise:
    """HF at spec.precision: every block on the reference's inputs (unless not `blocks`), then the
    e2e steps fed the reference's tokens. Its routers' selections are forced (oracle/verdict/replay.py): in the
    moe and layer blocks to the reference's own on those inputs, in the e2e steps to `plan` (layer ->
    [indices per e2e call]; default the reference's), so that the error measured is the precision's
    rounding, not HF's own flips at near ties; the router blocks and the selection scores (read before
    the selection) are HF's own. With `attention` other than eager, HF's model runs that attention
    implementation, and only the blocks it changes (ATTENDING) are measured."""
    from oracle.schedule import lockstep

    return lockstep([measuring(ref, src, spec, blocks, plan, attention)])[0]


def measuring(ref, src, spec, blocks: bool = True, plan: dict | None = None, attention: str = "eager"):
    """`measure` one decoder layer at a time (a generator: yields after each layer, returns the Noise): the
    layer's blocks, then, for a streamed model, its stage of the e2e steps (the hf candidate's layer_by_layer)
    while it is loaded; a model in memory runs the e2e steps call by call at the end."""
    import contextlib

    import torch

    from oracle.reference.streaming import decoder_of, materialized
    from oracle.reference.run import normalize_output, model_args, selection_scores, weight_gap
    from oracle.verdict.replay import forced, reference_routes
    from oracle.verdict.selection import forced_keys

    hf = hf_at(src, replace(spec, options={}), attention)
    hf.keep_router_logits = True
    args = model_args(hf.model, src.family)
    noise = Noise(spec.precision)
    own = reference_routes(ref)
    P, n = ref.prompt_len, len(ref.logits)
    plan = reference_plan(ref) if plan is None else plan
    routers = {layer: m for (layer, kind), m in hf.modules.items() if kind == "router"}

    def block(key):
        if attention != "eager" and key[1] not in ATTENDING:
            return
        with materialized(hf.modules[key]):  # a streamed layer: read once for the block and its scores
            with forced(hf, {key[0]: own[key[0]]} if key[1] in ("moe", "layer") and key[0] in own else {}):
                outs = hf.run_block(key[0], key[1], ref.inputs[key])
            if key[1] == "router":
                with torch.no_grad():
                    noise.scores[key[0]] = [selection_scores(hf.modules[key], lg.float().reshape(-1, lg.shape[-1]),
                                                             args)[0].numpy().astype(np.float32) for _, _, lg in outs]
                noise.outputs[key] = [(w.float().numpy(), i.numpy()) for w, i, _ in outs]
            else:
                noise.outputs[key] = [o.float().numpy() for o in outs]

    def record(layer):
        def hook(mod, a, kwargs, out):
            w, idx, logits = normalize_output("router", out, router_output=hf.read_router)
            flat = logits.reshape(-1, logits.shape[-1])
            scores, ggap = selection_scores(mod, flat, args)
            noise.e2e_scores.setdefault(layer, []).append(scores.numpy().astype(np.float32))
            if ggap is not None:
                noise.e2e_group_gaps.setdefault(layer, []).append(ggap.numpy().astype(np.float32))
            noise.e2e_selected.setdefault(layer, []).append(idx.reshape(-1, idx.shape[-1]).numpy().astype(np.int64))
            noise.e2e_weights.setdefault(layer, []).append(w.reshape(-1, w.shape[-1]).numpy().astype(np.float32))
            wgap = weight_gap(flat, args)
            if wgap is not None:
                noise.e2e_weight_gaps.setdefault(layer, []).append(wgap.numpy().astype(np.float32))
        return hook

    @contextlib.contextmanager
    def e2e(layers):  # the e2e steps' routers recorded, their selections forced to `plan`
        handles = [routers[layer].register_forward_hook(record(layer), with_kwargs=True) for layer in layers
                   if layer in routers]
        try:
            with forced(hf, {layer: plan[layer] for layer in layers if layer in plan}), \
                    forced_keys(decoder_of(hf.model).layers, {k: v for k, v in plan.items() if isinstance(k, str)}):
                yield
        finally:
            for h in handles:
                h.remove()

    keys = ref.block_keys() if blocks else []
    steps = hf.layer_by_layer(ref.tokens, P, n) if hf.streamed else None
    for layer in range(len(decoder_of(hf.model).layers)):
        for key in keys:
            if key[0] == layer:
                block(key)
        if steps is not None:
            with e2e([layer]):
                steps.through(layer)
        yield
    for key in keys:
        if key[0] is None:
            block(key)
    if steps is not None:
        with e2e([]):
            noise.logits = [a.float().numpy().reshape(-1, a.shape[-1]) for a in steps.finish()[0]]
    else:
        def indexed():  # the scores each sparse-attention indexer ranked in the call just run
            for layer, (_, sc) in hf.selections.call().items():
                if sc is not None:
                    noise.e2e_index_scores.setdefault(layer, []).append(sc.astype(np.float32))

        with e2e(list(routers)):
            noise.logits.append(hf.prefill(ref.tokens[:P]).float().numpy())
            indexed()
            for k in range(1, n):
                noise.logits.append(hf.decode(ref.tokens[P + k - 1], P + k - 1).float().numpy()[None])
                indexed()
    return noise


def _save(noise: Noise, path: Path) -> None:
    from oracle.reference.saved import save_arrays

    t, meta = {}, {"precision": noise.precision, "blocks": [], "steps": len(noise.logits)}
    for (layer, kind), outs in noise.outputs.items():
        meta["blocks"].append([layer, kind, len(outs)])
        for i, o in enumerate(outs):
            if kind == "router":
                t[f"w.{layer}.{kind}.{i}"], t[f"i.{layer}.{kind}.{i}"] = o
            else:
                t[f"o.{layer}.{kind}.{i}"] = o
    for prefix, table in (("s", noise.scores), ("e", noise.e2e_scores), ("c", noise.e2e_selected),
                          ("ew", noise.e2e_weights), ("eg", noise.e2e_weight_gaps), ("gg", noise.e2e_group_gaps),
                          ("ix", noise.e2e_index_scores)):
        meta[prefix] = {str(layer): len(s) for layer, s in table.items()}
        for layer, s in table.items():
            for i, a in enumerate(s):
                t[f"{prefix}.{layer}.{i}"] = a
    for k, lg in enumerate(noise.logits):
        t[f"l.{k}"] = lg
    save_arrays(t, meta, path)


def _load(path: Path) -> Noise | None:
    from safetensors.numpy import load_file

    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        t = load_file(str(path.with_suffix(".safetensors")))
        noise = Noise(meta["precision"])
        for layer, kind, n in meta["blocks"]:
            noise.outputs[layer, kind] = [(t[f"w.{layer}.{kind}.{i}"], t[f"i.{layer}.{kind}.{i}"]) if kind == "router"
                                          else t[f"o.{layer}.{kind}.{i}"] for i in range(n)]
        noise.scores = {int(k): [t[f"s.{k}.{i}"] for i in range(n)] for k, n in meta["s"].items()}
        noise.e2e_scores = {int(k): [t[f"e.{k}.{i}"] for i in range(n)] for k, n in meta["e"].items()}
        noise.e2e_selected = {int(k): [t[f"c.{k}.{i}"] for i in range(n)] for k, n in meta["c"].items()}
        noise.e2e_weights = {int(k): [t[f"ew.{k}.{i}"] for i in range(n)] for k, n in meta["ew"].items()}
        noise.e2e_weight_gaps = {int(k): [t[f"eg.{k}.{i}"] for i in range(n)] for k, n in meta["eg"].items()}
        noise.e2e_group_gaps = {int(k): [t[f"gg.{k}.{i}"] for i in range(n)] for k, n in meta["gg"].items()}
        noise.e2e_index_scores = {int(k): [t[f"ix.{k}.{i}"] for i in range(n)] for k, n in meta.get("ix", {}).items()}
        noise.logits = [t[f"l.{k}"] for k in range(meta["steps"])]
        return noise
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: measured again


_MEMORY: dict[str, Noise] = {}  # this process's measurements (a matrix server runs many checks)


def _cached(key: str, ref, src, spec, blocks: bool = True, plan: dict | None = None,
            attention: str = "eager") -> Noise:
    return _cached_all([(key, spec, dict(blocks=blocks, plan=plan, attention=attention))], ref, src)[0]


def _cached_all(jobs: list, ref, src, alongside: tuple = ()) -> list:
    """Each job's Noise ((key, its hf spec, measure's keyword arguments)): from memory, from the disk cache, or
    measured, those not cached together one layer at a time (oracle.schedule.lockstep: a streamed checkpoint's
    layer read once for all), with the generators `alongside` (a candidate's layer-by-layer pass:
    Candidate.ahead), then saved."""
    from oracle.cache import store as cache
    from oracle.schedule import lockstep

    paths = {key: cache_root() / "noise" / key for key, _, _ in jobs}
    for key, _, _ in jobs:
        if key not in _MEMORY:
            cache.hold(paths[key])
    got = {key: _MEMORY.get(key) or _load(paths[key]) for key, _, _ in jobs}
    todo = [job for job in jobs if got[job[0]] is None]
    for (key, _, _), noise in zip(todo, lockstep([measuring(ref, src, spec, **kw) for _, spec, kw in todo]
                                                 + list(alongside))):
        keep(key, noise)
        got[key] = noise
    for key, _, _ in jobs:
        cache.mark_used(paths[key])
        _remember(key, got[key])
    return [got[key] for key, _, _ in jobs]


def _remember(key: str, noise: Noise) -> None:
    if key not in _MEMORY:
        if len(_MEMORY) >= 8:
            _MEMORY.pop(next(iter(_MEMORY)))
        _MEMORY[key] = noise


def keep(key: str, noise: Noise) -> None:
    """A measurement saved in the cache (held, within its limit) and remembered, where _cached_all looks for
    it: its own, and those made elsewhere (oracle/verdict/e2e.py ReplayAhead, one of replay_jobs)."""
    from oracle.cache import store as cache

    path = cache_root() / "noise" / key
    cache.hold(path)
    _save(noise, path)
    cache.enforce_quietly(path)
    cache.mark_used(path)
    _remember(key, noise)


def noise_for(ref, src, spec, prompt, alongside: tuple = ()) -> Noise | None:
    """The precision's own error for this check (None where its limits are not noise-relative:
    fp32, whose reference is HF itself, and the quantized precisions): HF at the precision with each
    of its attention implementations, the worse row by row. The generators `alongside` (a candidate's
    layer-by-layer pass) run with the measurements, one layer at a time in turn (to the end in any case)."""
    from oracle.verdict import thresholds
    from oracle.schedule import lockstep

    if not thresholds.noise_relative(spec.precision):
        lockstep(list(alongside))
        return None
    spec = hf_spec(spec)
    return merged(_cached_all([(_key(spec, src, prompt, attention=a), spec, dict(attention=a))
                               for a in attentions(src.family)], ref, src, alongside),
                  ref.logits, ref.router_probs, ref.outputs)


def exact_for(ref, src, spec, prompt) -> Noise:
    """fp32's own error: HF at fp64 on the teacher-forced e2e steps (its logits, and its routers'
    selection scores inside the run), against which HF fp32 (the reference) is then measured as
    bf16 is against fp32. Measured only when an fp32 step fails its fixed table (oracle/verdict/e2e.py);
    cached like the others. The blocks are not run: fp32's block rows keep their tables."""
    spec = hf_spec(spec, "fp64")
    return _cached(_key(spec, src, prompt), ref, src, spec, blocks=False)


def replayed(ref, src, spec, prompt, plan: dict, runs: list) -> list:
    """HF on the teacher-forced e2e steps with the selection `plan` forced at every router call (layer ->
    [indices per e2e call]: the candidate's), at each (precision, attention) of `runs`, cached, those not
    cached one layer at a time together: the routing-aligned reference (fp32), its noise (the candidate's
    precision, per attention implementation) and fp32's own error there (fp64)."""
    return _cached_all(replay_jobs(src, spec, prompt, plan, runs), ref, src)


def replay_jobs(src, spec, prompt, plan: dict, runs: list) -> list:
    """`replayed`'s measurements as _cached_all's jobs (key, hf spec, measuring's keyword arguments), one per
    (precision, attention) of `runs`; `plan` may be filled while they run (oracle/verdict/e2e.py ReplayAhead: the key
    is then computed again from the whole plan)."""
    from oracle.verdict.replay import digest

    return [(_key(s, src, prompt, digest(plan), attention), s, dict(blocks=False, plan=plan, attention=attention))
            for s, attention in ((hf_spec(spec, p), a) for p, a in runs)]


def aligner(ref, src, spec, prompt):
    """The e2e routing replay of a check (oracle/verdict/e2e.py run_e2e's `align`): plan -> (HF fp32, HF at the
    check's precision where it is judged against its own error (else None; with each attention
    implementation, the worse row by row), a callable giving HF at fp64) with that selection forced."""
    from oracle.verdict import thresholds

    def align(plan):
        at = [(spec.precision, a) for a in attentions(src.family)] if thresholds.noise_relative(spec.precision) else []
        fp32, *noises = replayed(ref, src, spec, prompt, plan, [("fp32", "eager"), *at])
        return (fp32, merged(noises, fp32.logits, fp32.e2e_scores) if noises else None,
                lambda: replayed(ref, src, spec, prompt, plan, [("fp64", "eager")])[0])
    return align


def block_aligner(ref, src, spec):
    """The block rows' routing replay (oracle/verdict/compare.py block_rows' `align`): (key, the forcing plan of
    its layer per call: oracle.verdict.replay.plan_of) -> (HF fp32's outputs of that block with it forced, HF's at the
    check's precision with it where the precision is judged against its own error (with each attention
    implementation for the blocks it changes, the worse row by row), else None). HF is loaded once per
    precision and attention implementation, when a row first needs it."""
    from oracle.verdict import thresholds
    from oracle.verdict.replay import digest, forced

    loaded, kept = {}, {}

    def run(precision, key, plan, attention="eager"):
        if (precision, attention) not in loaded:
            loaded[precision, attention] = hf_at(src, hf_spec(spec, precision), attention)
        hf = loaded[precision, attention]
        with forced(hf, {key[0]: plan}):
            return [o.float().numpy() for o in hf.run_block(key[0], key[1], ref.inputs[key])]

    def align(key, sel, ahead: bool = False):
        """`ahead`: computed while the candidate's layer-by-layer pass has the layer read (oracle/verdict/compare.py
        aligning), kept for the row's own call with the same plan (answered once)."""
        mark = (key, digest({key[0]: sel}))
        if not ahead and mark in kept:
            return kept.pop(mark)
        got = _align(key, sel)
        if ahead:
            kept[mark] = got
        return got

    def _align(key, sel):
        fp32 = run("fp32", key, sel)
        if not thresholds.noise_relative(spec.precision):
            return fp32, None
        at = run(spec.precision, key, sel)
        for a in attentions(src.family)[1:] if key[1] in ATTENDING else ():
            at = [worse(r, x, y) for r, x, y in zip(fp32, at, run(spec.precision, key, sel, a))]
        return fp32, at
    return align
