"""An ExecuTorch program as a candidate, run by ExecuTorch's runtime: prefill and decode sharing the
program's state, the block rows from its runtime taps (in-situ) and its MoE probes (isolated), the
drill's points programs, the experts its routers chose, the fused sampler's methods."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from exporters.executorch.program import OPS_FILE, read_taps, weights_file
from exporters.executorch.runtime import runtime
from models.layers.sampling import runtime_args
from oracle.backend import Candidate

SEQUENCE_MODE, PROBE_MODE = "in-situ", "isolated"


class ExecutorchCandidate(Candidate):
    """A .pte with prefill/decode (+ taps) and probe methods, run by executorch.runtime.
    Rows of the reference's sequence are in-situ; router/moe expert probes are isolated."""

    block_mode = SEQUENCE_MODE  # the default; per kind (read by the harness) below
    block_modes = {"attention": SEQUENCE_MODE, "layer": SEQUENCE_MODE, "final_norm": SEQUENCE_MODE,
                   "logits": SEQUENCE_MODE, "router": f"{SEQUENCE_MODE} (sequence) + {PROBE_MODE} (expert probes)",
                   "moe": f"{SEQUENCE_MODE} (sequence) + {PROBE_MODE} (expert probes)"}

    def __init__(self, pte: Path, info: dict, dtype=torch.float32, probe_rows: int = 2, data_path: Path | None = None):
        data_path = data_path or weights_file(pte)
        self.program = runtime().load_program(str(pte), data_path=str(data_path) if data_path else None)
        self.taps, self.info = read_taps(pte), info
        # (layer, kind) -> the tap of the block's own input (a program tapped before the inputs were: none)
        self.inputs = {(layer, kind): tap for layer, kind, tap in self.taps.pop("inputs", [])}
        self.ops = Path(pte).with_name(OPS_FILE)
        self.dtype, self.probe_rows = dtype, probe_rows  # probe inputs: the model's dtype, at most rows per call
        # every method up front: loading a method initialises the shared state buffers, so a
        # method loaded after a prefill would wipe that prefill's KV cache and recurrent state
        self.methods = {n: self.program.load_method(n) for n in sorted(self.program.method_names)
                        if n in ("prefill", "decode") or n.startswith(("probe_", "sample_"))}
        self._seq = (None, None)

    def structures(self) -> dict:
        """The structural golden: the op histogram of the lowered prefill and decode."""
        return {"ops": self.ops.read_text()} if self.ops.is_file() else {}

    def method(self, name: str):
        return self.methods[name]

    def run(self, tokens, pos) -> tuple[str, list]:
        name = "prefill" if len(tokens) > 1 else "decode"
        outs = self.method(name).execute([torch.tensor([list(tokens)]), torch.as_tensor(pos, dtype=torch.long)])
        return name, [o.clone() for o in outs]  # outputs may alias the method's memory: the next call overwrites them

    def prefill(self, tokens):
        name, outs = self.run(tokens, torch.arange(len(tokens)))
        self.routes = self._routes(name, outs)
        return outs[0][0]

    no_chunks = None  # extend: a chunk after the first

    def extend(self, tokens, pos):
        """The prefill method on a chunk after the first (its positions from `pos`, the state carried)."""
        name, outs = self.run(tokens, torch.arange(pos, pos + len(tokens)))
        self.routes = self._routes(name, outs)
        return outs[0][0] if name == "prefill" else outs[0][0, -1:]

    def decode(self, token, pos):
        name, outs = self.run([token], [pos])
        self.routes = self._routes(name, outs)
        return outs[0][0, -1]

    no_batch = "the .pte's prefill and decode are exported for one sequence (batch 1)"
    routes = None
    no_routes = "a program without the routers' taps (a production .pte) does not report its routers' choices"

    def _routes(self, name: str, outs: list) -> dict | None:
        """{layer: indices [T, k] (or (indices, weights))} from the routers' runtime taps of this call: the
        experts the program chose (routing replay); None for a program without them."""
        found = {}
        for layer, kind, i in (self.taps or {}).get(name, []):
            if kind == "router":
                found.setdefault(layer, []).append(outs[i])
        if not found:
            return None
        routes = {}
        for layer, ts in found.items():
            idx = next((t for t in ts if not t.is_floating_point()), None)
            if idx is None:
                return None
            w = next((t for t in ts if t.is_floating_point()), None)
            idx = idx.reshape(-1, idx.shape[-1]).numpy().astype(np.int64)
            routes[layer] = (idx, w.float().reshape(idx.shape).numpy()) if w is not None and w.numel() == idx.size else idx
        return routes

    def last_routes(self):
        return self.routes

    def sequence_taps(self, calls) -> list[dict]:
        """Per call of the sequence: (layer, kind) -> tapped outputs, from one run of the program."""
        key = tuple((tuple(c.tokens), tuple(c.pos.tolist())) for c in calls)
        if self._seq[0] != key:
            if calls and int(calls[0].pos[0]) != 0:
                raise ValueError("the block calls must start a sequence at position 0")
            rows = []
            for c in calls:
                name, outs = self.run(c.tokens, c.pos)
                row = {}
                for layer, kind, i in self.taps[name]:
                    row.setdefault((layer, kind), []).append(outs[i])
                rows.append(row)
            self._seq = (key, rows)
        return self._seq[1]

    def probe(self, layer: int, xs: list) -> list[tuple]:
        """(moe, weights, indices) per input ([..., H] each), from the layer's probe method."""
        out = []
        for x in xs:  # each input alone, as the reference calls it (Doge's router mixes the rows of one call)
            x = torch.as_tensor(x).reshape(-1, x.shape[-1]).to(self.dtype)
            runs = [[o.clone() for o in self.method(f"probe_{layer}").execute([x[i:i + self.probe_rows]])]
                    for i in range(0, x.shape[0], self.probe_rows)]  # clone: the next call reuses the memory
            out.append(tuple(torch.cat([r[j] for r in runs], dim=d) for j, d in ((0, 1), (1, 0), (2, 0))))
        return out

    def block_input(self, layer, kind, calls):
        """The block's own input inside the layer on the sequence's calls (its norm's output, tapped)."""
        tap = self.inputs.get((layer, kind))
        seq = [c for c in calls if not c.probe]
        taps = self.sequence_taps(seq) if tap and seq else []
        if not taps or any((layer, tap) not in t for t in taps):
            return None
        return [t[layer, tap][0] for t in taps]

    points_program = None  # (layer, kind, lengths) -> (points.pte, its points.json): ExecutorchBackend.points_program

    def run_block_points(self, layer, kind, calls):
        """The drill: the block alone, isolated on the reference's inputs, in a program lowered like
        the production one (ExecutorchBackend.points_program) with its points as extra outputs."""
        if self.points_program is None:
            return None
        from oracle.drill.points import from_outputs

        xs = [c.x.reshape(1, -1, c.x.shape[-1]).to(self.dtype) for c in calls]
        pte, meta = self.points_program(layer, kind, sorted({x.shape[1] for x in xs}))
        program = runtime().load_program(str(pte), data_path=str(weights_file(pte) or "") or None)
        state = [torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in meta["state"]]
        methods, fired, values = {}, [], []
        for x, c in zip(xs, calls):
            T = x.shape[1]
            if T not in methods:
                methods[T] = program.load_method(f"points_t{T}")
            pos = c.pos if c.pos.numel() == T else torch.arange(T)
            if c.tokens:  # the call's token ids where the block reads them (DeepSeek-V4's hash routers), as eager's
                state = [fed(s, c.tokens) if n.endswith(".call_tokens") else s
                         for s, n in zip(state, meta.get("state_names", ()))] or state
            outs = [o.clone() for o in methods[T].execute([x, pos, *state])]
            names, end = meta["fired"][str(T)], len(outs) - len(state)
            state = outs[end:]
            fired += names
            values += [o.float().numpy() for o in outs[end - len(names):end]]
        return from_outputs(fired, meta["registered"], values, meta.get("build_s"))

    def run_block(self, layer, kind, calls):
        if not self.taps:
            return None  # a production program (no taps, no probes): its blocks are not isolated
        seq = [c for c in calls if not c.probe]
        taps = self.sequence_taps(seq)
        if any((layer, kind) not in t for t in taps):
            return None  # no node of the program is this block's output (not tapped)
        if kind == "router" and not all(any(o.is_floating_point() for o in t[layer, kind]) for t in taps):
            # no node computes the routing weights (nothing downstream uses them): the router of the
            # layer's probe method on the program's own input to it, its weights as outputs
            xs = self.block_input(layer, kind, seq)
            if xs is None:
                raise ValueError("the program computes no routing weights (nothing uses them) and its "
                                 "router's input is not tapped: no router output to compare")
            seq_outs = iter([(w, idx) for _, w, idx in self.probe(layer, xs)])
        else:
            seq_outs = iter([block_output(kind, t[layer, kind]) for t in taps])
        probes = [c for c in calls if c.probe]
        if probes and kind not in ("router", "moe"):
            return None
        probe_outs = iter(self.probe(layer, [c.x for c in probes]) if probes else [])
        out = []
        for c in calls:
            if not c.probe:
                out.append(next(seq_outs))
            else:
                moe, w, idx = next(probe_outs)
                out.append((w, idx) if kind == "router" else moe)
        return out


