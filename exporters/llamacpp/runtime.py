"""llama.cpp through ctypes, in a child process of its own (`python -m exporters.llamacpp serve`):
a GGUF loaded, sequences decoded with llama.cpp's own KV cache, the graph's named tensors read by the
eval callback (and the probes' inputs written over them)."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from pathlib import Path

import numpy as np

KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type


FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type


# ---------------------------------------------------------------- llama.cpp through ctypes

class _Tensor(ctypes.Structure):
    """The head of ggml.h's `struct ggml_tensor` (its layout is checked against ggml_get_name at load)."""

    _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int32), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


GGML_F32, GGML_I32 = 0, 26


@functools.cache
def ggml():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    for name, res, args in (("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
                            ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
                            ("ggml_is_contiguous", ctypes.c_bool, [ctypes.c_void_p]),
                            ("ggml_op_name", ctypes.c_char_p, [ctypes.c_int]),
                            ("ggml_backend_tensor_get", None, [ctypes.c_void_p] * 2 + [ctypes.c_size_t] * 2),
                            ("ggml_backend_tensor_set", None, [ctypes.c_void_p] * 2 + [ctypes.c_size_t] * 2)):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


LOG: list[str] = []  # llama.cpp's recent log lines (quiet; quoted in an error)


@functools.cache
def quiet_logs():
    import llama_cpp

    @llama_cpp.llama_log_callback
    def sink(level, text, user_data):
        LOG.append(text.decode(errors="replace"))
        del LOG[:-200]

    llama_cpp.llama_log_set(sink, None)
    llama_cpp.llama_backend_init()
    return sink  # kept alive by the cache


def log_tail(n: int = 4) -> str:
    """The last error lines llama.cpp logged (its own reason for a failed load)."""
    lines = [x.strip() for x in "".join(LOG).splitlines() if x.strip()]
    errs = [x for x in lines if "error" in x.lower() or "failed" in x.lower()] or lines
    return " | ".join(errs[-n:])


class Graph:
    """What one `llama_decode` computed, read by the eval callback: every f32 node's value by its
    pointer (`values`), the named ones by name (`named`: name -> pointer, the last of that name),
    and each node's op and operands (`nodes`: pointer -> (name, op, srcs)). `patch`: name -> array
    written over that node's value once it is computed (what its consumers then read)."""

    def __init__(self, record: bool, patch: dict | None = None, only: tuple = ()):
        self.record, self.patch, self.only = record, patch or {}, only  # only: record just these name prefixes
        self.values, self.named, self.nodes, self.order, self.patched = {}, {}, {}, [], set()

    def __call__(self, t, ask, user_data) -> bool:
        if ask:
            if self.only:
                return ggml().ggml_get_name(t).decode(errors="replace").startswith(self.only)
            return self.record or bool(self.patch)
        lib = ggml()
        s = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        name = lib.ggml_get_name(t).decode(errors="replace")
        if name in self.patch:
            x = np.ascontiguousarray(self.patch[name], dtype=np.float32)
            if s.type != GGML_F32 or not lib.ggml_is_contiguous(t) or x.nbytes != lib.ggml_nbytes(t):
                raise RuntimeError(f"cannot write {list(x.shape)} over {name} (type {s.type}, ne {list(s.ne)})")
            lib.ggml_backend_tensor_set(t, x.ctypes.data, 0, x.nbytes)
            self.patched.add(name)
        if not self.record:
            return True
        self.nodes[t] = (name, lib.ggml_op_name(s.op).decode(), [p for p in s.src if p])
        self.named[name] = t
        self.order.append(t)
        if s.type not in (GGML_F32, GGML_I32):
            return True
        dt = np.float32 if s.type == GGML_F32 else np.int32
        dims = [int(s.ne[i]) for i in range(4)]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        if lib.ggml_is_contiguous(t):
            n = lib.ggml_nbytes(t)
            a = np.empty(n // 4, dt)
            lib.ggml_backend_tensor_get(t, a.ctypes.data, 0, n)
            self.values[t] = a.reshape(dims[::-1])
        elif s.view_src in self.values and self.values[s.view_src].dtype == dt:  # a strided view of a node read
            base = self.values[s.view_src]
            self.values[t] = np.lib.stride_tricks.as_strided(
                base.reshape(-1)[s.view_offs // 4:], shape=dims[::-1],
                strides=[int(s.nb[i]) for i in range(len(dims))][::-1]).copy()
        return True

    def value(self, name: str):
        p = self.named.get(name)
        return None if p is None else self.values.get(p)

    def branch(self, p, stream, before_scale: bool = True, post_normed: bool = False) -> np.ndarray | None:
        """The operand of the ADD `p` (a pointer) that is not `stream`: the block's output added to
        the residual stream, read before a SCALE on it (a residual multiplier; `before_scale` False: the
        SCALE is the block's own, Cohere2-MoE's average of its routed and shared experts); `post_normed`:
        before the norm on it too (a post-norm: a MUL of an RMS_NORM/NORM, whose input is the block's output)."""
        if p is None or self.nodes[p][1] != "ADD":
            return None
        other = [q for q in self.nodes[p][2] if self.through(q) != self.through(stream)]
        if len(other) != 1:
            return None
        q = other[0]
        while before_scale and q in self.nodes and self.nodes[q][1] == "SCALE":  # the block's output is what is scaled
            q = self.nodes[q][2][0]
        if post_normed:  # (the last layer's post-norm seen through its output-row selection)
            q = self.through(q)
        if post_normed and q in self.nodes and self.nodes[q][1] == "MUL" and self.nodes[q][2]:
            n = self.nodes[q][2][0]
            if n in self.nodes and self.nodes[n][1] in ("RMS_NORM", "NORM") and self.nodes[n][2]:
                q = self.through(self.nodes[n][2][0])
        return self.values.get(q)

    def add_onto(self, stream, after):
        """The first ADD after node `after` with `stream` as an operand: the residual sum (llama.cpp
        names it per model: ffn_inp-L, attn_residual-L, ...)."""
        if stream is None or after not in self.nodes:
            return None
        for p in self.order[self.order.index(after) + 1:]:
            _, op, srcs = self.nodes[p]
            if op == "ADD" and any(self.through(q) == self.through(stream) for q in srcs):
                return p
        return None

    def layer(self, L: int, stream_fed: bool = False) -> dict:
        """Layer L's nodes (pointers): its input `stream`, the residual sum after its attention
        `mid`, its output `out` (l_out-L), its attention's input `attn_in` (attn_norm-L), its
        experts' or MLP's input `ffn_in` (the norm of `mid`; `stream_fed`: `mid` itself, a MoE block whose router
        and experts' norms are its own, beside a dense MLP: Gemma 4's, models.args.block_input_path)."""
        norm = next((n.format(L) for n in ATTN_NORMS if n.format(L) in self.named), f"attn_norm-{L}")
        attn_in = self.named.get(norm)
        stream = self.stream_into(norm)
        mid = self.add_onto(stream, attn_in)
        out = next((self.named[n.format(L)] for n in LAYER_OUTS if n.format(L) in self.named), None)
        ffn_in = mid if stream_fed else self.normed(mid) if mid is not None else None
        if mid is None and ffn_in is None and not stream_fed:  # no residual sum (hyper-connections, GLM-5.3's mHC):
            ffn_in = self.named.get(f"ffn_norm-{L}")  # the experts' input as llama.cpp names it
        # a parallel block (Cohere's): no norm after the first residual sum, which is the MLP's (fed attn_in)
        # output added to the stream; the layer's output adds the attention's to it
        parallel = ffn_in is None and mid is not None and out in self.nodes and mid in self.nodes[out][2]
        # one block a layer (Nemotron-H's: a mixer or an MLP alone, its one norm named attn_norm-L): the first residual
        # sum is the layer's output, and the block after that norm is the mixer or the MLP, whichever the layer has
        single = mid is not None and out is not None and self.through(mid) == self.through(out)
        return {"stream": stream, "mid": mid, "out": out, "attn_in": attn_in,
                "ffn_in": attn_in if parallel or single else ffn_in, "parallel": parallel, "single": single}

    def through(self, p):
        """`p` seen through row selections and views (the last layer keeps only the output rows)."""
        while p in self.nodes and self.nodes[p][1] in ("GET_ROWS", "VIEW", "RESHAPE", "CONT", "CPY") and self.nodes[p][2]:
            p = self.nodes[p][2][0]
        return p

    def normed(self, stream):
        """The first norm's output (a NORM/RMS_NORM times its weight) of `stream` (a pointer): what the
        block after it is fed (llama.cpp names it per model: ffn_norm-L, attn_post_norm-L, ...)."""
        for p in self.order:
            _, op, srcs = self.nodes[p]
            if op == "MUL" and srcs and srcs[0] in self.nodes and self.nodes[srcs[0]][1] in ("RMS_NORM", "NORM") \
                    and self.nodes[srcs[0]][2] and self.through(self.nodes[srcs[0]][2][0]) == self.through(stream):
                return p
        return None

    def dense_beside(self, mid, experts):
        """A MoE block fed the stream `mid` beside a dense MLP (Runner.stream_fed), `experts` its routed experts' sum
        (pointers): (its output, the experts' sum post-normed; the dense MLP's output, the other operand of the ADD of
        that, before its post-norm; the dense MLP's input, the norm of `mid` no MUL_MAT_ID reads)."""
        moe = self.normed(experts)
        dense = self.branch(self.add_onto(moe, moe), moe, post_normed=True) if moe is not None else None

        def norm_of_mid(p):  # a MUL of an RMS_NORM of `mid` (a norm times its weight)
            _, op, srcs = self.nodes[p]
            n = srcs[0] if op == "MUL" and srcs else None
            return n in self.nodes and self.nodes[n][1] == "RMS_NORM" and self.through(self.nodes[n][2][0]) == \
                self.through(mid)

        def read_by_experts(p):
            return any(self.nodes[q][1] == "MUL_MAT_ID" and any(self.through(x) == p for x in self.nodes[q][2])
                       for q in self.order)

        into = [p for p in self.order if norm_of_mid(p) and not read_by_experts(p)]
        return self.values.get(moe), dense, self.values.get(into[0]) if len(into) == 1 else None

    def stream_into(self, norm: str):
        """The pointer of the stream a norm named `norm` normalises (the RMS_NORM/NORM under it)."""
        p = self.named.get(norm)
        while p is not None and p in self.nodes and self.nodes[p][1] not in ("RMS_NORM", "NORM"):
            srcs = self.nodes[p][2]
            p = srcs[0] if srcs else None
        return None if p is None or p not in self.nodes else self.nodes[p][2][0]


# what llama.cpp's graphs name a layer's output: l_out-L, or Nemotron-H's nemotron_h_block_out-L (its l_out-L: the MoE's
# routed and shared experts' sum, before the residual)
LAYER_OUTS = ("nemotron_h_block_out-{0}", "l_out-{0}")
# what llama.cpp's graphs name a layer's norm before its attention (or the mixer in its place): attn_norm-L, or LFM2's
# HF-style name (its graph passes "model.layers.{}.operator_norm" to cb, which appends -L and keeps the braces)
ATTN_NORMS = ("attn_norm-{0}", "model.layers.{{}}.operator_norm-{0}")


class Runner:
    """llama.cpp on one GGUF, in the child process (`python -m exporters.llamacpp serve`): a
    GGML_ASSERT aborts that process, not the check."""

    def __init__(self, gguf: str, n_ctx: int, kv: str, flash_attn: str, threads: int, repack: str = "on"):
        import llama_cpp as L

        self.L = L
        quiet_logs()
        self.graph = Graph(record=False)
        self._cb = L.ggml_backend_sched_eval_callback(lambda t, ask, ud: self.graph(t, ask, ud))
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = repack == "on"  # the CPU's repacked weight buffers (AMX, interleaved quants)
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise LoadError(f"llama.cpp cannot load the GGUF: {log_tail()}")
        self.settings = (n_ctx, threads, KV_TYPES[kv], FLASH_ATTN[flash_attn])
        self.ctx = self.context()
        self.batch_ctx = None  # (sequences, context) of the invariance row's batch (made when first asked)
        if not self.ctx:
            raise LoadError(f"llama.cpp cannot make a context for the GGUF: {log_tail()}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_layer = L.llama_model_n_layer(self.model)
        self.ffn_inputs = {}  # layer -> the graph's name of its experts' input (probe)
        self.stream_fed = False  # the MoE block reads the stream itself (Graph.layer; set_stream_fed)
        g = self.record([0], [0])  # ggml_tensor's layout as Graph reads it: the name where ggml_get_name finds it
        p = next(iter(g.nodes), None)
        if p is None or ctypes.cast(p, ctypes.POINTER(_Tensor)).contents.name.decode() != g.nodes[p][0]:
            raise RuntimeError("this llama.cpp's ggml_tensor layout is not the one exporters/llamacpp/ reads")

    def context(self, sequences: int = 1, n_ctx: int | None = None):
        """A llama.cpp context of the model with this runner's settings, for `sequences` sequences at once (more
        than one: one KV cache the sequences share, kv_unified, so a batch keeps its tokens' order)."""
        L = self.L
        ctx, threads, kv, fa = self.settings
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx or ctx
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = kv
        cp.flash_attn_type = fa
        cp.cb_eval, cp.cb_eval_user_data = self._cb, None
        if sequences > 1:
            cp.n_seq_max, cp.kv_unified = sequences, True
        return L.llama_init_from_model(self.model, cp)

    def batch(self, prompts: list) -> tuple:
        """([logits [T_i, V] per prompt], [{layer: (indices, weights)} per prompt]): the prompts prefilled in one
        llama_decode, each its own sequence (seq_id), on a context made for that many sequences."""
        L = self.L
        n = sum(map(len, prompts))
        size = max(self.settings[0], n)
        if self.batch_ctx is None or self.batch_ctx[0] != (len(prompts), size):
            ctx = self.context(len(prompts), size)
            if not ctx:
                raise RuntimeError(f"llama.cpp cannot make a context for {len(prompts)} sequences: {log_tail()}")
            self.batch_ctx = ((len(prompts), size), ctx)
        ctx = self.batch_ctx[1]
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        batch = L.llama_batch_init(n, 0, 1)
        self.graph = Graph(record=True, only=("ffn_moe_topk", "ffn_moe_weights"))
        try:
            batch.n_tokens = n
            i = 0
            for seq, p in enumerate(prompts):
                for t, tok in enumerate(p):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(tok), t, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, True
                    i += 1
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}: {log_tail()}")
            out = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n * self.n_vocab,)).reshape(n, self.n_vocab).copy()
            routes = {layer: (r[1], r[0]) for layer in range(self.n_layer) if (r := router_of(self.graph, layer)) is not None}
        finally:
            self.graph = Graph(record=False)
            L.llama_batch_free(batch)
        starts = np.cumsum([0, *map(len, prompts)])
        return ([out[a:b] for a, b in zip(starts, starts[1:])],
                [{layer: (i[a:b], w[a:b]) for layer, (i, w) in routes.items()} for a, b in zip(starts, starts[1:])])

    def decode(self, tokens, pos, logits_all: bool) -> np.ndarray:
        L = self.L
        if pos[0] == 0:
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        n = len(tokens)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, (t, p) in enumerate(zip(tokens, pos)):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(t), int(p), 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = logits_all or i == n - 1
            rc = L.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}: {log_tail()}")
            rows = n if logits_all else 1
            out = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(rows * self.n_vocab,))
            return out.reshape(rows, self.n_vocab).copy()
        finally:
            L.llama_batch_free(batch)

    def set_stream_fed(self, on: bool) -> None:
        """The MoE blocks read the stream after the attention itself, their norms their own (Gemma 4's: the router
        RMS-normalises the stream, the experts read it through their own pre-norm, beside a dense MLP): their input is
        that stream, and their output the post-norm of the routed experts' sum (`moe_normed`)."""
        self.stream_fed, self.ffn_inputs = bool(on), {}

    def tensors(self, tokens, pos, names) -> dict:
        """name -> value of the named f32/i32 tensors `names` of one recorded decode (what a test reads off the
        graph to show a divergence's cause)."""
        g = self.record(tokens, pos)
        return {n: g.value(n) for n in names if g.value(n) is not None}

    def routed(self, tokens, pos, logits_all: bool) -> tuple:
        """(logits, {layer: (indices [T, k], weights [T, k])}): a decode with only the routers' choices read
        off the graph (`ffn_moe_topk-L` and the last `ffn_moe_weights*-L`: router_of), for routing replay."""
        self.graph = Graph(record=True, only=("ffn_moe_topk", "ffn_moe_weights"))
        try:
            logits = self.decode(tokens, pos, logits_all)
            routes = {}
            for L in range(self.n_layer):
                r = router_of(self.graph, L)
                if r is not None:
                    routes[L] = (r[1], r[0])
            return logits, routes
        finally:
            self.graph = Graph(record=False)

    def record(self, tokens, pos, patch=None) -> Graph:
        self.graph = Graph(record=True, patch=patch)
        try:
            self.decode(tokens, pos, logits_all=True)
            return self.graph
        finally:
            self.graph = Graph(record=False)

    def blocks(self, tokens, pos, patch=None, post_normed: bool = False) -> dict:
        """(layer, kind) -> output of one recorded call: a layer, its attention and its experts (or
        MLP, "ffn"), their own inputs ("input:attention", "input:ffn"), its router; the final norm
        and the logits."""
        g = self.record(tokens, pos, patch)
        if set(patch or ()) - g.patched:
            raise RuntimeError(f"no node of llama.cpp's graph is named {', '.join(sorted(set(patch) - g.patched))}: "
                               "the expert probes' inputs cannot be written")
        out = {}
        for L in range(self.n_layer):
            n = g.layer(L, self.stream_fed)
            if n["single"]:  # its one block, read as the attention or the MLP, whichever the layer has
                attention = ffn = g.branch(n["out"], n["stream"], post_normed=post_normed)
            elif n["parallel"]:  # the layer's output is (MLP + stream) + attention
                attention = g.branch(n["out"], n["mid"])
                ffn = g.branch(n["mid"], n["stream"], before_scale=False)
            else:
                attention = g.branch(n["mid"], n["stream"], post_normed=post_normed)
                ffn = g.branch(n["out"], n["mid"], post_normed=post_normed)
            for key, v in (((L, "layer"), g.values.get(n["out"])),
                           ((L, "attention"), attention),
                           ((L, "ffn"), ffn),
                           # the routed experts' sum alone (a shared MLP beside the MoE block is added after it)
                           ((L, "experts"), g.value(f"ffn_moe_out-{L}")),
                           ((L, "input:attention"), g.values.get(n["attn_in"])),
                           ((L, "input:ffn"), g.values.get(n["ffn_in"])),
                           ((L, "router"), router_of(g, L))):
                if v is not None:
                    out[key] = v
            if self.stream_fed and f"ffn_moe_out-{L}" in g.named:  # the MoE block and the dense MLP beside it
                beside = g.dense_beside(n["mid"], g.named[f"ffn_moe_out-{L}"])
                for key, v in zip(((L, "moe_normed"), (L, "ffn"), (L, "input:mlp")), beside):
                    if v is not None:
                        out[key] = v
        for key, name in (((None, "final_norm"), "result_norm"), ((None, "logits"), "result_output")):
            if g.value(name) is not None:
                out[key] = g.value(name)
        return out


    def names(self) -> dict:
        """The structure of llama.cpp's graph: how many tensors of each name (the layer suffix dropped)
        one decode of two tokens computes."""
        g = self.record([0, 1], [0, 1])
        counts: dict = {}
        for p in g.order:
            # "Qcur-0 (view) (permuted)" -> Qcur, "cache_k_l1 (view)" -> cache_k_l, "node_32" -> node
            name = re.sub(r"^node_\d+$", "node", re.sub(r"(-\d+|_l\d+)$", "", g.nodes[p][0].split(" (")[0]))
            name = name or "(unnamed)"
            counts[name] = counts.get(name, 0) + 1
        return counts

    def ffn_input(self, layer: int) -> str:
        """The graph's name of layer L's experts' input (Graph.layer's `ffn_in`, found in a one-token run)."""
        if layer not in self.ffn_inputs:
            g = self.record([0], [0])
            p = g.layer(layer, self.stream_fed)["ffn_in"]
            name = None if p is None else g.nodes[p][0]
            if name is None or sum(g.nodes[q][0] == name for q in g.order) != 1:
                raise RuntimeError(f"layer {layer}'s experts' input is not one named node of llama.cpp's graph "
                                   f"({name!r}): the expert probes cannot be written")
            self.ffn_inputs[layer] = name
        return self.ffn_inputs[layer]

    def probe(self, layer: int, x, moe: str = "ffn", post_normed: bool = False) -> tuple:
        """(the layer's experts' output, its routing) on `x` [N, H]: `x` written over the experts'
        input in a sequence of its own (`moe`: the blocks' entry read as the experts' output, "ffn" or
        "experts"; `post_normed`: read before the block's post-norm, as blocks() reads it)."""
        b = self.blocks([0] * x.shape[0], list(range(x.shape[0])), {self.ffn_input(layer): x}, post_normed)
        return b.get((layer, moe)), b.get((layer, "router"))

    # the drill's points of a router and a MoE (oracle/drill/points.py) as llama.cpp names them (build_moe_ffn)
    # (point, llama.cpp's names, the first it has: a router's bias added, a group-limited choice's masking)
    MOE_POINTS = (("logits", ("ffn_moe_logits_biased", "ffn_moe_logits")), ("scores", ("ffn_moe_probs",)),
                  ("selection", ("ffn_moe_probs_masked", "ffn_moe_probs_biased")), ("topk", ("ffn_moe_topk",)),
                  ("weights", ()), ("experts", ("ffn_moe_out",)), ("shared_expert_gate", ("ffn_shexp_gate_inp",)),
                  ("shared_expert", ("ffn_shexp",)))

    def points(self, layer: int, x) -> dict:
        """The router's and the experts' points of layer L on `x` [N, H] written over the experts' input
        (a sequence of its own: what follows the attention depends on no position): point -> value,
        in the graph's order, where the graph has it; "output", the block's."""
        g = self.record([0] * x.shape[0], list(range(x.shape[0])), {self.ffn_input(layer): x})
        routing = router_of(g, layer)
        # a gating that chooses on the logits themselves (softmax over the chosen weights only: gpt-oss) names
        # its (biased) logits ffn_moe_probs: no activation made them, so they are the logits, and there are no scores
        probs = g.named.get(f"ffn_moe_probs-{layer}")
        logits_only = probs is not None and g.nodes[probs][1] in ("ADD", "MUL_MAT")
        found = {}
        for point, names in self.MOE_POINTS:
            if logits_only and point in ("logits", "scores"):
                names = ("ffn_moe_probs",) if point == "logits" else ()
            v = routing[0] if point == "weights" and routing else next(
                (v for n in names if (v := g.value(f"{n}-{layer}")) is not None), None)
            if v is not None:
                found[point] = v.reshape(x.shape[0], -1).astype(np.float32)
        n = g.layer(layer, self.stream_fed)
        out = g.branch(n["mid"], n["stream"], before_scale=False) if n["parallel"] else g.branch(
            n["out"], n["stream"] if n["single"] else n["mid"])
        if out is not None:
            found["output"] = out.reshape(x.shape[0], -1)
        return found


