"""llama.cpp as a backend: the checkpoint converted to GGUF by llama.cpp's own converter, run by
llama.cpp (llama-cpp-python's build of it) with its own KV cache.

- **Export**: `convert_hf_to_gguf.py` and its `conversion/` package and `gguf-py`, from the
  llama-cpp-python source distribution of the installed version (the wheel has none of them:
  `python -m exporters.llamacpp setup`, run by `make setup`, fetches that sdist from the package
  registry and keeps those three in `<env>/share/moe-oracle/llama.cpp/<version>/`; never a copy in this
  repository). The converter runs in a child process (it puts its own `gguf` first on sys.path),
  one a process that converts GGUF after GGUF (`Converter`: its imports paid once).
  A tiny checkpoint has no tokenizer: the converter's `set_vocab` is given a synthetic SPM
  vocabulary of `vocab_size` tokens (the check feeds token ids; llama.cpp never tokenizes).
  `--option outtype=` f32 (the fp32 check's), bf16, q8_0 (the converter's own types), or a
  llama-quantize type (Q8_0, Q6_K, Q5_K_M, Q4_K_M: `llama_model_quantize` on the f32 GGUF), the
  quantized ones for `oracle export` (then checked with `--gguf`).
- **A GGUF as shipped** (`--gguf`, `artifact_weights`): exporters/llamacpp_gguf.py.
- **Run**: prefill is one `llama_decode` of the tokens, decode one token at its position, the KV
  cache llama.cpp's (`--option kv=f32|f16`: f32 at fp32, f16 what users run by default; likewise
  `flash_attn` and `repack`, the CPU's repacked weight buffers: off at fp32, llama.cpp's default else).
- **Block rows, in-situ**: the eval callback (`cb_eval`) reads the graph's tensors while the
  sequence runs: a layer is `l_out-L`, its attention the branch added to the stream into
  `ffn_inp-L` (the operand of that ADD that is not the layer's input, a residual SCALE undone), its
  experts the branch added into `l_out-L`, its router `ffn_moe_topk-L` and the last
  `ffn_moe_weights*-L`, the final norm `result_norm`, the logits `result_output`; each block's own
  input is its norm's output (`attn_norm-L`, `ffn_norm-L`: Candidate.block_input). The expert
  probes (the reference's inputs to a MoE) are run by writing them over `ffn_norm-L` in the
  callback, in a sequence of their own; so is the drill of a router or a MoE (its points:
  `ffn_moe_logits`, `ffn_moe_probs`, `ffn_moe_probs_biased`, `ffn_moe_topk`, `ffn_moe_weights*`,
  `ffn_moe_out`, `ffn_shexp_gate_inp`, `ffn_shexp`). Attention's points are not mapped (the
  converter permutes q/k rows for some architectures): its drill is n/a.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from oracle.artifacts import Artifact, cached_artifact, sha256_file, versions
from models.cache import estimate
from oracle.backend import Backend, Candidate, InputError, Option
from exporters.llamacpp_setup import PACKAGE, converter_dir, converter_problem, installed_version, setup

# the converter's own output types, and llama-quantize's (from the f32 GGUF) that users ship
CONVERTER_TYPES = ("f32", "bf16", "f16", "q8_0")
QUANTIZE_TYPES = {"Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q4_K_M": 15}  # llama_ftype values
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
SEQ_MODE, PROBE_MODE = "in-situ", "isolated"


# ---------------------------------------------------------------- conversion (child process)

def convert(model_dir: Path, out: Path, outtype: str) -> dict:
    """The checkpoint at `model_dir` as a GGUF at `out` by llama.cpp's converter (in CONVERTER's child
    process). InputError with the converter's own reason where it does not support the model."""
    rc, result, text = CONVERTER.run(Path(model_dir), Path(out), outtype)
    if rc != 0:
        # the converter's own reason: its last exception line (or its message of an unsupported model)
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        reason = next((x for x in reversed(lines) if "not supported" in x or
                       (x.split(":", 1)[0].endswith(("Error", "Exception")) and " " not in x.split(":", 1)[0])),
                      lines[-1] if lines else f"exit {rc}")
        where = next((x for x in reversed(lines) if x.startswith("File ") and "/conversion/" in x), "")
        where = f" (at {where.split('/conversion/', 1)[1]})" if where else ""
        raise InputError(f"llama.cpp's converter (convert_hf_to_gguf.py of {PACKAGE} {installed_version()}) cannot "
                         f"convert this checkpoint: {reason}{where}")
    return result


