"""Drill-down: the points inside a block, compared one by one, and the first that diverges.

A failing row says *which* block; the drill says *where in it*. The block is run isolated on the
reference's captured inputs twice, HF fp32 and the candidate, with every point recorded on both
sides, and the points are compared in program order (the order they are computed in the
candidate's own run) with the block's limits. The verdict is the first point that fails while
every point before it agrees.

Points are of two sorts:
- a submodule's output, by its path relative to the block (`q_proj`, `k_norm`,
  `shared_expert.down_proj`, `experts`, `input_layernorm`, ...): recorded by forward hooks on both
  sides wherever the same path exists in the HF module and the production one (the production
  model's modules carry HF's names, models/layers/); `context` is the output projection's input;
- a computed value with no module of its own, the vocabulary below (TAPS): the production model
  records it with `models.layers.taps.tap` (a no-op unless a drill is recording: exported graphs do not
  change); HF's side reads the same value from what HF computes (its `apply_rotary_pos_emb`'s
  results, its router's logits and, through the family's routing (models.layers.routing) with HF's own
  correction bias, the scores and selection scores).

Both sides' outputs of a point are compared as rows of its last dimension, leading dimensions
flattened in order (HF's [B*T*h, d] and a backend's [B, T, h, d] are the same rows). A point whose
sides differ in size or last dimension is `n/a` with both shapes (never a guess), and so is a tap a
side does not expose (mlx-lm computes the router's scores inline, for one). A tap the candidate
records where it happens, or a module it has, that HF computes and the candidate skips is a
divergence ("HF computes it; the candidate does not"). Top-k weights are compared in expert order.
Limits: the block's table at the model's width (thresholds.toml; a router's points take the moe
table's); top-k indices by agreement.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from oracle.reports.result import Status, place

# computed values with no module of their own, per block kind, in program order
TAPS = {
    "attention": ("q_rope", "k_rope"),
    "linear_attention": ("conv", "q_l2norm", "k_l2norm", "beta", "g", "recurrence"),
    # Kimi delta attention's: the Gated DeltaNet's (g per channel: [.., heads, head_dim])
    "kda": ("conv", "q_l2norm", "k_l2norm", "beta", "g", "recurrence"),
    "short_conv": ("bx", "conv"),  # the gated input B * x, the causal conv's output (rows by token)
    # the conv's output (x | B | C after silu), the discretised time step, its decay e^(dt A), the scan's output
    # with the D skip (before the gated norm, the module `norm`)
    "mamba2": ("conv", "dt", "decay", "recurrence"),
    # Mamba's: the same, its decay per channel and state (flattened), its recurrence gated by silu(z) (as HF's selective
    # scan returns it)
    "mamba": ("conv", "dt", "decay", "recurrence"),
    "router": ("logits", "scores", "selection", "topk", "weights"),
}
DRILLED = ("attention", "router", "moe", "mlp", "layer", "final_norm", "logits")


@dataclass
class Point:
    name: str
    status: Status  # pass | fail | n/a
    metrics: dict = field(default_factory=dict)
    ratio: float = 0.0
    reason: str = ""


@dataclass
class Drill:
    layer: int | None
    kind: str
    points: list[Point]
    first_divergence: str | None  # the first failing point whose predecessors agree
    verdict: str
    seconds: float = 0.0
    build_s: float = 0.0  # of `seconds`, building the backend's points program (0: from the cache)

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- recording
class Points(dict):
    """point -> outputs; `registered`: the block's submodule paths, fired or not (a module the
    candidate has but never ran, where HF runs its counterpart, is a divergence)."""

    def __init__(self, taps=None):
        super().__init__()
        self.registered: list[str] = []
        # the taps this side records where they happen (None: every one of TAPS); a tap HF computes
        # that the candidate records nowhere else is a divergence only where it is in this set
        self.taps = None if taps is None else set(taps)
        # seconds the backend spent building a program for this drill (a compiled backend's points
        # program on a cache miss): the drill then costs more than the block, and says so
        self.build_s = 0.0

    def renamed(self, rename) -> "Points":
        """The points under rename(path) (a backend whose model names its submodules otherwise: the family's
        Family.hf_point_names, applied part by part, gives the production model's names the drill compares)."""
        out = Points(self.taps)
        out.registered, out.build_s = [rename(n) for n in self.registered], self.build_s
        out.update({rename(n): v for n, v in self.items()})
        return out


class Recorder:
    """point -> its outputs, one per firing, in the order points first fire (a module fires once
    per call of the block; the same module on both sides fires as often).

    keep=True (a program being traced, exporters/torch/candidate.py: PointsCall): the tensors themselves are kept,
    in firing order (`fired`: their names, `values`: the tensors), to become the program's extra
    outputs; nothing is read."""

    def __init__(self, taps=None, keep: bool = False):
        self.points = Points(taps)
        self.keep, self.fired, self.values = keep, [], []

    def add(self, name: str, x) -> None:
        """A torch tensor, or a numpy array (a backend that runs no torch converts its own)."""
        if self.keep:
            import torch

            if torch.is_tensor(x):  # a copy of its own: an output never aliases another or an input
                self.fired.append(name)
                self.values.append(x.detach().float().clone())
            return
        if isinstance(x, np.ndarray):
            self.points.setdefault(name, []).append(x.astype(np.float32))  # (a copy)
            return
        import torch

        if torch.is_tensor(x):  # a copy: the module's caller may add to its output in place (Llama 4)
            self.points.setdefault(name, []).append(x.detach().float().cpu().numpy().copy())


def from_outputs(fired: list[str], registered: list[str], values: list, build_s: float = 0.0) -> Points:
    """A compiled points program's extra outputs (numpy, in firing order; several calls' one after
    another) as the drill's Points (`fired`: their names; `registered`: the block's submodule paths;
    `build_s`: the seconds the program took to build, 0 from the cache)."""
    rec = Recorder()
    for name, v in zip(fired, values, strict=True):
        rec.add(name, np.asarray(v))
    rec.points.registered = list(registered)
    rec.points.build_s = float(build_s or 0.0)
    return rec.points


@contextlib.contextmanager
def hooks(block, rec: Recorder, kind: str | None = None):
    """Forward hooks recording every submodule's output by its path in the block (a tuple output,
    such as a router's, is read by the taps instead), and `context`: the output projection's input."""
    from oracle.reference.run import normalize_output

    def output(mod, a, out):  # the block's own output (an HF block may return a tuple; a router's: the taps)
        if kind not in (None, "router"):
            rec.add("output", normalize_output(kind, out, keep_dtype=True))

    handles = [block.register_forward_hook(output)]
    context = False  # one output projection's input: the block's first (ZAYA's layer: not its router MLP's out_proj)
    for path, m in block.named_modules():
        if not path:
            continue
        rec.points.registered.append(path)
        if path.rsplit(".", 1)[-1] == "indexer":  # sparse attention's choice: its visible keys (chosen_keys)
            handles += chosen_keys(m, rec, path)
            continue
        handles.append(m.register_forward_hook(lambda mod, a, out, p=path: rec.add(p, out)))
        if path.rsplit(".", 1)[-1] in ("o_proj", "out_proj") and not context:
            context = True
            handles.append(m.register_forward_pre_hook(lambda mod, a: rec.add("context", a[0] if a else None)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def chosen_keys(indexer, rec: Recorder, path: str) -> list:
    """Hooks recording a sparse-attention indexer's choice (oracle/verdict/selection.py) as the point `path`: per query
    the keys it chose that it can see, sorted, the masked ones as -1 (with fewer visible keys than k a top-k also
    returns masked keys, in an order of its own: HF's over the keys seen, a static cache's over all of its)."""
    from oracle.verdict.selection import MASKED, SelectionLog

    if rec.keep:  # a program being traced (the production model's indexer: forward(x, q_resid, pos)), in its graph
        import torch

        def traced(mod, a, out):
            if out.dim() == 4:  # a choice per head [B, heads, T, k] (-1: none): selection.per_query's rows
                H = out.shape[1]
                heads = torch.arange(H, device=out.device)[None, :, None, None]
                rows = torch.where(out >= 0, out * H + heads, -1).transpose(1, 2).flatten(-2)
                rec.add(path, torch.sort(rows, dim=-1).values)
                return
            rec.add(path, torch.sort(torch.where(out <= a[-1][:, None], out, -1), dim=-1).values)

        return [indexer.register_forward_hook(traced)]
    log = SelectionLog({0: indexer})

    def record(mod, a, out):
        _, idx, scores = log.entries[-1]
        if scores is None:  # (no top-k seen: the choice as it is)
            rec.add(path, idx.astype(np.float32))
            return
        seen = np.take_along_axis(scores, np.clip(idx, 0, scores.shape[-1] - 1), axis=-1) > MASKED
        rec.add(path, np.sort(np.where(seen, idx, -1), axis=-1).astype(np.float32))

    class Log:  # (a handle: removing it removes the log's hooks)
        remove = staticmethod(log.remove)

    return [Log(), indexer.register_forward_hook(record)]


@contextlib.contextmanager
def production_taps(rec: Recorder):
    """models.layers.taps.tap records into `rec` while the block runs."""
    from models.layers import taps

    old = taps.TAPS
    taps.TAPS = rec.add
    try:
        yield
    finally:
        taps.TAPS = old


@contextlib.contextmanager
def hf_taps(block, router, rec: Recorder, args, read_router):
    """HF's side of TAPS: its rotary function's results, its Gated DeltaNet (and Kimi delta attention) kernel's inputs
    and output, its short conv's, its Mamba2 conv's and scan's (patched in the modeling file of every module of the
    block that has one) and, where the block holds the layer's router, the router's logits, scores, selection scores,
    choice and weights."""
    import torch

    from models.layers import routing
    from oracle.reference.run import normalize_output, selection_scores

    patched, handles = [], []
    inside = [False]  # HF's isolation replays the whole model: record only while the block runs
    handles.append(block.register_forward_pre_hook(lambda mod, a: inside.__setitem__(0, True)))
    handles.append(block.register_forward_hook(lambda mod, a, out: inside.__setitem__(0, False)))
    turn = [0]  # a rotary function of one tensor (Gemma 4's): called for q, then for k
    handles.append(block.register_forward_pre_hook(lambda mod, a: turn.__setitem__(0, 0)))

    def rotary(fn, mod):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            if torch.is_tensor(out):  # [B, T, h, hd] where unsqueezed at 2: as the production's [B, h, T, hd]
                if inside[0]:
                    rec.add(("q_rope", "k_rope")[min(turn[0], 1)],
                            out.transpose(1, 2) if kw.get("unsqueeze_dim", 1) == 2 else out)
                    turn[0] += 1
                return out
            q, k = out
            if inside[0]:
                rec.add("q_rope", q)
                rec.add("k_rope", k)
            return q, k
        return wrapped

    def delta_rule(fn, mod):  # HF's Gated DeltaNet (or KDA) kernel: its inputs are the conv's q, k, v, g and beta
        def wrapped(query, key, value, *a, **kw):
            out = fn(query, key, value, *a, **kw)
            if inside[0]:
                rec.add("conv", torch.cat([query.flatten(2), key.flatten(2), value.flatten(2)], dim=-1))
                q, k, rep = query.float(), key.float(), value.shape[2] // query.shape[2]
                if rep > 1:
                    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
                if kw.get("use_qk_l2norm_in_kernel"):  # HF's own l2norm, as its kernel applies it
                    q, k = mod.l2norm(q, dim=-1, eps=1e-6), mod.l2norm(k, dim=-1, eps=1e-6)
                rec.add("q_l2norm", q)
                rec.add("k_l2norm", k)
                rec.add("beta", kw.get("beta"))
                rec.add("g", kw.get("g"))
                rec.add("recurrence", out[0])
            return out
        return wrapped

    def short_conv(fn, mod):  # HF's causal conv of a short-conv mixer: [B, C, T] in (B * x) and out
        def wrapped(x, *a, **kw):
            out = fn(x, *a, **kw)
            if inside[0]:
                rec.add("bx", x.transpose(1, 2))
                rec.add("conv", out.transpose(1, 2))
            return out
        return wrapped

    def mamba2_conv(fn, mod):  # HF's causal conv of a Mamba2 mixer: its output (after the activation) only
        def wrapped(x, *a, **kw):
            out = fn(x, *a, **kw)
            if inside[0]:
                rec.add("conv", out.transpose(1, 2))
            return out
        return wrapped

    def ssm_scan(prefill: bool, mamba2: bool):  # HF's Mamba2 / Mamba scan (the prefill, or one step): dt, decay, output
        def wrap(fn, mod):
            def wrapped(*a, **kw):
                out = fn(*a, **kw)
                if inside[0]:
                    dt, A = (a[1], a[2]) if prefill else (a[2], a[3])  # (x, dt, A, ...) / (state, x, dt, A, ...)
                    bias = kw.get("dt_bias", kw.get("delta_bias"))
                    dt = dt.float()
                    if bias is not None:  # (Mamba's prefill: dt [b, d, T], its bias [d])
                        dt = dt + (bias.float()[..., None] if not mamba2 and prefill else bias.float())
                    dt = torch.nn.functional.softplus(dt) if kw.get("dt_softplus", kw.get("delta_softplus")) else dt
                    if mamba2 and prefill:
                        lo, hi = kw.get("dt_limit", (0.0, float("inf")))
                        dt = dt.clamp(lo, hi) if (lo, hi) != (0.0, float("inf")) else dt
                    elif mamba2:  # the update's per-head values come expanded over head_dim (and the state)
                        dt, A = dt[..., 0], A[:, 0, 0]
                    elif prefill:  # Mamba: [b, d, T] -> rows by token
                        dt = dt.transpose(1, 2)
                    rec.add("dt", dt)
                    # the decay e^(dt A): per head (Mamba2), per channel and state, flattened (Mamba)
                    rec.add("decay", (dt * A.float()).exp() if mamba2 else (dt[..., None] * A.float()).exp().flatten(-2))
                    y = out[0] if isinstance(out, tuple) else out
                    rec.add("recurrence", y if mamba2 or not prefill else y.transpose(1, 2))
                return out
            return wrapped
        return wrap

    functions = {"apply_rotary_pos_emb": rotary, "torch_chunk_gated_delta_rule": delta_rule,
                 "torch_recurrent_gated_delta_rule": delta_rule, "chunk_kimi_delta_attention": delta_rule,
                 "recurrent_kimi_delta_attention": delta_rule, "causal_conv1d_fn": short_conv,
                 "causal_conv1d_update": short_conv, "mamba2_chunk_scan": ssm_scan(True, True),
                 "mamba2_selective_state_update": ssm_scan(False, True), "mamba_selective_scan": ssm_scan(True, False),
                 "mamba_selective_state_update": ssm_scan(False, False)}
    for m in block.modules():
        mod = sys.modules.get(type(m).__module__)
        for name, wrap in functions.items():
            fn = getattr(mod, name, None)
            if fn is None or any(p[0] is mod and p[1] == name for p in patched):
                continue
            if wrap is short_conv and (hasattr(mod, "torch_chunk_gated_delta_rule")
                                       or hasattr(mod, "chunk_kimi_delta_attention")):
                continue  # a Gated DeltaNet's (a KDA's) conv: its taps are the kernel's inputs
            if wrap is short_conv and (hasattr(mod, "mamba2_chunk_scan") or hasattr(mod, "mamba_selective_scan")):
                wrap = mamba2_conv  # (a Mamba's too)
            patched.append((mod, name, fn))
            setattr(mod, name, wrap(fn, mod))
    if router is not None and any(m is router for m in block.modules()):
        def record(mod, a, out):
            w, idx, logits = normalize_output("router", out, router_output=read_router)[:3]
            logits = logits.float().reshape(-1, logits.shape[-1])
            rec.add("logits", logits)
            with torch.no_grad():
                rec.add("scores", routing.scores(logits, args))
                rec.add("selection", selection_scores(mod, logits, args)[0])
            rec.add("topk", idx.reshape(-1, idx.shape[-1]))
            rec.add("weights", w.reshape(-1, w.shape[-1]))
        handles.append(router.register_forward_hook(record))
    try:
        yield
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
        for h in handles:
            h.remove()


# ---------------------------------------------------------------- comparing
def _rows(arrays: list) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1, np.shape(a)[-1]) for a in arrays])


