"""The HF transformers fp32 reference: prompt prefill + greedy decode with HF's own cache,
with hooks recording every block's input and output on every call."""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oracle.reference.streaming import decoder_of, first_tensor, materialized


@dataclass
class BlockCall:
    """One call of a block: input x [1, T, H] (fp32) at positions pos [T]. The first call of
    a sequence starts at position 0 (fresh state); later calls continue that state.
    The reference holds numpy arrays (x_array, pos_array: readable without torch); `x` and
    `pos` are the same values as torch tensors, each a fresh copy (what torch candidates take)."""

    x_array: np.ndarray  # [1, T, H] float32
    pos_array: np.ndarray  # [T] int64
    tokens: list[int]  # the token ids the reference model consumed in this call
    probe: bool = False  # an expert-coverage probe (stateless blocks only), not from the sequence

    @property
    def x(self):
        import torch

        # a copy in torch's own (aligned) memory: BLAS can round differently on other alignments
        return torch.from_numpy(self.x_array).clone()

    @property
    def pos(self):
        import torch

        return torch.from_numpy(self.pos_array).clone()


@dataclass
class Reference:
    tokens: list[int]  # prompt + greedy continuation
    prompt_len: int
    positions: list[np.ndarray]  # per call: prefill [P], then one per decode step (int64)
    logits: list[np.ndarray]  # per call: [T, V] fp32
    inputs: dict = field(default_factory=dict)  # (layer|None, kind) -> [BlockCall per call]
    outputs: dict = field(default_factory=dict)  # (layer|None, kind) -> [array | (weights, idx)]
    # layer -> [selection scores [T, E] per call]: what the family's own top-k ranks (models.layers.routing:
    # softmax probabilities, or sigmoid scores + correction bias; -inf outside the chosen groups)
    router_probs: dict = field(default_factory=dict)
    # layer -> [[T] per call]: the margin of the group choice (group-limited routers only)
    group_gaps: dict = field(default_factory=dict)
    # layer -> [N, k] per router call: the experts had the group choice gone the other way at its margin
    group_alternatives: dict = field(default_factory=dict)
    # layer -> [[T] per call]: the margin of the decisions that set the top-k weights (sparsemixer's
    # masks, routing.weight_gap): a near tie there changes the weights, not the experts
    weight_gaps: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)  # layer -> experts routed to by the sequence
    # sparse attention (oracle/verdict/selection.py): layer -> [keys its indexer selected [T, k] per call],
    # and the scores it ranked [T, keys] per call; empty for a model without indexers
    index_selected: dict = field(default_factory=dict)
    index_scores: dict = field(default_factory=dict)

    def block_keys(self) -> list[tuple[int | None, str]]:
        return list(self.inputs)


def _submodule(root, path: str):
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def model_args(model, family):
    """The production ModelArgs of the HF model's config (which blocks each layer has, how it routes)."""
    return family.to_args(model.config.get_text_config())


def block_modules(model, family) -> dict:
    """(layer|None, kind) -> the HF module computing that block: the family's HF paths
    (Family.hf_path) for the blocks models.args.layer_kinds gives each layer."""
    from models.args import layer_kinds

    args = model_args(model, family)
    decoder = decoder_of(model)
    out = {}
    for i, layer in enumerate(decoder.layers):
        for kind in layer_kinds(args, i):
            module = layer if kind == "layer" else next(
                (m for p in family.hf_path(kind) if (m := _submodule(layer, p)) is not None), None)
            if module is None:
                raise RuntimeError(f"{family.name}: layer {i} of HF's model has no {kind} block at "
                                   f"{' or '.join(family.hf_path(kind))}")
            out[i, kind] = module
            if kind == "router" and family.hf_router_bias:
                path, _, name = family.hf_router_bias.rpartition(".")
                BIAS_HOLDERS[module] = (_submodule(layer, path), name)
                if module not in ROUTER_RANK:  # (hooked once: three dims until a call is seen)
                    ROUTER_RANK[module] = 3
                    module.register_forward_pre_hook(_seen_rank)
    out[None, "final_norm"] = decoder.norm
    out[None, "logits"] = model.get_output_embeddings()
    return out