class Converter:
    """llama.cpp's converter in one child process that converts one checkpoint after another (`python -m
    exporters.llamacpp convert-server`): its imports (torch and the converter, 3-4 s of a tiny checkpoint's
    4.6 s) paid once per process, not per GGUF. A child process still (the converter puts its own `gguf`
    first on sys.path); each conversion's output goes to a file of its own; a child that holds more than
    RECYCLE_BYTES after a conversion (a real-width one) is ended, and one that died (a crash, the
    kernel's OOM killer) is that conversion's error and replaced by the next."""

    RECYCLE_BYTES = 3 << 29  # 1.5 GiB: after a tiny checkpoint's conversion the child holds about 0.35 GiB

    def __init__(self):
        self.proc, self.where = None, None
        self.lock = threading.Lock()

    def run(self, model_dir: Path, out: Path, outtype: str) -> tuple[int, dict | None, str]:
        """(exit status, the converter's summary or None, its output)."""
        with self.lock:
            where = str(converter_dir())
            if self.proc is not None and (self.proc.poll() is not None or self.where != where):
                self.close()
            if self.proc is None:
                self.proc = subprocess.Popen([sys.executable, "-m", "exporters.llamacpp", "convert-server", where],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             cwd=Path(__file__).resolve().parent.parent)
                self.where = where
            fd, log = tempfile.mkstemp(prefix="moe-oracle-convert-", suffix=".log")
            os.close(fd)
            try:
                try:
                    self.proc.stdin.write(json.dumps({"model_dir": str(model_dir), "out": str(out),
                                                      "outtype": outtype, "log": log}) + "\n")
                    self.proc.stdin.flush()
                    line = self.proc.stdout.readline()
                except (BrokenPipeError, OSError):
                    line = ""
                except BaseException:  # interrupted: its reply would answer the next conversion's question
                    self.proc.kill()
                    self.close()
                    raise
                text = Path(log).read_text(errors="replace")
            finally:
                os.unlink(log)
            if not line:  # the child died during the conversion
                rc = self.proc.wait()
                self.proc = None
                return rc or 1, None, text
            reply = json.loads(line)
            if reply["held"] > self.RECYCLE_BYTES:
                self.close()
            return reply["rc"], reply["result"], text

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


CONVERTER = Converter()
# a process forked from this one (a matrix's or a self-test's warm server) starts its own child: the pipes of
# this one's are not its to write
os.register_at_fork(after_in_child=CONVERTER.__init__)


