"""mlx-lm's model as a candidate: prefill and decode with mlx-lm's own cache, its blocks run on the
reference's calls, their routing mirrors, the drill's points."""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from exporters.mlx.config import check_args
from exporters.mlx.model import (attention_block, cache_index, dense_block, embedding, final_norm, moe_block, route,
                                 text_model)
from oracle.backend import Candidate
from oracle.reports.result import GateRow


# ---------------------------------------------------------------- running
@contextlib.contextmanager
def mlx_points(block, rec, mx):
    """Each submodule of an mlx-lm block records what it returns while the block runs: its class
    swapped for a subclass whose __call__ records (mlx modules take no hooks), swapped back after."""
    from exporters.mlx.model import router_linear

    def array(a):
        return np.array(a.astype(mx.float32)) if isinstance(a, mx.array) else None

    rope_calls = [0]
    logits_of = None
    for moe in (block, *[m for _, m in block.named_modules() if m is not block]):
        try:
            logits_of = router_linear(moe)
            break
        except (KeyError, StopIteration, TypeError, AttributeError):
            continue
    if logits_of is not None and hasattr(logits_of, "top_k") and rec.points.taps is not None:
        rec.points.taps.discard("logits")  # a gate that routes by itself (DeepSeek's MoEGate): no logits out
    swapped, patched = [], []
    # the recurrence: mlx-lm's Gated DeltaNet (gated_delta_update) or Mamba2 scan (ssm_update: its output with the D
    # skip), and the Mamba2 scan's discretised time step (mlx_lm.models.ssm.compute_dt)
    for _, m in block.named_modules():
        mod = sys.modules.get(type(m).__module__)
        for name in ("gated_delta_update", "ssm_update"):
            fn = getattr(mod, name, None)
            if fn is None or any(p[0] is mod and p[1] == name for p in patched):
                continue
            def recurrence(*a, _fn=fn, **kw):
                out = _fn(*a, **kw)
                rec.add("recurrence", array(out[0]))
                return out
            patched.append((mod, name, fn))
            setattr(mod, name, recurrence)
            if name == "ssm_update" and not any(p[1] == "compute_dt" for p in patched):
                ssm = sys.modules["mlx_lm.models.ssm"]

                def compute_dt(*a, _fn=ssm.compute_dt, **kw):
                    out = _fn(*a, **kw)
                    rec.add("dt", array(out))
                    return out
                patched.append((ssm, "compute_dt", ssm.compute_dt))
                ssm.compute_dt = compute_dt
    names = {p[1] for p in patched}  # a tap is the backend's only where it is recorded (else: not exposed)
    if rec.points.taps is not None:
        rec.points.taps -= ({"dt"} if "ssm_update" not in names else set()) | (
            {"recurrence"} if not names & {"gated_delta_update", "ssm_update"} else set())
    for path, m in block.named_modules():
        if not path or not callable(m):
            continue
        leaf = path.rsplit(".", 1)[-1]

        def call(self, *a, _cls=type(m), _path=path, _leaf=leaf, _m=m, **kw):
            out = _cls.__call__(self, *a, **kw)
            if _leaf in ("o_proj", "out_proj") and a:
                rec.add("context", array(a[0]))
            if _leaf == "rope":  # q first, then k
                rec.add("q_rope" if rope_calls[0] % 2 == 0 else "k_rope", array(out))
                rope_calls[0] += 1
            elif _m is logits_of and isinstance(out, mx.array):  # (a gate that routes by itself: its choice)
                rec.add("logits", array(out).reshape(-1, out.shape[-1]))
            elif isinstance(out, mx.array):
                rec.add(_path, array(out))
            return out
        cls = type(m)
        m.__class__ = type(cls.__name__, (cls,), {"__call__": call})
        swapped.append((m, cls))
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        for mod, name, fn in patched:
            setattr(mod, name, fn)