def heads_as(ref, cand):
    """`cand` in `ref`'s layout where the two hold per-head rows in the other order: [B, heads, T, d] on one side,
    [B, T, heads, d] on the other (EXAONE 4's q/k norm runs on [B, heads, T, d], Qwen3's on [B, T, heads, d]); the
    axes told apart by their sizes (with as many heads as tokens the layouts cannot be told apart: left as it is)."""
    a, b = np.shape(ref), np.shape(cand)
    if len(a) == len(b) == 4 and a != b and a == (b[0], b[2], b[1], b[3]):
        return np.swapaxes(np.asarray(cand), 1, 2)
    return cand


def compare_point(name: str, ref: list, cand: list, lim: dict, noise: list | None = None,
                  precision: str = "fp32", scores: tuple | None = None) -> Point:
    """`noise`: HF's own outputs of the point at a noise-relative precision (bf16), on the same
    inputs: the point is then judged as the block rows are, against that precision's own error
    there (thresholds.noise_limits), the table as the floor. `scores` (the topk point): (the
    reference's selection scores, HF's at the precision or None), for routing replay's rule: a token
    whose experts differ is a tie only where the reference's gap between the experts exchanged is
    within tie_factor x the precision's own selection error there (at least the median token's)."""
    from oracle.verdict import thresholds
    from oracle.verdict.metrics import tensor_metrics

    if (cand is None or not cand) and ref:
        return Point(name, Status.FAIL, ratio=float("inf"), reason="HF computes it; the candidate does not")
    if cand is None or not cand or any(c is None for c in cand):
        return Point(name, Status.NA, reason="not recorded by the candidate")
    if ref is None or not ref or any(r is None for r in ref):
        return Point(name, Status.NA, reason="not exposed by HF's module")
    if len(ref) != len(cand):
        return Point(name, Status.NA, reason=f"computed {len(ref)} time(s) by HF, {len(cand)} by the candidate")
    cand = [heads_as(r, c) for r, c in zip(ref, cand)]
    shapes = [np.shape(r) for r in ref], [np.shape(c) for c in cand]
    if shapes[0] != shapes[1] and not all(a[-1:] == b[-1:] and np.prod(a) == np.prod(b) for a, b in zip(*shapes)):
        i = next(i for i, (a, b) in enumerate(zip(*shapes)) if a != b)
        a, b = shapes[0][i], shapes[1][i]
        if a[:-1] == b[:-1]:  # the same rows, another number of features (experts, heads x dims): computed wrong
            return Point(name, Status.FAIL, ratio=float("inf"),
                         reason=f"another last dimension: HF {list(a)}, candidate {list(b)}")
        return Point(name, Status.NA, reason=f"shapes differ: HF {list(a)}, candidate {list(b)}")
    r, c = _rows(ref), _rows(cand)
    same_inf = np.isinf(r) & (r == c)  # a left-out group's -inf on both sides is agreement (NaN never is)
    r, c = np.where(same_inf, 0.0, r), np.where(same_inf, 0.0, c)
    if name == "topk":  # the chosen experts, as sets per token
        differ = {i for i, (a, b) in enumerate(zip(r.astype(int).tolist(), c.astype(int).tolist())) if set(a) != set(b)}
        m = {"agreement": 1.0 - len(differ) / max(len(r), 1)}
        bound = tie_bounds(scores, lim, precision, len(r)) if differ and scores is not None else None
        if bound is not None:  # routing replay's rule (oracle/verdict/replay.py): each difference a tie or a divergence
            from oracle.verdict.replay import exchange_gap

            ref_s = _rows(scores[0])
            gaps = {i: exchange_gap(ref_s[i], r[i].astype(int), c[i].astype(int)) for i in differ}
            beyond = sorted(i for i in differ if gaps[i] > bound[i])
            m["ties"], m["divergences"] = len(differ) - len(beyond), len(beyond)
            if not beyond:
                return Point(name, Status.PASS, m, 0.0, f"{len(differ)} token(s) routed elsewhere, each a tie within "
                             f"the bound measured at {precision} (routing replay)")
        return Point(name, Status.FAIL if differ else Status.PASS, m, float("inf") if differ else 0.0)
    m = tensor_metrics(r, c, lim["atol"], lim["rtol"])
    status, ratio = thresholds.judge_tensor(m, lim)
    if status == Status.FAIL and "noise_factor" in lim and noise and all(n is not None for n in noise):
        h = np.where(same_inf, 0.0, _rows(noise)) if _rows(noise).shape == r.shape else None
        if h is not None:  # beyond the table: within the precision's own error here?
            status, ratio = thresholds.judge_noise(m, thresholds.noise_row_limits(lim, r, h, precision, m))
    keep = ("max_abs", "rel_l2", "nonfinite", "noise_max_abs", "noise_rel_l2")
    return Point(name, status, {k: m[k] for k in keep if k in m}, ratio)