def _convert_server(where: str) -> None:
    """In the child: conversions read from stdin (one JSON object a line), each with its stdout and stderr
    in the file it names; one reply line each ({"rc", "result", "held": resident bytes}) on the original stdout."""
    import resource
    import traceback

    from oracle.check import resident_bytes

    sys.path[:0] = [where, str(Path(where) / "gguf-py")]
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        job = json.loads(line)
        saved = os.dup(1), os.dup(2)
        with open(job["log"], "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            rc, result = 0, None
            try:
                result = _convert(job["model_dir"], job["out"], job["outtype"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - the conversion's error, told to the parent
                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
        # what it keeps now (Linux's ru_maxrss would include the parent's resident memory at the fork before exec)
        held = resident_bytes()
        if held is None:
            held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        replies.write(json.dumps({"rc": rc, "result": result, "held": held}) + "\n")
        replies.flush()


def _convert_main(model_dir: str, out: str, outtype: str) -> None:
    """`python -m exporters.llamacpp convert`: one conversion, its summary printed as JSON."""
    d = converter_dir()
    sys.path[:0] = [str(d), str(d / "gguf-py")]
    print(json.dumps(_convert(model_dir, out, outtype)))


def _convert(model_dir: str, out: str, outtype: str) -> dict:
    """In the child: llama.cpp's converter, with a synthetic vocabulary where the checkpoint has no tokenizer
    (the converter's directory and its gguf-py first on sys.path); its summary."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    hparams = ModelBase.load_hparams(Path(model_dir), False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    try:
        cls = get_model_class(arch)
    except NotImplementedError:
        print(f"Error: model architecture {arch} is not supported by convert_hf_to_gguf.py", file=sys.stderr)
        sys.exit(3)
    if getattr(cls, "supports_mtp_export", False):
        cls.no_mtp = True  # --no-mtp: the check is of the model, not of a multi-token-prediction head
    tokenizer = any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    with torch.inference_mode():
        model = cls(Path(model_dir), ftype, Path(out))
        if not tokenizer:
            n = hparams.get("vocab_size") or hparams.get("text_config", {}).get("vocab_size")

            def synthetic_vocab():
                w = model.gguf_writer
                w.add_tokenizer_model("llama")
                w.add_tokenizer_pre("default")
                w.add_token_list([f"<t{i}>".encode() for i in range(n)])
                w.add_token_scores([0.0] * n)
                w.add_token_types([gguf.TokenType.NORMAL] * n)

            model.set_vocab = synthetic_vocab
        model.write()
    return {"architecture": arch, "gguf_arch": model.model_arch_name if hasattr(model, "model_arch_name")
            else str(model.model_arch), "synthetic_vocab": not tokenizer}


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
def _quiet_logs():
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

    def branch(self, p, stream) -> np.ndarray | None:
        """The operand of the ADD `p` (a pointer) that is not `stream`: the block's output added to
        the residual stream, read before a SCALE on it (a residual multiplier)."""
        if p is None or self.nodes[p][1] != "ADD":
            return None
        other = [q for q in self.nodes[p][2] if self.through(q) != self.through(stream)]
        if len(other) != 1:
            return None
        q = other[0]
        while q in self.nodes and self.nodes[q][1] == "SCALE":  # the block's output is what is scaled
            q = self.nodes[q][2][0]
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

    def layer(self, L: int) -> dict:
        """Layer L's nodes (pointers): its input `stream`, the residual sum after its attention
        `mid`, its output `out` (l_out-L), its attention's input `attn_in` (attn_norm-L), its
        experts' or MLP's input `ffn_in` (the norm of `mid`)."""
        attn_in = self.named.get(f"attn_norm-{L}")
        stream = self.stream_into(f"attn_norm-{L}")
        mid = self.add_onto(stream, attn_in)
        return {"stream": stream, "mid": mid, "out": self.named.get(f"l_out-{L}"), "attn_in": attn_in,
                "ffn_in": self.normed(mid) if mid is not None else None}

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

    def stream_into(self, norm: str):
        """The pointer of the stream a norm named `norm` normalises (the RMS_NORM/NORM under it)."""
        p = self.named.get(norm)
        while p is not None and p in self.nodes and self.nodes[p][1] not in ("RMS_NORM", "NORM"):
            srcs = self.nodes[p][2]
            p = srcs[0] if srcs else None
        return None if p is None or p not in self.nodes else self.nodes[p][2][0]


class Runner:
    """llama.cpp on one GGUF, in the child process (`python -m exporters.llamacpp serve`): a
    GGML_ASSERT aborts that process, not the check."""

    def __init__(self, gguf: str, n_ctx: int, kv: str, flash_attn: str, threads: int, repack: str = "on"):
        import llama_cpp as L

        self.L = L
        _quiet_logs()
        self.graph = Graph(record=False)
        self._cb = L.ggml_backend_sched_eval_callback(lambda t, ask, ud: self.graph(t, ask, ud))
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = repack == "on"  # the CPU's repacked weight buffers (AMX, interleaved quants)
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise LoadError(f"llama.cpp cannot load the GGUF: {log_tail()}")
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = KV_TYPES[kv]
        cp.flash_attn_type = FLASH_ATTN[flash_attn]
        cp.cb_eval, cp.cb_eval_user_data = self._cb, None
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise LoadError(f"llama.cpp cannot make a context for the GGUF: {log_tail()}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_layer = L.llama_model_n_layer(self.model)
        self.ffn_inputs = {}  # layer -> the graph's name of its experts' input (probe)
        g = self.record([0], [0])  # ggml_tensor's layout as Graph reads it: the name where ggml_get_name finds it
        p = next(iter(g.nodes), None)
        if p is None or ctypes.cast(p, ctypes.POINTER(_Tensor)).contents.name.decode() != g.nodes[p][0]:
            raise RuntimeError("this llama.cpp's ggml_tensor layout is not the one exporters/llamacpp.py reads")

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

    def blocks(self, tokens, pos, patch=None) -> dict:
        """(layer, kind) -> output of one recorded call: a layer, its attention and its experts (or
        MLP, "ffn"), their own inputs ("input:attention", "input:ffn"), its router; the final norm
        and the logits."""
        g = self.record(tokens, pos, patch)
        if set(patch or ()) - g.patched:
            raise RuntimeError(f"no node of llama.cpp's graph is named {', '.join(sorted(set(patch) - g.patched))}: "
                               "the expert probes' inputs cannot be written")
        out = {}
        for L in range(self.n_layer):
            n = g.layer(L)
            for key, v in (((L, "layer"), g.values.get(n["out"])),
                           ((L, "attention"), g.branch(n["mid"], n["stream"])),
                           ((L, "ffn"), g.branch(n["out"], n["mid"])),
                           ((L, "input:attention"), g.values.get(n["attn_in"])),
                           ((L, "input:ffn"), g.values.get(n["ffn_in"])),
                           ((L, "router"), router_of(g, L))):
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
            p = g.layer(layer)["ffn_in"]
            name = None if p is None else g.nodes[p][0]
            if name is None or sum(g.nodes[q][0] == name for q in g.order) != 1:
                raise RuntimeError(f"layer {layer}'s experts' input is not one named node of llama.cpp's graph "
                                   f"({name!r}): the expert probes cannot be written")
            self.ffn_inputs[layer] = name
        return self.ffn_inputs[layer]

    def probe(self, layer: int, x) -> tuple:
        """(the layer's experts' output, its routing) on `x` [N, H]: `x` written over the experts'
        input in a sequence of its own."""
        b = self.blocks([0] * x.shape[0], list(range(x.shape[0])), {self.ffn_input(layer): x})
        return b.get((layer, "ffn")), b.get((layer, "router"))

    # the drill's points of a router and a MoE (oracle/points.py) as llama.cpp names them (build_moe_ffn)
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
        n = g.layer(layer)
        out = g.branch(n["out"], n["mid"])
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


def _serve(gguf: str, n_ctx: str, kv: str, flash_attn: str, threads: str, repack: str) -> None:
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


class LlamaCppCandidate(Candidate):
    """A GGUF run by llama.cpp in a child process (exporters.llamacpp serve): logits from
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
                                     stderr=self._stderr, cwd=Path(__file__).resolve().parent.parent)
        head = self._reply()
        self.n_vocab, self.n_layer = head["n_vocab"], head["n_layer"]
        self._seq = (None, None)

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

    def last_routes(self):
        return self.routes

    def structures(self) -> dict:
        """The structural golden: the histogram of the named tensors of llama.cpp's graph."""
        from oracle.goldens import histogram_text

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
            self._seq = (key, [self._call("blocks", list(c.tokens), c.pos.tolist()) for c in calls])
        return self._seq[1]

    def block_input(self, layer, kind, calls):
        seq = [c for c in calls if not c.probe]
        rows = self.sequence(seq) if seq else []
        name = (layer, "input:attention" if kind == "attention" else "input:ffn")
        if not rows or any(name not in r for r in rows):
            return None
        return [r[name] for r in rows]

    def run_block_points(self, layer, kind, calls):
        """The drill (oracle/points.py) of a router or a MoE: each call's input written over the experts'
        input (Runner.points); None for the other kinds (their points are not mapped: the drill says so)."""
        if kind not in ("router", "moe"):
            return None
        from oracle.points import Recorder

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
        return [self._call("probe", layer, np.asarray(x, np.float32).reshape(-1, x.shape[-1])) for x in xs]

    def run_block(self, layer, kind, calls):
        seq = [c for c in calls if not c.probe]
        probes = [c for c in calls if c.probe]
        if probes and kind not in ("router", "moe"):
            return None
        name = (layer, "ffn" if kind in ("moe", "mlp") else kind)
        rows = self.sequence(seq) if seq else []
        if any(name not in r for r in rows):
            return None  # not in this graph (a name llama.cpp's graph of the model does not give)
        outs = [r[name][None] if kind != "router" else r[name] for r in rows]
        for moe, router in self.probe(layer, [c.x_array for c in probes]) if probes else []:
            outs.append(router if kind == "router" else moe[None])
        return outs


class LlamaCppBackend(Backend):
    """llama.cpp on a GGUF converted by its own converter from the checkpoint (cached)."""

    name = "llamacpp"
    runs_torch = False
    cache_namespaces = ("llamacpp", "llamacpp-map")
    artifact_suffix = ".gguf"  # --gguf FILE: a GGUF as shipped (exporters/llamacpp_gguf.py)
    precisions = ("fp32", "bf16")
    option_schema = (
        Option("outtype", str, CONVERTER_TYPES + tuple(QUANTIZE_TYPES), None,
               "the GGUF's type: the converter's (f32: the fp32 check's; bf16: the bf16 check's) or a "
               "llama-quantize type from the f32 GGUF"),
        Option("kv", str, tuple(KV_TYPES), None, "the KV cache's type (default f32 at fp32, f16 otherwise: "
               "llama.cpp's default, what users run)"),
        Option("flash_attn", str, tuple(FLASH_ATTN), None, "llama.cpp's flash attention (default off at fp32: "
               "its CPU kernel reads K and V as f16 whatever the cache's type; auto otherwise, llama.cpp's default)"),
        Option("repack", str, ("on", "off"), None, "llama.cpp's CPU extra buffer types for quantized weights "
               "(AMX where the CPU has it, interleaved repacking): default off at fp32, on otherwise (llama.cpp's "
               "default). On an AMX host llama.cpp 0.3.36 crashes on tiny Q8_0 models with them (docs/llamacpp.md)"),
    )

    def __init__(self, name: str = "llamacpp", transform=None, transform_id: str | None = None):
        self.name, self.transform, self.transform_id = name, transform, transform_id

    def availability(self):
        if installed_version() is None:
            return False, f"{PACKAGE} not installed (pip install 'moe-oracle[llamacpp]': a source build of llama.cpp)"
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:  # noqa: BLE001 - a broken build: say why
            return False, f"llama_cpp cannot be imported: {type(e).__name__}: {e}"
        problem = converter_problem()
        return (False, problem) if problem else (True, "")

    def settings(self, spec) -> tuple[str, str, str, str]:
        """(outtype, kv, flash_attn, repack): at fp32 an f32 GGUF, an f32 KV cache, no flash attention and
        no repacked weight buffers; else a bf16 GGUF with llama.cpp's defaults (f16 KV cache, flash
        attention auto, repacking on)."""
        fp32 = spec.precision in ("fp32", "a8", "abf16", "af16")  # a GGUF as shipped, at the fp32 settings
        o = spec.options
        return (o.get("outtype") or ("f32" if fp32 else "bf16"), o.get("kv") or ("f32" if fp32 else "f16"),
                o.get("flash_attn") or ("off" if fp32 else "auto"), o.get("repack") or ("off" if fp32 else "on"))

    def gguf(self, src, spec) -> Artifact:
        """The checkpoint as a GGUF of `outtype` (cached by checkpoint, type, version and code)."""
        outtype = self.settings(spec)[0]
        base = "f32" if outtype in QUANTIZE_TYPES else outtype
        code = hashlib.sha256(b"".join(Path(__file__).with_name(f).read_bytes()
                                       for f in ("llamacpp.py", "llamacpp_faults.py"))).hexdigest()[:16]
        parts = {"backend": "llamacpp", "checkpoint": src.checkpoint_sha256, "outtype": base,
                 "versions": versions(PACKAGE), "code": code, "transform_id": self.transform_id}

        def build(path: Path):
            convert(src.model_dir, path, base)
            if self.transform is not None:
                try:
                    self.transform(path, src.args)
                except KeyError as e:  # a key or tensor this GGUF does not have (its architecture reads none)
                    raise InputError(f"the fault has no form in this GGUF: {e.args[0]}") from None

        art = cached_artifact("llamacpp", parts, "model.gguf", build,
                              needed=lambda: estimate(src.parameter_count(), base))
        if outtype not in QUANTIZE_TYPES:
            return art

        def quantize(path: Path):
            import llama_cpp as L

            _quiet_logs()
            qp = L.llama_model_quantize_default_params()
            qp.ftype = QUANTIZE_TYPES[outtype]
            rc = L.llama_model_quantize(art.path.encode(), str(path).encode(), ctypes.byref(qp))
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize to {outtype} returned {rc}")

        return cached_artifact("llamacpp", {**parts, "quantize": outtype}, "model.gguf", quantize,
                               needed=lambda: estimate(src.parameter_count(), outtype))

    def artifact_weights(self, original, path: Path, progress):
        """--gguf: the GGUF's weights as an HF checkpoint (exporters/llamacpp_gguf.py), checked against the
        original's f32 conversion by the same converter (architecture, hyper-parameters, tensors)."""
        from exporters.llamacpp_gguf import dequantized_gguf
        from oracle.backend import CheckSpec

        progress("converting the original (llama.cpp's converter, f32) to compare the GGUF with")
        ref = self.gguf(original, CheckSpec(family=original.family.name, backend=self.name))
        return dequantized_gguf(original.family, original, path, Path(ref.path), f"{PACKAGE} {installed_version()}",
                                progress)

    # `oracle selftest --conversion`: what users ship, an F32 file (whose weights must be the original's
    # exactly) and two of llama-quantize's types
    shipped_formats = (("F32", "fp32", {"outtype": "f32"}), ("Q8_0", "fp32", {"outtype": "Q8_0"}),
                       ("Q4_K_M", "fp32", {"outtype": "Q4_K_M"}))
    file_faults = {"scale_other_block": "each block's scale written for the next block, in one quantized tensor "
                                        "(last MoE layer)"}

    def apply_file_fault(self, name, path, original, args, progress):
        from exporters.llamacpp_weights import scale_other_block
        from models.conversion_faults import last_sparse

        return scale_other_block(Path(path), last_sparse(args)) if name == "scale_other_block" else None

    def shipped_tensors(self, original, path, progress):
        """The weight check of a --gguf (exporters/llamacpp_weights.py): each tensor against the original's f32
        conversion by the same converter, labelled with the HF tensors the converter's element map puts there."""
        from exporters.llamacpp_gguf import element_map
        from exporters.llamacpp_weights import gguf_tensor_sources, labels_from_map
        from oracle.backend import CheckSpec

        ref = self.gguf(original, CheckSpec(family=original.family.name, backend=self.name))
        labels = labels_from_map(element_map(original, f"{PACKAGE} {installed_version()}"))
        return gguf_tensor_sources(Path(path), Path(ref.path), labels)

    def check_options(self, spec):
        if spec.artifact is not None and spec.options.get("outtype"):
            return "--gguf runs the file as given: outtype applies to the GGUF the backend converts, not to it"
        return None

    def load(self, src, spec):
        outtype, kv, fa, repack = self.settings(spec)
        if spec.artifact is None and (outtype in QUANTIZE_TYPES or outtype == "q8_0"):
            # judged against HF on the original weights, a quantized GGUF fails by its quantization alone
            raise InputError(f"outtype={outtype} is a quantized GGUF: check it as shipped, its implementation on its "
                             f"own weights and its quantization apart: `oracle export --backend llamacpp --option "
                             f"outtype={outtype} --output-dir D`, then `oracle check --backend llamacpp --gguf D/model.gguf`")
        t = time.perf_counter()
        if spec.artifact is not None:  # --gguf: the file as shipped
            art = Artifact(Path(spec.artifact).name, str(spec.artifact), sha256_file(Path(spec.artifact)), True, 0.0)
            outtype = "given"
        else:
            art = self.gguf(src, spec)
        info = {"executor": f"llama.cpp ({PACKAGE} {installed_version()}), CPU, KV cache {kv}, flash attention {fa}, "
                            f"repacked weights {repack}",
                "gguf": {"outtype": outtype, "kv": kv, "flash_attn": fa, "repack": repack, "converter": f"convert_hf_to_gguf.py of {PACKAGE} "
                                                                     f"{installed_version()}"},
                "artifacts": [art.as_dict()]}
        n_ctx = max(src.args.max_seq_len, 2 * (src.args.num_experts or 1), 32)
        try:
            cand = LlamaCppCandidate(Path(art.path), n_ctx, kv, info, flash_attn=fa, repack=repack)
        except RuntimeError as e:  # llama.cpp cannot load or run what its own converter wrote (or the given
            # GGUF, checked against that conversion): a defect of the candidate, the check's error with its reason
            made = "the given GGUF" if spec.artifact is not None else "the GGUF llama.cpp's converter wrote"
            raise LoadError(f"{e} ({made} from this checkpoint)") from None
        cand.info["load_s"] = round(time.perf_counter() - t, 3)
        return cand

    def with_fault(self, fault):
        """This backend with a GGUF fault (exporters/llamacpp_faults.py) written into the converted GGUF."""
        from exporters import llamacpp_faults

        if fault not in llamacpp_faults.CATALOGUE:
            return None
        return type(self)(f"{self.name}+{fault.name}", lambda path, args: fault.apply(path, fault.layer(args), args),
                          fault.name)

    def fault_not_applicable(self, fault):
        return ("a fault of the torch production model: llama.cpp runs the GGUF, whose faults are "
                "exporters/llamacpp_faults.py's")

    def fault_catalogue(self, args):
        from exporters import llamacpp_faults

        return list(llamacpp_faults.CATALOGUE) if args is None else llamacpp_faults.applicable(args)

    def export(self, src, spec, output_dir: Path) -> list[Path]:
        art = self.gguf(src, spec)
        out = Path(output_dir) / "model.gguf"
        shutil.copyfile(art.path, out)
        return [out]


BACKEND = LlamaCppBackend()


if __name__ == "__main__":
    if sys.argv[1:2] == ["setup"]:
        print(setup())
    elif sys.argv[1:2] == ["convert"]:
        _convert_main(*sys.argv[2:5])
    elif sys.argv[1:2] == ["convert-server"]:
        _convert_server(sys.argv[2])
    elif sys.argv[1:2] == ["serve"]:
        _serve(*sys.argv[2:8])
    else:
        print("usage: python -m exporters.llamacpp setup | convert MODEL_DIR OUT.gguf OUTTYPE", file=sys.stderr)
        sys.exit(2)