class MLXCandidate(Candidate):
    block_mode = "isolated"

    def __init__(self, model, dtype, device, info, array_mask: bool = False, windows: dict | None = None,
                 chunks: dict | None = None, block_args=None, point_names: dict | None = None, point_view=None):
        import mlx.core as mx

        self.mx, self.model, self.dtype, self.device, self.info = mx, model, dtype, device, info
        self.cache, self.pos = None, 0
        self.array_mask = array_mask  # the family's mlx-lm model builds an array mask (MlxLm.array_mask)
        self.windows = windows or {}  # layer -> its sliding window (the model's own masks; a block needs it)
        self.chunks = chunks or {}  # layer -> its attention chunk (Llama 4's chunked layers)
        self.block_args = block_args  # MlxLm.block_args: what the model passes its layers beside x and the mask
        # HF's submodule names (which mlx-lm keeps) -> the production model's, for the drill (Family.hf_point_names)
        self.point_names = point_names
        self.point_view = point_view  # then its layout (Family.hf_point_view, given the ModelArgs)
        self.routes: list = []  # (layer, indices, weights) of each MoE block's call (routing replay)
        self._record_routes()

    def _record_routes(self) -> None:
        """Each sparse layer's mlx-lm MoE block, its class swapped for one that records the experts it
        selects on every call (the routing mirror, exporters/mlx/model.py route, on the block's input:
        what the block itself computes, tests/test_mlx.py) before running as it is."""
        mx, routes = self.mx, self.routes
        for i, layer in enumerate(self.model.layers):
            moe = moe_block(layer)
            if not ("switch_mlp" in moe or "experts" in moe):
                continue
            cls = type(moe)

            def call(self_, x, *a, _cls=cls, _i=i, **kw):
                w, idx = route(self_, x)
                mx.eval(w, idx)
                routes.append((_i, np.array(idx).reshape(-1, idx.shape[-1]).astype(np.int64),
                               np.array(w.astype(mx.float32)).reshape(-1, idx.shape[-1])))
                return _cls.__call__(self_, x, *a, **kw)
            moe.__class__ = type(cls.__name__, (cls,), {"__call__": call})

    def last_routes(self):
        return {layer: (idx, w) for layer, idx, w in self.routes}

    def block_routes(self):
        return [{layer: (idx, w)} for layer, idx, w in self.routes]

    def _in(self, x):  # the reference's fp32 numpy input -> mx at the model's activation dtype
        return self.mx.array(np.asarray(x, np.float32)).astype(self.dtype)

    def _out(self, a):
        """numpy fp32; bf16 as a torch bf16 tensor (numpy has no bf16; the dtype is checked)."""
        out = np.array(a.astype(self.mx.float32))
        if a.dtype == self.mx.bfloat16:
            import torch

            return torch.from_numpy(out).to(torch.bfloat16)
        return out

    def _prefill(self, tokens):
        """mx logits [T, V] of a new sequence (a fresh mlx-lm cache)."""
        from mlx_lm.models.cache import make_prompt_cache

        with self.mx.stream(self.device):
            self.cache, self.pos = make_prompt_cache(self.model), len(tokens)
            return self.model(self.mx.array([tokens]), cache=self.cache)[0]

    def _decode(self, token, pos):
        """mx logits [V] of one step on the carried cache."""
        if pos != self.pos:
            raise ValueError(f"decode at position {pos}, but the cache holds {self.pos} tokens")
        with self.mx.stream(self.device):
            self.pos += 1
            return self.model(self.mx.array([[token]]), cache=self.cache)[0, -1]

    def prefill(self, tokens):
        self.routes.clear()
        return self._out(self._prefill(tokens))

    no_chunks = None  # extend: a chunk after the first

    def extend(self, tokens, pos):
        """mlx-lm's model on the next chunk of the sequence, its cache carried (as mlx_lm.generate prefills a long
        prompt in prefill_step_size chunks)."""
        if pos != self.pos:
            raise ValueError(f"a chunk at position {pos}, but the cache holds {self.pos} tokens")
        self.routes.clear()
        with self.mx.stream(self.device):
            self.pos += len(tokens)
            return self._out(self.model(self.mx.array([tokens]), cache=self.cache)[0])

    def batch(self, prompts):
        """The prompts right-padded to the longest, in one call on a fresh cache of that batch (causal masks:
        a prompt's rows never see the padding after it); the next prefill starts a new cache."""
        from mlx_lm.models.cache import make_prompt_cache

        self.routes.clear()
        B, T = len(prompts), max(map(len, prompts))
        with self.mx.stream(self.device):
            out = self.model(self.mx.array([p + [0] * (T - len(p)) for p in prompts]), cache=make_prompt_cache(self.model))
            logits = [self._out(out[b, :len(p)]) for b, p in enumerate(prompts)]
        self.cache, self.pos = None, 0
        return logits, [{layer: (i.reshape(B, T, -1)[b, :len(p)], w.reshape(B, T, -1)[b, :len(p)])
                         for layer, i, w in self.routes} for b, p in enumerate(prompts)]

    def decode(self, token, pos):
        self.routes.clear()
        return self._out(self._decode(token, pos))

    # The on-device sampler is mlx-lm's own (mlx_lm.sample_utils.make_sampler: top-p, then
    # mx.random.categorical at the temperature; temperature 0 is its argmax), on the
    # log-probabilities as mlx_lm.generate hands them over, seeded per call with
    # mx.random.seed as a runner would seed it. The harness is the runner (seed s + k at step k)
    # and validates the arguments, which mlx-lm's sampler does not refuse. mlx-lm takes the
    # top-p nucleus of the unscaled distribution (apply_top_p on the log-probabilities, the
    # temperature only in categorical_sampling): the distribution row judges it as such.
    top_p_after_temperature = False

    def sample_logits(self, logits, temperature, top_p, seed) -> int:
        check_args(temperature, top_p)
        from mlx_lm.sample_utils import make_sampler

        mx = self.mx
        with mx.stream(self.device):
            lg = (logits if isinstance(logits, mx.array) else mx.array(np.asarray(logits, np.float32)))
            lg = lg.reshape(1, -1).astype(mx.float32)
            mx.random.seed(int(seed))
            return int(make_sampler(temp=temperature, top_p=top_p)(lg - mx.logsumexp(lg, axis=-1, keepdims=True)).item())

    def sample_prefill(self, tokens, temperature, top_p, seed) -> int:
        check_args(temperature, top_p)  # before the model runs: a refused call changes no state
        return self.sample_logits(self._prefill(tokens)[-1], temperature, top_p, seed)

    def sample_decode(self, token, pos, temperature, top_p, seed) -> int:
        check_args(temperature, top_p)
        return self.sample_logits(self._decode(token, pos), temperature, top_p, seed)

    def host_sampler(self, logits, temperature, top_p, seed) -> tuple[int, None]:
        """The seed schedule's reference: the same mlx-lm sampler on the HF reference's logits
        (its Gumbel noise is mlx's own, drawn inside mx.random.categorical: no margin to report)."""
        return self.sample_logits(np.asarray(logits, np.float32), temperature, top_p, seed), None

    def gates(self):
        """A shipped directory: does mlx-lm read its config.json as the model the reference's config
        means? (A field it misses takes mlx-lm's default: rope_theta 1e6 where HF's is 1e4.)"""
        mismatch = self.info.get("config_mismatch")
        if mismatch is None:
            return []
        text = "; ".join(f"{k}: mlx-lm {v['mlx_lm']!r}, reference {v['reference']!r}" for k, v in mismatch.items())
        return [GateRow("mlx_config", "fail" if mismatch else "pass", len(mismatch), 0,
                        f"fields mlx-lm read differently from the candidate's config.json: {text}" if mismatch
                        else "mlx-lm reads the candidate's config.json as the reference's model")]

    def run_block(self, layer, kind, calls):
        self.routes.clear()
        with self.mx.stream(self.device):
            fn = self._block(layer, kind)
            return [fn(self._in(c.x_array), c) for c in calls]

    def run_block_points(self, layer, kind, calls):
        """The drill (oracle/drill/points.py): every submodule of mlx-lm's block records its output under its
        path (mlx-lm names them as HF does: q_proj, q_norm, shared_expert.down_proj, ...), the output
        projection its input (`context`), the rotary module its two calls (`q_rope`, `k_rope`: mlx-lm
        rotates q, then k), the router's linear layer its `logits`, the block's routing mirror its
        `topk` and `weights`. mlx-lm computes scores and selection inline: not recorded."""
        from oracle.drill import points

        tm = text_model(self.model)
        if kind in ("final_norm", "logits"):
            block = final_norm(tm) if kind == "final_norm" else tm.lm_head if "lm_head" in tm else None
        else:
            dec = self.model.layers[layer]
            block = {"attention": attention_block(dec), "layer": dec, "mlp": dense_block(dec)}.get(kind) or moe_block(dec)
        if block is None:
            return None
        rec = points.Recorder(taps=("q_rope", "k_rope", "logits", "recurrence", "dt")
                              + (("topk", "weights") if kind == "router" else ()))
        with self.mx.stream(self.device), mlx_points(block, rec, self.mx):
            outs = self.run_block(layer, kind, calls)
        for out in outs:
            if kind == "router":
                rec.add("topk", np.asarray(out[1], dtype=np.float32))
                rec.add("weights", np.asarray(out[0], dtype=np.float32))
            else:  # the block's own output (as run_block returns it)
                rec.add("output", np.asarray(out, dtype=np.float32))
        pts = rec.points
        if self.point_names:
            from models.mapping import renamed

            pts = pts.renamed(lambda n: renamed(n, self.point_names))
        return self.point_view(pts, layer) if self.point_view else pts

    def chunk_mask(self, x, cache, chunk: int):
        """The chunked layers' mask as mlx-lm's llama4 builds it over its ChunkedKVCache (key j visible
        to query i iff j <= i in the same chunk), after trimming the cache to the current chunk."""
        mx = self.mx
        cache.maybe_trim_front()
        start, offset = cache.start_position, cache.offset
        linds = mx.arange(start, offset + x.shape[1])
        rinds = mx.arange(offset, offset + x.shape[1])[:, None]
        return (mx.abs(linds // chunk - rinds // chunk) == 0) & (linds <= rinds)

    def _block(self, layer, kind):
        """fn(x [1, T, H], call) for one block; stateful blocks own a fresh mlx-lm cache."""
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask
        from mlx_lm.models.cache import make_prompt_cache

        tm = text_model(self.model)
        if kind == "final_norm":
            return lambda x, c: self._out(final_norm(tm)(x))
        if kind == "logits":
            # (tied: the args say so, or the model has no head of its own, LFM2's)
            tied = getattr(tm.args, "tie_word_embeddings", False) or "lm_head" not in tm
            head = embedding(tm).as_linear if tied else tm.lm_head
            # what mlx-lm's Model.__call__ does after the head: Granite divides by its logits_scaling, Gemma caps them
            scaling, cap = getattr(tm, "logits_scaling", 1.0), getattr(tm, "final_logit_softcapping", None)

            def logits(x, c):
                y = head(x) / scaling if scaling != 1.0 else head(x)
                return self._out(self.mx.tanh(y / cap) * cap if cap else y)

            return logits
        dec = self.model.layers[layer]
        if kind in ("moe", "mlp"):  # a sparse layer's MoE block, or a dense layer's MLP (or one beside the MoE block)
            block = moe_block(dec) if kind == "moe" else dense_block(dec)
            return lambda x, c: self._out(block(x))
        if kind == "router":
            def router(x, c):
                w, idx = route(moe_block(dec), x)
                return self._out(w.reshape(-1, w.shape[-1])), np.array(idx).reshape(-1, idx.shape[-1])

            return router
        module = {"attention": attention_block(dec), "layer": dec}[kind]
        i = cache_index(self.model, layer)  # (Nemotron-H: a cache for its mixers only)
        cache, pos = make_prompt_cache(self.model)[i] if i is not None else None, [0]
        # a recurrent mixer's layer takes the SSM mask (Qwen3.5's linear attention, LFM2's short conv, a Mamba2 mixer:
        # the layers whose cache holds arrays, not keys and values)
        linear = (getattr(dec, "is_linear", False) or not getattr(dec, "is_attention_layer", True)
                  or type(cache).__name__ == "ArraysCache")

        import inspect

        takes_mask = "mask" in inspect.signature(type(module).__call__).parameters

        def fn(x, c):
            if c.probe or int(c.pos_array[0]) != pos[0]:
                raise ValueError(f"{kind} of layer {layer}: call at position {int(c.pos_array[0])}, state at {pos[0]}")
            pos[0] += x.shape[1]
            if layer in self.chunks:
                mask = self.chunk_mask(x, cache, self.chunks[layer])
            else:
                mask = create_ssm_mask(x, cache) if linear else create_attention_mask(
                    x, cache, window_size=self.windows.get(layer), return_array=self.array_mask)
            extra = self.block_args(text_model(self.model), x, cache) if self.block_args else ()
            y = module(x, *extra, mask, cache) if takes_mask else module(x, cache)  # (Jamba's mixer: no mask)
            # mlx-lm's hunyuan returns (output, k/v kept for its cross-layer attention): the output
            return self._out(y[0] if isinstance(y, tuple) else y)

        return fn