def tie_bounds(scores: tuple, lim: dict, precision: str, n: int):
    """Per token: the tie bound of the drilled router's choice, tie_factor x HF's own selection error at
    the precision (at least the median token's); None where it was not measured (the point is then
    judged exactly)."""
    from oracle.verdict import thresholds
    from oracle.verdict.metrics import score_resolution

    ref_s, noise_s = scores
    factor = thresholds.limits(precision, "router").get("tie_factor") if precision != "fp32" else None
    if noise_s is None or factor is None:
        return None
    r, h = _rows(ref_s), _rows(noise_s)
    if r.shape != h.shape or r.shape[0] != n:
        return None
    both = np.isfinite(r) & np.isfinite(h)
    err = np.where(both, np.abs(np.where(both, h, 0.0) - np.where(both, r, 0.0)), 0.0).max(axis=-1)
    err = np.where((np.isfinite(r) != np.isfinite(h)).any(axis=-1), np.inf, err)
    finite = err[np.isfinite(err)]
    return factor * np.maximum(err, float(np.median(finite)) if finite.size else 0.0) + score_resolution(r, precision)


def verdict(layer, kind: str, points: list[Point], seconds: float = 0.0) -> Drill:
    where = f"{place(layer)} {kind}"
    first = next((p for p in points if p.status == Status.FAIL), None)
    before = [p for p in points[: points.index(first)] if p.status == Status.PASS] if first else []
    if first is None:
        text = (f"{where}: every point within its limit (worst ratio "
                f"{max((p.ratio for p in points if p.status == Status.PASS), default=0.0):.3g})")
        return Drill(layer, kind, points, None, text, seconds)
    agree = (f"; {', '.join(f'`{p.name}`' for p in before[-3:])} agree, ratio <= "
             f"{max(p.ratio for p in before):.3g}") if before else "; it is the block's first point"
    return Drill(layer, kind, points, first.name,
                 f"{where}: first divergence at `{first.name}`, ratio {first.ratio:.3g}{agree}", seconds)


