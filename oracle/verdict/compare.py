"""Block rows: the candidate's outputs of each block against the reference's, judged by the limits
of the row's precision (fixed tables, HF's own error at a reduced precision, or the in-situ rule),
router near ties read off the reference's gaps. Pure comparisons plus `block_rows`, which asks the
candidate for each block."""

from __future__ import annotations

import math
import numpy as np

from oracle.verdict import insitu, thresholds
from oracle.backend import CheckSpec, ModelSource
from oracle.verdict.metrics import (OutputError, as_array, rounding, router_metrics, score_resolution, tensor_metrics,
                                    top2_margin, weight_diffs)
from oracle.verdict.noise import score_error
from oracle.verdict.replay import differences, plan_of
from oracle.reports.result import BlockRow, Status


def dtype_name(x) -> str | None:
    """The dtype a candidate returned: torch and numpy arrays; None when unknown."""
    dt = getattr(x, "dtype", None)
    return None if dt is None else str(dt).rsplit(".", 1)[-1]  # torch.float32, mlx.core.float32, float32


def expected_dtype(spec) -> str | None:
    try:
        return thresholds.limits(spec.precision, "output", spec.family, spec.backend).get("dtype")
    except KeyError:
        return None


def shape_text(a) -> str:
    return "[" + ", ".join(map(str, a.shape)) + "]"


def _rows(a: np.ndarray, width: int) -> np.ndarray:
    """[..., width] -> [N, width] (a candidate may drop or keep the batch dimension)."""
    return a.reshape(-1, width) if a.ndim and a.shape[-1] == width else a.reshape(1, -1)