class LoadError(RuntimeError):
    """llama.cpp refused the GGUF (its loader's reason)."""


def router_of(g: Graph, L: int):
    """(weights [T, k], indices [T, k]) of layer L's routing: `ffn_moe_topk-L` and the last
    `ffn_moe_weights*-L` (after llama.cpp's softmax, normalisation and scaling, as HF's router returns)."""
    idx = g.value(f"ffn_moe_topk-{L}")
    if idx is None:
        return None
    weights = [t for t in g.order if g.nodes[t][0].startswith("ffn_moe_weights") and
               g.nodes[t][0].endswith(f"-{L}") and t in g.values]
    k = idx.shape[-1]
    return None if not weights else (g.values[weights[-1]].reshape(-1, k), idx.reshape(-1, k).astype(np.int64))


def serve(gguf: str, n_ctx: str, kv: str, flash_attn: str, threads: str, repack: str) -> None:
    """The child: requests (method, args) pickled on stdin, (ok, value) pickled on the stdout it was
    started with (fd 1 itself is pointed at stderr: nothing llama.cpp prints can corrupt the channel)."""
    import pickle

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    try:
        r = Runner(gguf, int(n_ctx), kv, flash_attn, int(threads), repack)
        pickle.dump((True, {"n_vocab": r.n_vocab, "n_layer": r.n_layer}), out)
    except Exception as e:  # noqa: BLE001 - its reason goes to the parent
        pickle.dump((False, (type(e).__name__, str(e))), out)
        out.flush()
        return
    out.flush()
    while True:
        try:
            method, args = pickle.load(inp)
        except EOFError:
            return
        try:
            pickle.dump((True, getattr(r, method)(*args)), out)
        except Exception as e:  # noqa: BLE001
            pickle.dump((False, (type(e).__name__, str(e))), out)
        out.flush()