class ExecutorchSamplingCandidate(ExecutorchCandidate):
    """A check program with the sampler's methods (oracle check --sampling). The harness is
    the runner: arguments are validated here, on the host (a program cannot refuse its inputs)."""

    def sample_prefill(self, tokens, temperature, top_p, seed) -> int:
        args = [torch.tensor([list(tokens)]), torch.arange(len(tokens)), *runtime_args(temperature, top_p, seed)]
        return int(self.method("sample_prefill").execute(args)[0][0])

    def sample_decode(self, token, pos, temperature, top_p, seed) -> int:
        args = [torch.tensor([[token]]), torch.tensor([pos]), *runtime_args(temperature, top_p, seed)]
        return int(self.method("sample_decode").execute(args)[0][0])

    def sample_logits(self, logits, temperature, top_p, seed) -> int:
        lg = torch.as_tensor(logits).reshape(1, -1).to(self.dtype)
        return int(self.method("sample_logits").execute([lg, *runtime_args(temperature, top_p, seed)])[0][0])


def fed(call_tokens: torch.Tensor, tokens) -> torch.Tensor:
    """A `call_tokens` state [B, S] with the call's token ids at [:, :T] (models.layers.hash_router.feed_tokens's, on
    the points program's state input)."""
    out = call_tokens.clone()
    out[:, :len(tokens)] = torch.tensor(list(tokens), dtype=out.dtype)
    return out


def block_output(kind: str, tensors: list):
    if kind == "router":
        w = next(t for t in tensors if t.is_floating_point())
        idx = next(t for t in tensors if not t.is_floating_point())
        return w, idx
    return tensors[0]