def normalize_output(kind: str, out, keep_dtype: bool = False, router_output=None):
    """HF module output -> tensor (router: weights, indices, logits); fp32 unless keep_dtype.
    router_output: the family's reading of its router's output (Family.router_output)."""
    cast = (lambda t: t.detach()) if keep_dtype else (lambda t: t.detach().float())
    if kind == "router":  # HF routers return (logits, top-k weights, top-k indices)
        logits, weights, idx = router_output(out) if router_output else out
        return cast(weights), idx.detach(), logits.detach().float()
    if isinstance(out, tuple):
        out = out[0]
    return cast(out)


# an HF router -> (the module that holds its correction bias, the bias's name) where that is not the router
# (Family.hf_router_bias: MiniMax-M2's MoE block, which passes the bias to its router)
BIAS_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# such a router -> the rank of the hidden states its block passes it (call_router passes a probe so)
ROUTER_RANK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _seen_rank(module, args):
    if args and hasattr(args[0], "dim"):
        ROUTER_RANK[module] = args[0].dim()


def correction_bias(router):
    """The router's correction bias wherever under it the family keeps it (ERNIE 4.5: moe_statics), or
    beside it (Family.hf_router_bias), or None."""
    holder, name = BIAS_HOLDERS.get(router, (None, None))
    if holder is not None:
        with materialized(holder):  # a streamed model's layer holds its weights only while in use
            return getattr(holder, name).detach().float().reshape(-1).clone()
    with materialized(router):  # a streamed model's router holds its weights only in its forward
        bias = next((t for n, t in [*router.named_parameters(), *router.named_buffers()]
                     if n.rsplit(".", 1)[-1] == "e_score_correction_bias"), None)
        return bias.detach().float().reshape(-1).clone() if bias is not None else None


def call_router(router, x):
    """An HF router on tokens x [N, H], alone (a probe): with its block's correction bias where the
    block passes it (Family.hf_router_bias)."""
    holder, name = BIAS_HOLDERS.get(router, (None, None))
    if holder is None:
        return router(x)
    # the block passes its hidden states with the bias, in the rank it was last seen taking (AFMoE's router
    # reads [B, T, H], LFM2's [N, H]; three dims before any call)
    if ROUTER_RANK[router] == 3:
        x = x.reshape(1, -1, x.shape[-1])
    # (a bias the router holds itself under another name: ZAYA's balancing_biases; its second input is other state)
    return router(x) if holder is router else router(x, getattr(holder, name))


def router_weight(router):
    """The HF router's logits weight [E, H]: its own, or its linear layer's where it wraps one (HunYuan's
    gate.wg, AFMoE's router.gate)."""
    from torch import nn

    w = getattr(router, "weight", None)
    if w is not None:
        return w
    return next(m.weight for m in router.modules() if isinstance(m, nn.Linear))


def selection_scores(router, logits, args):
    """(selection scores [N, E], group gaps [N] or None) of an HF router's logits: the family's
    routing (models.layers.routing) with the router's own correction bias."""
    from models.layers import routing

    bias = correction_bias(router)
    choice = routing.choice_scores(logits, routing.scores(logits, args), args)
    return routing.selection(choice, bias, args), (routing.group_gap(choice, bias, args) if routing.grouped(args) else None)


def router_record(router, logits, args):
    """What the reference records of one HF router call: (selection scores [N, E], the group choice's
    margin [N], the weights' decisions' margin [N], the experts had the group choice gone the other way
    [N, k]; each None where the routing has no such decision), its scores and bias read once."""
    from models.layers import routing

    bias = correction_bias(router)
    choice = routing.choice_scores(logits, routing.scores(logits, args), args)
    grouped = routing.grouped(args)
    return (routing.selection(choice, bias, args), routing.group_gap(choice, bias, args) if grouped else None,
            weight_gap(logits, args),
            routing.group_alternative(choice, bias, args, args.num_experts_per_tok) if grouped else None)