def point_limits(precision: str, kind: str, family: str, backend: str, reduction: int) -> dict:
    """A point's limits: its block's table at the model's width (a router's table has only weight
    limits: its points, logits to weights, take the moe table's, the same arithmetic's)."""
    from oracle.verdict import thresholds

    lim = thresholds.limits(precision, kind, family, backend)
    if "atol" not in lim:
        lim = thresholds.limits(precision, "moe", family, backend)
    return thresholds.at_width(lim, reduction)


def drill(ref, key, cand, hf, lim: dict, noise=None, precision: str = "fp32") -> Drill:
    """Both sides' points of block `key` on the reference's calls (`hf`: an HF fp32 candidate,
    exporters/torch/hf.py), compared in the candidate's program order: the submodule paths both have,
    and the taps either records. `noise`: an HF candidate at a noise-relative `precision` (bf16),
    whose own error on each point sets that point's limit beyond the table (compare_point)."""
    import time

    t = time.perf_counter()
    calls = ref.inputs[key]
    cand_points = cand.run_block_points(key[0], key[1], calls)
    if cand_points is None:
        return Drill(key[0], key[1], [], None, f"n/a: {cand.no_points}", time.perf_counter() - t)
    ref_points = hf.run_block_points(key[0], key[1], calls)
    taps = {n for names in TAPS.values() for n in names}
    recorded = getattr(cand_points, "taps", None)
    recorded = taps if recorded is None else recorded
    names = [n for n in cand_points if n in ref_points or n in taps]
    # what HF computes and the candidate skips: a tap it records where it happens, or a module it has
    # but never ran; a tap the backend cannot record is n/a
    registered = set(getattr(cand_points, "registered", ()))
    skipped = [n for n in ref_points if n not in cand_points and (n in taps or n in registered)]
    order = list(ref_points)
    for n in skipped:  # placed before the candidate's first point that follows it in HF's order
        after = next((m for m in order[order.index(n) + 1:] if m in names), None)
        names.insert(names.index(after) if after else len(names), n)
    ref_points, cand_points = aligned(ref_points), aligned(cand_points)
    noise_points = aligned(noise.run_block_points(key[0], key[1], calls)) if noise is not None else {}
    scores = (ref_points.get("selection"), noise_points.get("selection")) if ref_points.get("selection") else None
    points = [compare_point(n, ref_points.get(n), cand_points.get(n), lim, noise_points.get(n), precision,
                            scores if n == "topk" else None)
              if n in cand_points or n in recorded
              or n not in taps else Point(n, Status.NA, reason="not exposed by the backend (computed inline)")
              for n in names]
    d = verdict(key[0], key[1], points, time.perf_counter() - t)
    d.build_s = getattr(cand_points, "build_s", 0.0)
    return d


def aligned(pts: dict) -> dict:
    """Top-k weights in expert order: each token's k weights sorted by its chosen experts' ids (a
    backend may list the k in another order)."""
    if "weights" not in pts or "topk" not in pts or len(pts["weights"]) != len(pts["topk"]):
        return pts
    out = copy.copy(pts)  # (a Points keeps its registered paths and taps)
    w_sorted = []
    for w, idx in zip(pts["weights"], pts["topk"]):
        w2, i2 = np.reshape(w, (-1, np.shape(w)[-1])), np.reshape(idx, (-1, np.shape(idx)[-1]))
        if w2.shape != i2.shape:
            return pts
        w_sorted.append(np.take_along_axis(w2, np.argsort(i2, axis=-1, kind="stable"), axis=-1))
    out["weights"] = w_sorted
    return out
