"""In-situ rows: what a correct implementation accumulates to that point.

An in-situ row (an ExecuTorch runtime tap: the candidate's own intermediate, fed by its own
previous blocks) is not fed the reference's input: its input already carries the candidate's
upstream error, and a block passes that error on, amplified or damped as its arithmetic
decides (a residual sum that cancels large summands, a norm dividing by a small RMS, a sharp
softmax). A table written for isolated blocks reads that growth as a fault (executorch fp32
on the trained profile: 1.7e-6 at layer 0 to 3.7e-5 at the final norm, on an element of
0.018).

So the correct implementation is run on the candidate's own upstream: HF transformers fp32
replays the reference's token sequence with every decoder layer's input replaced by the
candidate's output of the layer before it, the final norm's by the candidate's last layer
output and the head's by the candidate's final norm output, and every block's output is
recorded. Each such output differs from the reference by exactly what a correct block makes of
the candidate's input error (its attention, router and moe, inside the layer, see the same
stream through HF's own norms). The row is then judged by `upstream_limits`
(oracle/verdict/thresholds.py): element by element, the isolated table plus `upstream_factor` times
that propagated error at the same element. An element's propagated error follows what was
summed into it upstream, not the element's own magnitude.

A candidate that also gives each block's own input inside the layer (Candidate.block_input: its
attention's, its router's and experts' norm outputs) has those rows judged against HF's block fed
that very input: a norm before the block that computes wrong then fails the layer's row alone, as
an isolated check would say, and not the block after it (rmsnorm_eps_wrong on executorch).

Expert probes (fed the reference's inputs) propagate nothing: their upstream output is the
reference's.
"""

from __future__ import annotations

import numpy as np


def is_in_situ(mode: str) -> bool:
    return "in-situ" in (mode or "")


def sequence_calls(ref) -> list:
    """The reference's calls of its token sequence (prefill, then each decode step)."""
    key = next(k for k in ref.block_keys() if k[1] == "layer")
    return [c for c in ref.inputs[key] if not c.probe]


def propagated(ref, src, spec, keys, cand: dict, inputs: dict | None = None) -> dict:
    """(layer|None, kind) -> HF fp32's outputs for each of `keys`, one per call of ref.inputs[key]
    (router: (weights, indices)), on the candidate's own upstream. `cand`: the candidate's in-situ
    outputs as host arrays (oracle.verdict.compare.candidate_arrays), one [T, H] per call: a decoder layer's
    input is replaced where the candidate's previous layer output is there (the final norm's where
    its last layer's is, the head's where its final norm's is). `inputs`: (layer, kind) -> the
    candidate's own input to that block inside its layer (Candidate.block_input), one [T, H] per
    call: those blocks are recorded in a second replay that feeds each of them that input (an error
    of the norm before a block then shows in its layer's row, not in the block's)."""
    from oracle.backend import hf_spec, resolve

    hf = resolve("hf").load(src, hf_spec(spec, "fp32"))
    modules = hf.modules
    calls = sequence_calls(ref)
    n_seq = len(calls)
    layers = sorted(k[0] for k in modules if k[0] is not None and k[1] == "layer")
    feeds = {(layers[i], "layer"): (layers[i - 1], "layer") for i in range(1, len(layers))}
    feeds[None, "final_norm"] = (layers[-1], "layer")
    feeds[None, "logits"] = (None, "final_norm")
    stream = {key: cand[source] for key, source in feeds.items() if source in cand and len(cand[source]) >= n_seq}
    own = {k: v for k, v in (inputs or {}).items() if k in set(keys) and k in modules and len(v) >= n_seq}
    recorded = replay(hf, calls, stream, [k for k in keys if k in modules and k not in own])
    if own:
        recorded.update(replay(hf, calls, own, list(own)))
    # the expert probes were fed the reference's inputs: nothing upstream, the reference's outputs
    return {key: outs + list(ref.outputs[key][len(outs):]) for key, outs in recorded.items()}


def replay(hf, calls, feeds: dict, keys: list) -> dict:
    """HF's run of the sequence's `calls` with each module of `feeds` fed the given input (one host
    array per call) instead of its own, recording the outputs of the blocks `keys`."""
    import torch

    from oracle.reference.run import normalize_output

    modules = hf.modules
    now = [0]  # the call being replayed
    recorded = {key: [] for key in keys}

    def substitute(arrays):
        def pre(mod, args, kwargs):
            x = torch.as_tensor(np.ascontiguousarray(arrays[now[0]]), dtype=torch.float32)
            if args and torch.is_tensor(args[0]):
                return (x.reshape(args[0].shape).to(args[0].dtype), *args[1:]), kwargs
            h = kwargs["hidden_states"]
            return args, {**kwargs, "hidden_states": x.reshape(h.shape).to(h.dtype)}
        return pre

    def record(key):
        def post(mod, args, kwargs, out):
            if key[1] == "logits":
                return  # the model's logits (the reference's logits block), read after the call
            o = normalize_output(key[1], out, router_output=hf.read_router)
            recorded[key].append((o[0].numpy(), o[1].numpy()) if key[1] == "router" else o.numpy())
        return post

    handles = []
    try:
        for key, arrays in feeds.items():
            handles.append(modules[key].register_forward_pre_hook(substitute(arrays), with_kwargs=True))
        for key in recorded:
            handles.append(modules[key].register_forward_hook(record(key), with_kwargs=True))
        cache = None
        with torch.no_grad():
            for i, c in enumerate(calls):
                now[0] = i
                out = hf.model(input_ids=torch.tensor([c.tokens]), past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                if (None, "logits") in recorded:
                    recorded[None, "logits"].append(out.logits.detach().float().numpy())
    finally:
        for h in handles:
            h.remove()
    return recorded