def candidate_arrays(kind: str, outs, ref_outs) -> list:
    """A candidate's outputs for one block as host arrays, one per call, each the
    reference's shape up to leading 1s: router (weights [T, k] float64, indices [T, k] int64),
    others [T, H] float64. OutputError says what is wrong (count, None, a tuple where an
    array is expected, a shape) and for which call."""
    if not isinstance(outs, (list, tuple)):
        raise OutputError(f"run_block returned a {type(outs).__name__}, expected a list with one output per call")
    if len(outs) != len(ref_outs):
        raise OutputError(f"{len(outs)} output(s) for {len(ref_outs)} call(s)")
    arrays = []
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        try:
            if kind == "router":
                if not isinstance(o, (tuple, list)) or len(o) != 2:
                    what = "None" if o is None else f"a {type(o).__name__}" + (
                        f" of {len(o)}" if isinstance(o, (tuple, list)) else "")
                    raise OutputError(f"{what} where (weights [T, k], indices [T, k]) is expected")
                rw, ri = r
                want = (int(ri.size // ri.shape[-1]), int(ri.shape[-1]))
                w, idx = as_array(o[0]), as_array(o[1], np.int64)
                for name, a in (("weights", w), ("indices", idx)):
                    a2 = _rows(a, want[1]) if a.ndim else a.reshape(1, 1)
                    if a2.shape != want:
                        got = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
                        raise OutputError(f"{name} shape {shape_text(got)} vs reference [{want[0]}, {want[1]}]")
                arrays.append((w.reshape(want), idx.reshape(want)))
            else:
                want = (int(r.size // r.shape[-1]), int(r.shape[-1]))
                a = as_array(o)
                if a.size != want[0] * want[1] or (a.ndim and a.shape[-1] != want[1]):
                    got = a.reshape(-1, a.shape[-1]) if a.ndim else a
                    raise OutputError(f"shape {shape_text(got)} vs reference [{want[0]}, {want[1]}]")
                arrays.append(a.reshape(want))
        except OutputError as e:
            raise OutputError(f"call {i}: {e}") from None
    return arrays


def invalid_row(key, mode, lim, detail, reason: str, status: Status = Status.FAIL) -> BlockRow:
    """A row the candidate's output could not be compared for (fail) or whose block raised (error)."""
    field = "exception" if status == Status.ERROR else "invalid_output"
    return BlockRow(key[0], key[1], status, mode, {field: reason, "nonfinite": 0}, lim, float("inf"), detail)


def reduction_length(args) -> int:
    """The longest dot product of the model's blocks (what fp32 summation error grows with)."""
    mla = args.attention.mla
    return max(args.hidden_size, args.moe_intermediate_size, args.shared_expert_intermediate_size,
               args.intermediate_size, *((mla.q_lora_rank, mla.kv_lora_rank) if mla else ()))


def router_gaps(ref, layer: int, n: int | None = None, dtype=np.float32, weights: bool = True) -> np.ndarray:
    """The reference's k-th minus (k+1)-th selection score per token of `layer`'s router calls
    (the first n: the sequence's calls come first, then the expert probes); for a group-limited
    router the smaller of that and the margin of its group choice; with `weights`, also of the
    decisions that set its weights (sparsemixer's masks: the block rows judge the weights; e2e
    does not excuse a step for them: routing replay, oracle/verdict/replay.py)."""
    p = -np.sort(-np.concatenate(ref.router_probs[layer])[:n].astype(dtype), axis=-1)  # descending
    k = ref.outputs[layer, "router"][0][1].shape[-1]
    with np.errstate(invalid="ignore"):  # -inf (a group left out) below the k-th: an infinite gap
        gap = p[:, k - 1] - p[:, k] if p.shape[-1] > k else np.full(p.shape[0], np.inf)
    if layer in ref.group_gaps:
        gap = np.minimum(gap, np.concatenate(ref.group_gaps[layer])[:n])
    if weights and layer in ref.weight_gaps:
        gap = np.minimum(gap, np.concatenate(ref.weight_gaps[layer])[:n])
    return gap


def reference_margins(ref) -> dict:
    """How far the reference is from ties: token top-2 logit margins, router k-th vs (k+1)-th gap."""
    P = ref.prompt_len
    margins = [top2_margin(lg[-1]) for lg in ref.logits]
    gaps = [float(router_gaps(ref, layer).min()) for layer in ref.router_probs]
    return {"min_token_margin": min(margins), "token_margins": margins,
            "min_router_gap": min(gaps) if gaps else None, "prompt_len": P,
            "expert_coverage": {str(k): v for k, v in ref.coverage.items()}}


def tie_gaps(ref, layer: int, spec, noise=None, n: int | None = None, in_model: bool = False):
    """The near-tie gap per token of `layer`'s first n router calls (an array) or for all (a
    number): with the precision's measured error (oracle/verdict/noise.py), `tie_factor` times its error on
    that token's selection scores (the logit gap against the logit error): on the reference's
    router inputs (a block row), or inside HF's whole run at this precision (`in_model`: e2e, whose
    router inputs carry the upstream layers' error); else the router table's fixed tie gap,
    scaled to the number of experts."""
    router_lim = thresholds.limits(spec.precision, "router", spec.family, spec.backend)
    scores = None if noise is None else (noise.e2e_scores if in_model else noise.scores).get(layer)
    if scores is not None and "tie_factor" in router_lim:
        ref_scores = np.concatenate(ref.router_probs[layer])[:n]
        return (router_lim["tie_factor"] * score_error(ref.router_probs[layer], scores, n)
                + score_resolution(ref_scores, spec.precision))
    return thresholds.tie_gap(router_lim, ref.router_probs[layer][0].shape[-1])


def compare_block(ref, key, outs, spec, layer_types, reduction: int = 0, noise=None, upstream: list | None = None,
                  aligned: tuple | None = None, selection: list | None = None) -> BlockRow:
    """One block row. `noise` (oracle/verdict/noise.py, reduced precisions): the row is judged against HF's own
    error at this precision (its moe and layer blocks forced to the reference's selection). `upstream`
    (oracle/verdict/insitu.py, an in-situ row at a precision with an in_situ rule): HF fp32's outputs on the
    candidate's own upstream, what a correct block makes of the error the row's input carries.
    Routing replay (oracle/verdict/replay.py): a router row lists every token its selection differs from the
    reference's, each a tie within the bound measured there or a divergence (which fails); a moe or
    layer row whose candidate chose other experts somewhere is judged against `aligned` (HF fp32's
    outputs with the candidate's selection forced, and HF at the precision with it: (outputs, noise
    outputs or None)); every token is compared. `selection`: the candidate's experts per call where its
    row's block routed (the router row's, or what the candidate reported inside the block)."""
    layer, kind = key
    lim = thresholds.at_width(thresholds.limits(spec.precision, kind, spec.family, spec.backend), reduction)
    detail = layer_types[layer] if kind == "attention" else ""
    try:
        arrays = candidate_arrays(kind, outs, ref.outputs[key])
    except OutputError as e:
        return invalid_row(key, "isolated", lim, detail, str(e))
    if kind == "router":
        ref_w = np.concatenate([w.reshape(-1, w.shape[-1]) for w, _ in ref.outputs[key]])
        ref_i = np.concatenate([i.reshape(-1, i.shape[-1]) for _, i in ref.outputs[key]])
        cand_w = np.concatenate([w for w, _ in arrays])
        cand_i = np.concatenate([i for _, i in arrays])
        gaps, tie = router_gaps(ref, layer, dtype=np.float64), tie_gaps(ref, layer, spec, noise)
        rule = thresholds.in_situ(spec.precision) if upstream is not None else None
        own = None  # in-situ: HF's routing of the candidate's own upstream (its input differed before)
        if rule:
            own = (np.concatenate([w.reshape(-1, w.shape[-1]) for w, _ in upstream]).astype(np.float64),
                   np.concatenate([i.reshape(-1, i.shape[-1]) for _, i in upstream]))
        # each token whose experts differ: a tie only where the reference's gap between the experts
        # exchanged is within the bound measured there (oracle/verdict/replay.py)
        bound = np.broadcast_to(np.asarray(tie, np.float64), gaps.shape)
        wg = ref.weight_gaps.get(layer)
        gg = ref.group_gaps.get(layer)
        diffs = differences([ref_i], [(cand_i, cand_w)], [np.concatenate(ref.router_probs[layer])], [bound],
                            [np.arange(len(ref_i))], layer, [ref_w] if wg else None,
                            [np.concatenate(wg)] if wg else None, spec.precision,
                            [np.concatenate(gg)] if gg else None) if ref_i.shape == cand_i.shape else []
        exchange_tie = np.zeros(len(ref_i), dtype=bool)
        exchange_tie[[d.position for d in diffs if d.verdict == "tie" and d.what == "experts"]] = True
        # a token routed as HF routes the candidate's own upstream agrees
        m = router_metrics(ref_w, ref_i, cand_w, cand_i, gaps, tie, own=own, selection_tie=exchange_tie)
        h = noise.outputs.get(key) if noise is not None and "noise_factor" in lim else None
        if h is not None and "shape_mismatch" not in m:  # the weights: against HF's own weight error
            nm = router_metrics(ref_w, ref_i, np.concatenate([w.reshape(-1, w.shape[-1]) for w, _ in h]),
                                np.concatenate([i.reshape(-1, i.shape[-1]) for _, i in h]), gaps, tie)
            # storing the weights at this precision, at least half a unit in the last place of the
            # largest (a weight of exactly 1, as sparsemixer's, still allows its neighbours' rounding)
            stored = max(float(np.abs(rounding(ref_w, spec.precision) - ref_w).max()),
                         float(np.abs(ref_w).max()) * 2.0 ** -9) if ref_w.size else 0.0
            lim = {**lim, "weight_atol": lim["noise_factor"] * nm["weight_max_abs"] + lim["noise_floor"] * stored}
            m["noise_weight_max_abs"], m["noise_topk_agreement"] = nm["weight_max_abs"], nm["topk_agreement"]
        if own is not None and "shape_mismatch" not in m:  # in-situ: + factor x the weight error its upstream carries
            um = router_metrics(ref_w, ref_i, *own, gaps, tie)
            m["upstream_weight_max_abs"] = um["weight_max_abs"]
            lim = {**lim, "upstream_factor": rule["upstream_factor"], "table_weight_atol": lim["weight_atol"],
                   "weight_atol": lim["weight_atol"] + rule["upstream_factor"] * um["weight_max_abs"]}
        if np.ndim(tie):
            m["tie_tokens"] = int((gaps < tie).sum())
        if diffs:
            m["routing_differences"] = [d.as_dict() for d in diffs]
        status, ratio = thresholds.judge_router(m, lim)
    else:
        expected, h_aligned = aligned if aligned is not None else (ref.outputs[key], None)
        r = np.concatenate([np.asarray(o, np.float64).reshape(-1, o.shape[-1]) for o in expected])
        c = np.concatenate(arrays)
        rule = thresholds.in_situ(spec.precision) if upstream is not None else None
        lim = thresholds.at_scale(lim, math.sqrt(float(np.mean(r * r))))
        m = tensor_metrics(r, c, lim["atol"], lim["rtol"])
        want, got = expected_dtype(spec), dtype_name(outs[0]) if outs else None
        if want and got and got != want:  # e.g. an unconditional cast that changes the output dtype
            m["dtype_mismatch"] = f"{got} (expected {want})"
        h = h_aligned if aligned is not None else (noise.outputs.get(key) if noise is not None else None)
        if h is not None and "noise_factor" in lim:  # HF at this precision, the same inputs and routing
            h = np.concatenate([np.asarray(o, np.float64).reshape(-1, o.shape[-1]) for o in h])
            lim = thresholds.noise_row_limits(lim, r, h, spec.precision, m)
        else:
            h = None
        if rule and "shape_mismatch" not in m and "dtype_mismatch" not in m:
            u = np.concatenate([o.reshape(-1, o.shape[-1]) for o in upstream]).astype(np.float64)
            lim = upstream_metrics(lim, rule, r, c, u, m, h if h is not None and h.shape == r.shape else None)
        if aligned is not None:  # judged against the routing-aligned reference; the plain comparison beside
            plain = np.concatenate([o.reshape(-1, o.shape[-1]) for o in ref.outputs[key]]).astype(np.float64)
            if plain.shape == c.shape:
                m["plain_max_abs"] = float(np.abs(plain - c).max()) if c.size else 0.0
            m["aligned_tokens"] = len(block_differences(ref, layer, selection, spec, len(outs)))
        judge = (thresholds.judge_upstream if "upstream_allclose_ratio" in m
                 else thresholds.judge_noise if "noise_max_abs" in m else thresholds.judge_tensor)
        status, ratio = judge(m, lim)
    return BlockRow(layer, kind, status, "isolated", m, lim, ratio, detail)


def block_differences(ref, layer: int, selection: list | None, spec, calls: int | None = None) -> list:
    """The tokens of a block's calls where the candidate's choice (`selection`: per call, indices or
    (indices, weights)) is not the reference's: oracle.verdict.replay.Difference each (position: the token's
    index in its call; the verdicts are the router row's to give)."""
    if not selection:
        return []
    outs = ref.outputs[layer, "router"][: calls or len(selection)]
    n = len(outs)
    gaps, groups = ref.weight_gaps.get(layer), ref.group_gaps.get(layer)
    return differences([i for _, i in outs], selection[:n], ref.router_probs[layer][:n], [np.inf] * n,
                       [np.arange(np.asarray(i).reshape(-1, np.asarray(i).shape[-1]).shape[0]) for _, i in outs],
                       layer, [w for w, _ in outs] if gaps else None, gaps[:n] if gaps else None, spec.precision,
                       groups[:n] if groups else None)


def upstream_metrics(lim: dict, rule: dict, r: np.ndarray, c: np.ndarray, u: np.ndarray, m: dict,
                     h: np.ndarray | None = None) -> dict:
    """The limits of an in-situ row whose reference is `r` and candidate `c`, from `u`, HF fp32 on
    the candidate's own upstream (oracle/verdict/insitu.py): element by element |c - r| <= atol + rtol |r| +
    upstream_factor |u - r| (an element's propagated error follows what was summed into it
    upstream, not its own magnitude) [+ noise_factor max |h - r| at a noise-relative precision: `h`,
    HF at it on the reference's input, the block's own rounding, whose elements are another draw of
    the same noise], rel_l2 <= the row's + upstream_factor
    x u's. Records u's
    error (`upstream_max_abs`, `upstream_rel_l2`), the candidate's max_abs as a multiple of it
    (`vs_upstream`), the elementwise ratio and the first element beyond it in `m`."""
    if u.shape != r.shape:
        return lim
    um = tensor_metrics(r, u, lim["atol"], lim["rtol"])
    m["upstream_max_abs"], m["upstream_rel_l2"] = um["max_abs"], um["rel_l2"]
    if um["max_abs"] > 0:  # nothing upstream (the first layer): the table alone, no ratio
        m["vs_upstream"] = m["max_abs"] / um["max_abs"]
    lim = thresholds.upstream_limits(lim, rule, um)
    prop = np.nan_to_num(np.abs(u - r), nan=0.0, posinf=0.0)  # a non-finite upstream allows nothing more
    d = np.abs(c - r)
    tol = lim["atol"] + lim["rtol"] * np.abs(r) + lim["upstream_factor"] * prop
    if h is not None and "noise_factor" in lim:  # rounding noise is not elementwise-alike: its max, scaled
        tol = tol + lim["noise_factor"] * float(np.nan_to_num(np.abs(h - r), nan=0.0, posinf=0.0).max(initial=0.0))
    excess = np.where(np.isfinite(d), d / tol, np.inf)
    m["upstream_allclose_ratio"] = float(excess.max()) if excess.size else 0.0
    bad = np.flatnonzero(~(excess <= 1.0))
    m["first_divergence"] = None
    if bad.size:
        i = int(bad[0])
        m["first_divergence"] = {"index": [int(v) for v in np.unravel_index(i, r.shape)], "reference": float(r.flat[i]),
                                 "candidate": float(c.flat[i]) if np.isfinite(c.flat[i]) else str(c.flat[i])}
    return lim


def block_rows(ref, cand, spec: CheckSpec, args, progress, noise=None,
               src: ModelSource | None = None, align=None) -> list[BlockRow]:
    """Every block row of the candidate against the reference. A block that raises is that
    row's error; RuntimeError when every block raised. With `src` (the checkpoint), in-situ rows at
    a precision with an in_situ rule are judged against HF fp32 run on the candidate's own upstream
    (oracle/verdict/insitu.py). `align(key, selection)` (oracle/verdict/replay.py, routing replay): a moe or layer row
    whose candidate chose other experts than the reference's on some token is judged against HF with the
    candidate's selection forced: (fp32 outputs, outputs at the precision or None)."""
    keys = ref.block_keys()
    rows, errors, outputs, selections = {}, [], {}, {}
    mode_of = {key: cand.block_modes.get(key[1], cand.block_mode) for key in keys}
    for n, key in enumerate(keys):
        progress("blocks", n, len(keys))
        mode = mode_of[key]
        try:
            outs = cand.run_block(key[0], key[1], ref.inputs[key])
        except Exception as e:  # this block crashed: its row is an error, the others are still measured
            lim = thresholds.limits(spec.precision, key[1], spec.family, spec.backend)
            detail = args.layer_types[key[0]] if key[1] == "attention" else ""
            reason = f"{type(e).__name__}: {e}"
            errors.append(f"{key[0]} {key[1]}: {reason}")
            rows[key] = invalid_row(key, mode, lim, detail, reason, Status.ERROR)
            continue
        if outs is None:  # a backend may say why (e.g. exporters/iree's not_isolated)
            why = cand.not_isolated.get(key, "not isolated by backend")
            rows[key] = BlockRow(key[0], key[1], Status.NA, mode, {}, {}, 0.0, why)
            continue
        outputs[key] = outs
        if key[1] in ("moe", "layer") and not insitu.is_in_situ(mode):
            selections[key] = block_selection(cand, key[0], len(ref.inputs[key]))
    in_situ = {k: o for k, o in outputs.items() if insitu.is_in_situ(mode_of[k])}
    if in_situ and src is not None and thresholds.in_situ(spec.precision):
        progress("blocks: HF fp32 on the candidate's own upstream (in-situ rows)")
    inputs = {}  # the in-situ blocks' own inputs inside their layers, where the candidate gives them
    for key in in_situ if src is not None and thresholds.in_situ(spec.precision) else ():
        if key[0] is not None and key[1] != "layer":
            try:
                x = cand.block_input(key[0], key[1], ref.inputs[key])
            except Exception:  # noqa: BLE001 - judged on its layer's input instead, as without one
                x = None
            if x is not None:
                inputs[key] = [as_array(a, np.float32).reshape(-1, a.shape[-1]) for a in x]
    upstream, why = in_situ_upstream(ref, spec, src, in_situ, inputs)
    router_sel = {}  # layer -> the candidate's router row selection per call
    for key, outs in outputs.items():
        isolated = not insitu.is_in_situ(mode_of[key])
        if key[1] == "router" and isolated:
            try:
                router_sel[key[0]] = [(np.asarray(as_array(o[1], np.int64)), np.asarray(as_array(o[0])))
                                      for o in outs]
            except Exception:  # noqa: BLE001 - a malformed router output: its row says so
                pass
        sel, aligned, note = None, None, None
        if key[1] in ("moe", "layer") and isolated:
            # the block's own choice where the candidate reports it; else its router row's (the moe block's
            # router reads the router row's very input; a layer's router reads the layer's own attention)
            own = selections.get(key)
            sel, diffs, plan = alignment_plan(ref, key, own or router_sel.get(key[0]), spec)
            if align is not None and diffs:
                progress(f"blocks: HF with the candidate's experts forced ({key[0]} {key[1]})")
                try:
                    aligned = align(key, plan)
                except Exception as e:  # noqa: BLE001 - judged against the plain reference, and said
                    note = f"routing replay failed ({type(e).__name__}: {e}): judged against the plain reference"
                if aligned is not None and key[1] == "layer" and not own:
                    aligned, note = routing_followed(ref, key, outs, [(aligned, diffs)], noise,
                                                     "where its router row chose other experts")
        row = compare_block(ref, key, outs, spec, args.layer_types, reduction_length(args), noise,
                            upstream.get(key), aligned, sel)
        if (row.status == Status.FAIL and key[1] == "layer" and isolated and align is not None
                and not selections.get(key) and (key[0], "router") in ref.outputs):
            try:  # its router may have flipped at a near tie inside the layer, unreported: judged again
                alt = near_tie_alternative(ref, key, outs, spec, noise, align, sel, args)
            except Exception as e:  # noqa: BLE001 - the plain verdict stands, and said
                alt, note = None, f"routing replay at the layer's near ties failed ({type(e).__name__}: {e})"
            if alt is not None:
                progress(f"blocks: HF with the layer's near ties swapped ({key[0]} {key[1]})")
                aligned, note = alt
                row = compare_block(ref, key, outs, spec, args.layer_types, reduction_length(args), noise,
                                    upstream.get(key), aligned, sel)
        if note:
            row.metrics["routing"] = note
        if why and insitu.is_in_situ(mode_of[key]):
            row.metrics["upstream"] = why
        row.mode = mode_of[key]
        rows[key] = row
    if errors and len(errors) == len(keys):
        raise RuntimeError(f"every block raised; the first: {errors[0]}")
    return [rows[key] for key in keys]


def near_tie_alternative(ref, key, outs: list, spec, noise, align, sel: list | None, args) -> tuple | None:
    """A failing layer row whose block's own choice is not reported: at each token where the reference's
    router choice is a near tie (its gap within the tie bound, as the router row judges), the layer's
    router, reading the layer's own attention output, may have decided it the other way. HF runs with
    the near decisions taken the other way, and each of those tokens is judged against the nearest of
    HF's plain and swapped outputs (routing_followed). A run for each kind of decision:
    - its experts: the router row's own choice where it differed; a group-limited router's experts of the
      other group where the group choice is the nearer tie (dots1 on executorch-mlx at bf16, trained,
      seed 0, had failed at 15x); else the k-th expert swapped for the next;
    - its weights, where a discrete decision sets them (sparsemixer's masks): the nearest mask decision
      flipped (phimoe on executorch-mlx at bf16, normal, seed 1, had failed at 14x with its experts
      agreeing), and the other experts with their own nearest mask decision flipped (seed 3: the two
      experts that tied also decide the second choice's mask).
    None where no token is a near tie."""
    import torch

    from models.layers import routing

    layer = key[0]
    calls = ref.outputs[layer, "router"][: len(ref.inputs[key])]
    idx = [np.asarray(i).reshape(-1, np.asarray(i).shape[-1]) for _, i in calls]
    total = sum(i.shape[0] for i in idx)
    gaps = router_gaps(ref, layer, total, dtype=np.float64, weights=False)
    bound = np.broadcast_to(np.asarray(tie_gaps(ref, layer, spec, noise, total), np.float64), gaps.shape)
    if noise is not None and layer in noise.e2e_scores:
        # the layer's router reads its own attention's output, which carries that block's error at the
        # precision: the bound measured on router inputs that carry it (HF's whole run at the precision)
        # where wider (dots1 on executorch-mlx at bf16, trained, seed 0: a group choice 1.1x the router
        # row's bound flipped inside the layer, failing it at 15x)
        bound = np.maximum(bound, np.broadcast_to(np.asarray(tie_gaps(ref, layer, spec, noise, total, in_model=True),
                                                             np.float64), gaps.shape))
    # the weights' decisions (sparsemixer's masks): their margin, and the weights had the nearest gone otherwise
    weight_gap = (np.concatenate(ref.weight_gaps[layer])[:total].astype(np.float64)
                  if layer in ref.weight_gaps else None)
    # a group-limited router whose group choice is the nearer tie: the other group's experts (computed
    # from the unmasked scores at the capture: reference.group_alternative)
    group_gap = (np.concatenate(ref.group_gaps[layer])[:total].astype(np.float64)
                 if layer in ref.group_gaps and layer in ref.group_alternatives else None)
    experts_alt, weights_alt, both_alt, t0 = [], [], [], 0
    for c, chosen in enumerate(idx):
        chosen, n = chosen.copy(), chosen.shape[0]
        s = np.asarray(ref.router_probs[layer][c], np.float64).reshape(n, -1)
        w = np.asarray(calls[c][0], np.float32).reshape(chosen.shape)
        mine = None if sel is None or c >= len(sel) else np.asarray(sel[c][0] if isinstance(sel[c], tuple) else sel[c])
        for t in np.flatnonzero(gaps[t0:t0 + n] <= bound[t0:t0 + n]):
            if mine is not None and set(mine.reshape(chosen.shape)[t].tolist()) != set(chosen[t].tolist()):
                chosen[t] = mine.reshape(chosen.shape)[t]  # the router row's own flip
            elif group_gap is not None and group_gap[t0 + t] <= gaps[t0 + t]:  # the group choice is the tie
                chosen[t] = np.asarray(ref.group_alternatives[layer][c]).reshape(chosen.shape)[t]
            else:
                rest = [e for e in np.argsort(-s[t]) if e not in set(chosen[t].tolist()) and np.isfinite(s[t, e])]
                if rest:
                    chosen[t][np.argmin(s[t, chosen[t]])] = rest[0]
        experts_alt.append(chosen)
        if weight_gap is not None:  # the same experts, the nearest mask decision flipped where it is near;
            # and the other experts with the nearest mask decision of their own flipped too (the pair that tied
            # decides the mask as well: phimoe on executorch-mlx at bf16, normal, seed 3)
            near = weight_gap[t0:t0 + n] <= bound[t0:t0 + n]
            scores = torch.as_tensor(s, dtype=torch.float32)
            flipped = routing.weight_alternative(scores, torch.as_tensor(idx[c]), args).numpy()
            weights_alt.append((idx[c], np.where(near[:, None], flipped, w)))
            both_alt.append((chosen, routing.weight_alternative(scores, torch.as_tensor(chosen), args).numpy()))
        t0 += n
    positions = [np.arange(i.shape[0]) for i in idx]
    options = []
    for alt, discrete in ((experts_alt, False), (weights_alt, False), (both_alt, True)):
        diffs = block_differences(ref, layer, alt, spec, len(calls)) if alt else []
        if discrete:  # only where the experts were swapped
            diffs = [d for d in diffs if d.what == "experts"]
        if diffs:
            options.append((align(key, plan_of(alt, diffs, layer, positions, discrete)), diffs))
    if not options:
        return None
    return routing_followed(ref, key, outs, options, noise,
                            "where the reference's choice is a near tie (its near decisions taken the other way)")


def routing_followed(ref, key, outs: list, options: list, noise, where: str) -> tuple:
    """A layer row whose block's own choice the candidate does not report (a compiled block program):
    its router reads the layer's own attention output, so at a token where another choice is
    legitimate the layer may have made either. `options`: [(HF's outputs with a choice forced: (fp32,
    precision), the tokens where that choice differs: Differences)]. At each such token the row is
    judged against the reference with the routing its output is nearest to: HF's plain or one of the
    forced, all legitimate answers; every other token against the plain reference. Returns (the mixed
    (fp32, precision) outputs, what was done)."""
    plain_at = noise.outputs.get(key) if noise is not None else None
    rows = lambda o: np.asarray(o, np.float64).reshape(-1, np.asarray(o).shape[-1])  # noqa: E731
    mixed = [rows(o).copy() for o in ref.outputs[key]]
    with_at = plain_at is not None and all(at is not None for (_, at), _ in options)
    mixed_at = [rows(o).copy() for o in plain_at] if with_at else None
    where_each = [{(d.call, d.position) for d in diffs} for _, diffs in options]  # the tokens each option forces
    tokens = sorted(set().union(*where_each))
    followed = 0
    for call, t in tokens:
        c = rows(as_array(outs[call], np.float32))[t]
        best, pick = np.abs(c - mixed[call][t]).max(), None
        for ((fp32, at), _), forced_at in zip(options, where_each):
            if (call, t) in forced_at:
                forced_row = rows(fp32[call])[t]
                if np.abs(c - forced_row).max() < best:
                    best, pick = np.abs(c - forced_row).max(), (forced_row, at)
        if pick is not None:
            followed += 1
            mixed[call][t] = pick[0]
            if mixed_at is not None:
                mixed_at[call][t] = rows(as_array(pick[1][call], np.float32))[t]  # a bf16 tensor: np.asarray refuses it
    shaped = lambda new, like: [n.reshape(np.asarray(o).shape) for n, o in zip(new, like)]  # noqa: E731
    note = (f"the layer block's own choice is not reported: at {len(tokens)} token(s) {where}, {followed} judged "
            "against HF with that choice forced and the rest against HF's own (the nearest; all legitimate at a tie)")
    only_at = options[0][0][1] if len(options) == 1 else None  # no plain noise: the one forced run's, as before
    return (shaped(mixed, ref.outputs[key]), shaped(mixed_at, plain_at) if mixed_at is not None else only_at), note


def alignment_plan(ref, key, sel: list | None, spec) -> tuple:
    """(the candidate's selection of a moe or layer row per call (its own, else its router row's), the tokens
    where it is not the reference's (block_differences), the forcing plan for HF there (replay.plan_of), None
    where nothing differs)."""
    sel = sel[: len(ref.inputs[key])] if sel is not None else None
    diffs = block_differences(ref, key[0], sel, spec, len(ref.inputs[key]))
    if not diffs:
        return sel, diffs, None
    positions = [np.arange(np.asarray(i).reshape(-1, np.asarray(i).shape[-1]).shape[0])
                 for _, i in ref.outputs[key[0], "router"][: len(sel)]]
    return sel, diffs, plan_of(sel, diffs, key[0], positions, key[0] in ref.weight_gaps)


def aligning(ref, spec, align):
    """A callback for a candidate's layer-by-layer pass (Candidate.ahead's `on_block`: (key, its outputs, the
    routes its run logged)): where a moe or layer row's selection differs from the reference's, HF's routing
    replay of that row (`align`, noise.block_aligner) is run then, while the layer's tensors are at hand
    (oracle.reference.streaming.RECENT), and kept for the row (block_rows asks the same plan: answered from it). The
    selection as block_rows reads it; a row it cannot read so is replayed when judged, as before."""
    routers = {}

    def on_block(key, outs, routes):
        try:
            if key[1] == "router":
                routers[key[0]] = [(np.asarray(as_array(o[1], np.int64)), np.asarray(as_array(o[0]))) for o in outs]
            elif key[1] in ("moe", "layer"):
                own = [entry[key[0]] for entry in routes or () if key[0] in entry]
                own = own if len(own) >= len(ref.inputs[key]) else None
                _, diffs, plan = alignment_plan(ref, key, own or routers.get(key[0]), spec)
                if diffs:
                    align(key, plan, ahead=True)
        except Exception:  # noqa: BLE001 - an optimisation: the row replays (and reports) it itself
            pass
    return on_block


def block_selection(cand, layer: int, calls: int) -> list | None:
    """The experts the candidate's router of `layer` chose in each call of its last run_block, where it
    reports them (Candidate.block_routes); None otherwise."""
    try:
        log = cand.block_routes()
    except Exception:  # noqa: BLE001 - not reported
        return None
    if not log:
        return None
    sel = [entry[layer] for entry in log if layer in entry]
    return sel if len(sel) >= calls else None


def in_situ_upstream(ref, spec: CheckSpec, src: ModelSource | None, outputs: dict,
                     inputs: dict | None = None) -> tuple[dict, str | None]:
    """(key -> HF fp32's outputs on the candidate's own upstream, or {}; why it was not measured,
    or None) for the candidate's in-situ rows, at a precision with an in_situ rule; `inputs`: the
    blocks' own inputs (Candidate.block_input), fed to HF's block instead of its layer's stream."""
    if not outputs or src is None or thresholds.in_situ(spec.precision) is None:
        return {}, None
    try:
        arrays = {}
        for key, outs in outputs.items():
            if key[1] != "router":
                try:
                    arrays[key] = candidate_arrays(key[1], outs, ref.outputs[key])
                except OutputError:
                    continue  # that row fails on its own; the layers after it are fed HF's stream
        return insitu.propagated(ref, src, spec, list(outputs), arrays, inputs), None
    except Exception as e:  # judged by the isolated table, and the row says why
        return {}, f"not measured ({type(e).__name__}: {e}): the isolated table judges"