def weight_gap(logits, args):
    """routing.weight_gap of an HF router's logits, or None where no decision sets the weights."""
    from models.layers import routing

    return routing.weight_gap(routing.scores(logits, args), args) if routing.weighs_discretely(args) else None


def check_selection(layer: int, choice: np.ndarray, idx: np.ndarray, k: int) -> None:
    """The reference router's choice is a top-k of the selection scores (any one, at exact ties):
    else the family declares a routing its HF model does not have."""
    if np.isnan(choice).any():
        return  # NaN in the reference: first_nonfinite reports where it starts
    kth = -np.sort(-choice, axis=-1)[:, k - 1]  # a top-k: no chosen expert scores below the k-th score
    for t in np.flatnonzero(np.take_along_axis(choice, idx, axis=-1).min(axis=-1) < kth):
        raise RuntimeError(f"layer {layer}: HF's router chose experts {sorted(idx[t].tolist())} where the "
                           "family's selection scores rank others first: its routing fields (ModelArgs.router: "
                           "scoring, correction_bias, n_group, topk_group, group_score) do not describe "
                           "this model")


def hf_positions(model, start: int, n: int) -> dict:
    """The position_ids HF's model is called with for n tokens from `start`: none (HF counts them from its cache),
    or explicit where the family's HF cache does not count what it holds (Family.hf_position_ids: MiniMax's cache
    reports 0 tokens seen, its first layer being lightning attention, so each decode step would sit at position 0)."""
    import torch

    from models import family_for_model_type, get_family

    name = family_for_model_type(getattr(model.config, "model_type", ""))
    if name is None or not get_family(name).hf_position_ids:
        return {}
    return {"position_ids": torch.arange(start, start + n, device=model.device)[None]}


def greedy_run(model, prompt: list[int], n_decode: int, on_call=None, on_prefill=None):
    """Prefill the prompt, then n_decode single-token steps feeding back the argmax (`on_prefill()` after
    the prefill, `on_call(step)` after each step). Returns (tokens, positions per call, logits per call)."""
    import torch

    tokens = list(prompt)
    positions, logits = [], []
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model(input_ids=ids, use_cache=True)
        positions.append(torch.arange(len(prompt)))
        logits.append(out.logits[0].float())
        if on_prefill:
            on_prefill()
        for step in range(n_decode):
            tokens.append(int(logits[-1][-1].argmax()))
            pos = len(tokens) - 1
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True,
                        **hf_positions(model, pos, 1))
            positions.append(torch.tensor([pos]))
            logits.append(out.logits[0].float())
            if on_call:
                on_call(step)
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, positions, logits


