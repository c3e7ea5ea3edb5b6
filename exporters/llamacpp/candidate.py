"""A GGUF run by llama.cpp as a candidate: prefill and decode, the block rows read off the graph's
tensors in-situ, the expert probes and the drill of routers and MoEs written over a block's input."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from exporters.llamacpp.runtime import LoadError
from oracle.backend import Candidate

SEQ_MODE, PROBE_MODE = "in-situ", "isolated"


class LlamaCppCandidate(Candidate):
    """A GGUF run by llama.cpp in a child process (`python -m exporters.llamacpp serve`): logits from
    `llama_decode`, block rows from its eval callback."""

    block_mode = SEQ_MODE
    block_modes = {k: f"{SEQ_MODE} (sequence) + {PROBE_MODE} (expert probes)" for k in ("router", "moe")}

    def __init__(self, gguf: Path, n_ctx: int, kv: str, info: dict, threads: int | None = None,
                 flash_attn: str = "auto", repack: str = "on"):
        self.info, self.gguf = info, Path(gguf)
        threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "exporters.llamacpp", "serve", str(gguf), str(n_ctx), kv,
                                      flash_attn, str(threads), repack], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, cwd=Path(__file__).resolve().parents[2])
        head = self._reply()
        self.n_vocab, self.n_layer = head["n_vocab"], head["n_layer"]
        self._seq = (None, None)
        # the graph's tensor a MoE block's row reads: the FFN branch ("ffn"), or the routed experts' sum alone
        # ("experts": where a shared MLP sits beside the MoE block, ModelArgs.shared_expert_beside)
        self.moe_tensor = "ffn"
        # post or sandwich norms (models.args.NormArgs.placement): a block's output is what its post-norm normalises
        self.post_normed = False

    def _reply(self):
        import pickle

        try:
            ok, value = pickle.load(self.proc.stdout)
        except EOFError:
            self.proc.wait()
            self._stderr.seek(0)
            lines = [x for x in self._stderr.read().decode(errors="replace").splitlines() if x.strip()]
            why = next((x for x in lines if "GGML_ASSERT" in x or "error" in x.lower()), lines[-1] if lines else "")
            raise RuntimeError(f"llama.cpp aborted (exit {self.proc.returncode}): {why.strip()[-600:]}") from None
        if not ok:
            name, msg = value
            raise (LoadError if name == "LoadError" else RuntimeError)(msg)
        return value

    def _call(self, method: str, *args):
        import pickle

        if self.proc.poll() is not None:
            raise RuntimeError(f"llama.cpp's process ended (exit {self.proc.returncode})")
        pickle.dump((method, args), self.proc.stdin)
        self.proc.stdin.flush()
        return self._reply()

    def close(self):
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=30)

    __del__ = close

    def prefill(self, tokens):
        logits, self.routes = self._call("routed", list(tokens), list(range(len(tokens))), True)
        return logits

    routes: dict = {}
    no_chunks = None  # extend: llama_decode of the chunk at its positions, the KV cache carried

    def extend(self, tokens, pos):
        logits, self.routes = self._call("routed", list(tokens), list(range(pos, pos + len(tokens))), True)
        return logits

    def batch(self, prompts):
        """The prompts in one llama_decode, each its own sequence (llama.cpp's batch API: no padding)."""
        return self._call("batch", [list(p) for p in prompts])

    def last_routes(self):
        return self.routes

    def structures(self) -> dict:
        """The structural golden: the histogram of the named tensors of llama.cpp's graph."""
        from oracle.verdict.goldens import histogram_text

        return {"graph_tensors": histogram_text(self._call("names"), "tensor names of llama.cpp's graph "
                                                "(a decode of two tokens; the layer suffix -N dropped)")}

    def decode(self, token, pos):
        logits, self.routes = self._call("routed", [int(token)], [int(pos)], False)
        return logits[0]

    def sequence(self, calls) -> list[dict]:
        """Per call of the sequence: (layer, kind) -> output, from one recorded run."""
        key = tuple((tuple(c.tokens), tuple(c.pos.tolist())) for c in calls)
        if self._seq[0] != key:
            if calls and int(calls[0].pos[0]) != 0:
                raise ValueError("the block calls must start a sequence at position 0")
            self._seq = (key, [self._call("blocks", list(c.tokens), c.pos.tolist(), None, self.post_normed)
                                for c in calls])
        return self._seq[1]

    def block_input(self, layer, kind, calls):
        seq = [c for c in calls if not c.probe]
        rows = self.sequence(seq) if seq else []
        name = (layer, "input:attention" if kind == "attention" else "input:ffn")
        if kind == "mlp" and rows and all((layer, "input:mlp") in r for r in rows):  # a dense MLP beside a MoE block
            name = (layer, "input:mlp")
        if not rows or any(name not in r for r in rows):
            return None
        return [r[name] for r in rows]

    def run_block_points(self, layer, kind, calls):
        """The drill (oracle/drill/points.py) of a router or a MoE: each call's input written over the experts'
        input (Runner.points); None for the other kinds (their points are not mapped: the drill says so)."""
        if kind not in ("router", "moe"):
            return None
        from oracle.drill.points import Recorder

        rec = Recorder(taps=("logits", "scores", "selection", "topk", "weights"))
        for c in calls:
            x = np.asarray(c.x_array, np.float32)
            for name, v in self._call("points", layer, x.reshape(-1, x.shape[-1])).items():
                if not (kind == "router" and name in ("experts", "shared_expert_gate", "shared_expert", "output")):
                    rec.add(name, v)
        have = set(rec.points)
        rec.points.registered = [p for p in ("experts", "shared_expert_gate", "shared_expert") if p in have]
        rec.points.taps = {t for t in rec.points.taps if t in have}  # exposed: a missing one is n/a, not skipped
        return rec.points

    def probe(self, layer: int, xs: list) -> list[tuple]:
        """(block output, (weights, indices)) per input: Runner.probe."""
        return [self._call("probe", layer, np.asarray(x, np.float32).reshape(-1, x.shape[-1]), self.moe_tensor,
                           self.post_normed) for x in xs]

    def run_block(self, layer, kind, calls):
        seq = [c for c in calls if not c.probe]
        probes = [c for c in calls if c.probe]
        if probes and kind not in ("router", "moe"):
            return None
        name = (layer, self.moe_tensor if kind == "moe" else "ffn" if kind == "mlp" else kind)
        rows = self.sequence(seq) if seq else []
        if any(name not in r for r in rows):
            return None  # not in this graph (a name llama.cpp's graph of the model does not give)
        outs = [r[name][None] if kind != "router" else r[name] for r in rows]
        for moe, router in self.probe(layer, [c.x_array for c in probes]) if probes else []:
            outs.append(router if kind == "router" else moe[None])
        return outs