def capture(model, family, prompt: list[int], n_decode: int, on_call=None) -> Reference:
    """Run the reference and record every block's input and output on every call."""
    modules = block_modules(model, family)
    args = model_args(model, family)
    recs = defaultdict(lambda: ([], []))
    reader = router_reader(family, args)

    quiet = [False]  # an expert probe running inside the prefill (probing_in_prefill): not a sequence call

    def hook(key):
        def fn(mod, a, kwargs, out):
            if quiet[0]:
                return
            x = first_tensor(a, kwargs).detach().float()
            recs[key][0].append(x.reshape(1, -1, x.shape[-1]).clone())
            out = normalize_output(key[1], out, router_output=reader)
            if key[1] == "router":
                out = (*out[:2], *router_record(mod, out[2], args))
            recs[key][1].append(out)

        return fn

    handles = [m.register_forward_hook(hook(k), with_kwargs=True) for k, m in modules.items()]
    from oracle.verdict.selection import SelectionLog, indexers

    selections = SelectionLog(indexers(decoder_of(model).layers))
    calls = []

    def on_step(step):  # each decode step's selections (the prefill's: on_prefill)
        calls.append(selections.take())
        if on_call:
            on_call(step)

    try:
        with probing_in_prefill(model, modules, args, reader, quiet) as probes:
            tokens, positions, logits = greedy_run(model, prompt, n_decode, on_step,
                                                   on_prefill=lambda: calls.append(selections.take()))
    finally:
        for h in handles:
            h.remove()
        selections.remove()
    positions = [p.numpy() for p in positions]
    ref = Reference(tokens=tokens, prompt_len=len(prompt), positions=positions, logits=[lg.numpy() for lg in logits])
    for key in modules:
        xs, outs = recs[key]
        if len(xs) != len(positions):
            raise RuntimeError(f"reference hook {key} fired {len(xs)} times for {len(positions)} calls")
        ref.inputs[key] = [BlockCall(x.numpy(), p, tokens[int(p[0]) : int(p[-1]) + 1]) for x, p in zip(xs, positions)]
        if key[1] == "router":
            ref.outputs[key] = [(o[0].numpy(), o[1].numpy()) for o in outs]
            ref.router_probs[key[0]] = [o[2].numpy() for o in outs]
            if outs[0][3] is not None:
                ref.group_gaps[key[0]] = [o[3].numpy() for o in outs]
            if outs[0][4] is not None:
                ref.weight_gaps[key[0]] = [o[4].numpy() for o in outs]
            if outs[0][5] is not None:
                ref.group_alternatives[key[0]] = [o[5].numpy() for o in outs]
            for (_, i), p in zip(ref.outputs[key], ref.router_probs[key[0]]):
                check_selection(key[0], p, i, args.num_experts_per_tok)
        elif key == (None, "logits"):
            # the model's logits, not the output embedding's: what the CausalLM makes of it after
            # the projection (Granite's logits_scaling) is part of the block
            ref.outputs[key] = [lg[None] for lg in ref.logits]
        else:
            ref.outputs[key] = [o.numpy() for o in outs]
    for (layer, kind), router in modules.items():
        if kind == "router":
            add_probes(ref, layer, int(router_weight(router).shape[0]), *probes[layer])
    for layer in sorted({layer for c in calls for layer in c}):
        if all(layer in c and c[layer][1] is not None for c in calls) and len(calls) == len(positions):
            ref.index_selected[layer] = [c[layer][0] for c in calls]
            ref.index_scores[layer] = [c[layer][1].astype(np.float32) for c in calls]
    return ref


def router_reader(family, args):
    """The family's reading of its HF router's output (None: the (logits, weights, indices) triple)."""
    return None if family.router_output is None else (lambda out: family.router_output(out, args))


def expert_probes(router, moe, args, reader=None) -> tuple[list, list]:
    """A prompt rarely routes to every expert, and a bug in an expert nobody routes to is
    invisible. So the stateless router and moe blocks also get one single-token probe per
    expert e: a token the family's own selection routes to e, checked by running the reference
    router on it. First x = router row e scaled to RMS 1 (a softmax router then ranks e first);
    where the selection is decided otherwise too (a correction bias, a group limit) the probe is
    solved for: the least-norm x whose router logits are +8 for e and -8 for every other expert.
    The reference computes the probe outputs with its own modules. Returns (per probe: (BlockCall, router
    weights, indices, selection scores, group gap, weight gap, group alternative (each None where the
    routing has none), moe output), the experts neither reaches: unprobed)."""
    import torch

    probes, unprobed = [], []
    with torch.no_grad(), materialized(moe), materialized(router):
        rw = router_weight(router)
        w = rw.detach().float().clone()
        pinv = None
        for e in range(w.shape[0]):
            x = (w[e] / w[e].pow(2).mean().sqrt()).reshape(1, 1, -1)
            out = call_router(router, x.reshape(1, -1).to(rw.dtype))
            if e not in normalize_output("router", out, router_output=reader)[1].reshape(-1).tolist():
                if pinv is None:
                    pinv = torch.linalg.pinv(w.double())  # [H, E]
                z = torch.full((w.shape[0],), -8.0, dtype=torch.float64)
                z[e] = 8.0
                x = (pinv @ z).float().reshape(1, 1, -1)
                out = call_router(router, x.reshape(1, -1).to(rw.dtype))
                if e not in normalize_output("router", out, router_output=reader)[1].reshape(-1).tolist():
                    unprobed.append(e)
                    continue
            weights, idx, logits = normalize_output("router", out, router_output=reader)
            choice, gap, wgap, alt = router_record(router, logits, args)
            probes.append((BlockCall(x.numpy(), np.array([0]), [], probe=True), weights.numpy(), idx.numpy(),
                           choice.numpy(), *(None if t is None else t.numpy() for t in (gap, wgap, alt)),
                           normalize_output("moe", moe(x)).numpy()))
    return probes, unprobed


def add_probes(ref: Reference, layer: int, experts: int, probes: list, unprobed: list) -> None:
    """A MoE layer's expert probes (expert_probes) after its sequence's calls in the reference, and its
    coverage: the experts the sequence routed to, those no probe reaches."""
    used = np.unique(np.concatenate([i.reshape(-1) for _, i in ref.outputs[layer, "router"]]))
    ref.coverage[layer] = {"experts": experts, "routed_by_sequence": int(used.size)}
    for call, weights, idx, choice, gap, wgap, alt, out in probes:
        ref.inputs[layer, "router"].append(call)
        ref.outputs[layer, "router"].append((weights, idx))
        ref.router_probs[layer].append(choice)
        for table, value in ((ref.group_gaps, gap), (ref.group_alternatives, alt), (ref.weight_gaps, wgap)):
            if value is not None:
                table[layer].append(value)
        ref.inputs[layer, "moe"].append(call)
        ref.outputs[layer, "moe"].append(out)
    if unprobed:
        ref.coverage[layer]["unprobed"] = unprobed


@contextlib.contextmanager
def probing_in_prefill(model, modules: dict, args, reader, quiet: list):
    """Each MoE layer's expert probes (expert_probes) run inside the prefill's forward of its decoder
    layer, the layer loaded whole for both: a streamed layer is read once for the prefill and the probes
    (after the model's prefill they would read every expert again). `quiet[0]` is True while a probe runs
    (the capture's hooks record the sequence's calls, not the probes). Yields {layer: (probes, unprobed)}."""
    found, handles = {}, []
    layers = decoder_of(model).layers
    for (layer, kind), router in modules.items():
        if kind != "router":
            continue
        stream = getattr(layers[layer], "_oracle_stream", None)

        def before(mod, a, kw, layer=layer, stream=stream):
            if layer not in found and stream is not None:
                stream.acquire()  # whole (not only the experts its tokens route to), until the probes ran

        def after(mod, a, kw, out, layer=layer, stream=stream, router=router):
            if layer in found:
                return
            quiet[0] = True
            try:
                found[layer] = expert_probes(router, modules[layer, "moe"], args, reader)
            finally:
                quiet[0] = False
                if stream is not None:
                    stream.release()

        handles += [layers[layer].register_forward_pre_hook(before, with_kwargs=True, prepend=True),
                    layers[layer].register_forward_hook(after, with_kwargs=True)]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def first_nonfinite(ref: Reference) -> str | None:
    """Where the reference itself first produces NaN/Inf (program order: layer by layer, then
    the final norm and the logits), or None."""
    from oracle.reports.result import PROGRAM_ORDER, place

    order = {**PROGRAM_ORDER, "final_norm": 4, "logits": 5}
    for key in sorted(ref.outputs, key=lambda k: (k[0] is None, k[0] or 0, order.get(k[1], 9))):
        for i, out in enumerate(ref.outputs[key]):
            t = out[0] if isinstance(out, tuple) else out
            if not np.isfinite(t).all():
                return f"{place(key[0])} {key[1]} (call {i}{', an expert probe' if ref.inputs[key][i].probe else ''})"
    for i, lg in enumerate(ref.logits):
        if not np.isfinite(lg).all():
            return f"the logits (call {i})"
    return None


CAPTURE_FILES = ("run.py", "streaming.py", "saved.py")  # what captures, loads and stores a reference


def capture_code() -> bytes:
    """The source of the reference's capture (this file, its loading and its saved form): what a cached
    reference, and a noise measurement taken on it, are keyed by."""
    return b"".join(Path(__file__).with_name(f).read_bytes() for f in CAPTURE_FILES)
