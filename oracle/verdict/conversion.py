"""Is a shipped file's weights a correct conversion of the checkpoint? Tensor by tensor, in the
format's own layout (the original brought there by the format's own layout rules: the backend's
`shipped_tensors`), each element within what a correct quantizer can produce from the original, and
each tensor (each expert of a stacked one) without a systematic error. Format-agnostic: a format is
described by `Format` (a float type, or an integer grid `deq = step * q + offset` per block).

The element bound, for a grid format: a correct quantizer stores, for each value x, the point of
the block's grid nearest to x (clipped to the grid's range):

    |deq - clip(x)| <= |step| / 2 + slack,       clip distance <= clip_steps * |step| + slack

`slack` covers what a correct quantizer may add to rounding-to-nearest: the rounding of the stored
step and offset where the q were chosen before the grid was rounded to its stored type (`|q|` ulps of
the step, one of the offset: llama.cpp's Q8_0/Q4_0, mlx's affine quantizer at bf16 / fp16), the
rounding of the values to the type the quantizer read them in (half an ulp there), and 4 fp32 ulps
of arithmetic. A quantizer that searches its grid (K-quants, an imatrix) chooses the grid freely but
then rounds every value to it: the same bound. `clip_steps`: how far beyond its grid's range a
correct quantizer of the format may leave a value (0 for a min-max grid; 1 where the grid is built
from one signed extreme: Q4_0, mlx's zero-exact adjustment). A float format (F32, F16, BF16, an
unquantized mlx tensor): within half an ulp of the stored type. Beyond the bound is a conversion
defect: the tensor, the expert or rows, the largest excess in steps (or ulps) and the format's bound.

The systematic fit, per tensor (per expert of a stacked tensor): a scale of 1 % stays inside a q4
step for every element, so elements alone cannot see it. The shipped values are compared with the
nearest point of their own stored grid to each original value (`ideal`):
`D = sum((deq - ideal) x) / sum(x^2)` is the relative scale the shipped tensor adds to what its own
grid gives the original. A correct quantizer departs from `ideal` only on values within `slack` of
a rounding boundary, so D is bounded by `Z_SYSTEMATIC` standard deviations of those values'
rounding flipping together block by block (a block's stored scale rounds once for all its values):
`sigma = sqrt(sum over blocks of (sum over its near-boundary values of |step x|)^2) / sum(x^2)`.
Measured on mlx's and llama.cpp's own quantizers (docs/conversion.md): correct files stay within a
third of the limit; a 1 % scale on a tensor whose grid is rounded after its values (bf16 scales)
needs tens of thousands of elements to be seen, and is seen exactly where the grid is exact (fp32
scales, K-quants).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from oracle.reports.result import Status

Z_SYSTEMATIC = 6.0  # standard deviations of a correct quantizer's near-boundary roundings flipping together
# (mantissa bits, smallest normal exponent) of the float types a format stores values or grids in
FLOATS = {"F32": (23, -126), "F16": (10, -14), "BF16": (7, -126), "F64": (52, -1022)}
CHUNK_ELEMENTS = 1 << 22  # a chunk's elements (float64 temporaries: a few times 32 MiB)


@dataclass(frozen=True)
class Format:
    """How a tensor is stored. A float type (`block` 0, `dtype` F32/F16/BF16), or an integer grid per
    block of `block` values along a row: deq = step * q + offset, q in [qmin, qmax]."""

    name: str  # "Q4_K", "F16", "mlx affine 4-bit g32", ...
    dtype: str = "F32"  # float formats: the stored type
    block: int = 0
    qmin: int = 0
    qmax: int = 0
    grid_dtype: str | None = None  # the type the grid was rounded to after the q were chosen (None: on the stored grid)
    input_dtype: str = "F32"  # the type the quantizer read the values in
    clip_steps: float = 0.0
    # the q were chosen on a step up to this relative distance from the stored one (a search that refits
    # its scale after choosing the q: llama.cpp's legacy types with an imatrix); 0: on the stored step
    search_rel: float = 0.0
    # a grid searched over the block (K-quants) may leave its extremes beyond the range by this share of
    # the range itself (the search minimises the block's error and may give up an outlier)
    clip_range: float = 0.0
    bounded: bool = True  # False: a codebook format (IQ*, TQ*, MXFP4) with no per-element bound here

    def bound(self) -> str:
        if not self.bounded:
            return f"{self.name}: a codebook format, no per-element bound (the fit is reported, not judged)"
        if not self.block:
            return f"{self.dtype}: within half an ulp of {self.dtype}"
        grid = (f" + |q| ulps of the step and one of the offset ({self.grid_dtype}, rounded after the q)"
                if self.grid_dtype else "")
        clip = (f"; clipped at most {self.clip_steps:g} step(s) beyond the grid" if self.clip_steps else
                f"; a searched grid: clipped at most {self.clip_range:.0%} of its range beyond it" if self.clip_range else "")
        return f"{self.name}: nearest point of each block's grid, within half a step{grid}{clip}"


@dataclass
class Chunk:
    """Rows [row0, row0 + r) of a tensor viewed as [rows, n], in the format's layout."""

    row0: int
    x: np.ndarray  # [r, n] the original, through the format's layout rules
    deq: np.ndarray  # [r, n] the shipped values, dequantized by the format's own definition
    step: np.ndarray | None = None  # [r, n // block]
    offset: np.ndarray | None = None  # [r, n // block]
    # [r, n // block] how far the stored grid's range may fall short of the one the quantizer chose, where
    # the step and offset are themselves quantized after it (K-quants' 6-bit sub-scales: half a unit each)
    range_slack: np.ndarray | None = None


@dataclass
class TensorSource:
    """One shipped tensor and where its original comes from."""

    name: str  # the format's name for it
    label: str  # the checkpoint tensor(s) it holds
    shape: tuple
    fmt: Format
    chunks: Callable[[], Iterator[Chunk]]
    unit_rows: int = 0  # rows per expert of a stacked tensor [E, out, in] (0: the whole tensor is one unit)


def ulp(v: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of `dtype` at |v| (its subnormal spacing below the smallest normal): 2^(floor(log2 |v|)
    - mantissa bits), the exponent read with frexp (|v| = m 2^e, m in [0.5, 1): floor(log2 |v|) = e - 1):
    exact, and several times faster than log2 and exp2 (whose log2 rounded up to the next power of two
    for values just below one: twice the spacing there)."""
    bits, emin = FLOATS[dtype]
    a = np.abs(v)
    e = np.frexp(a)[1] - 1
    return np.ldexp(1.0, np.maximum(np.where(a > 0, e, emin), emin) - bits)


@dataclass
class _Unit:
    sxx: float = 0.0  # sum x^2
    sdx: float = 0.0  # sum deq x
    sdi: float = 0.0  # sum (deq - ideal) x
    sig2: float = 0.0  # sum over blocks of (sum over near-boundary values of |step x|)^2
    over: int = 0
    worst: float = -np.inf
    rows: list = field(default_factory=lambda: [None, None])  # first and last row with a value over the bound


STATS_ROWS_ELEMENTS = 1 << 16  # _chunk_stats' rows at a time: float64 temporaries of 512 KiB, cache-sized


@functools.cache
def _pool():
    """Threads for _chunk_stats' row groups (numpy's array operations release the GIL): one per core,
    at most 4 (a few MiB of temporaries each)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=max(1, min(4, len(os.sched_getaffinity(0)))), thread_name_prefix="weights")


def _chunk_stats(fmt: Format, c: Chunk) -> dict:
    """Per row of the chunk: `over` (values beyond the bound), `worst` (the largest excess, in steps or
    ulps), `sxx` (sum x^2), `sdx` (sum deq x), `sdi` (sum (deq - ideal) x) and `sig2` (near-boundary
    |step x| summed per block, squared, summed). A few rows at a time, in threads (their float64
    temporaries stay in the CPU's cache; measured 3x faster than a whole chunk at once, and 2x more on
    2 cores): every statistic is per row, so the numbers do not depend on the grouping."""
    r = len(c.x)
    step = max(1, STATS_ROWS_ELEMENTS // max(1, c.x.shape[1]))
    if r <= step:
        return _rows_stats(fmt, c)
    rows = [Chunk(c.row0 + i, c.x[i:i + step], c.deq[i:i + step],
                  *(None if a is None else a[i:i + step] for a in (c.step, c.offset, c.range_slack)))
            for i in range(0, r, step)]
    parts = list(_pool().map(functools.partial(_rows_stats, fmt), rows))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _rows_stats(fmt: Format, c: Chunk) -> dict:
    x = np.asarray(c.x, np.float64)
    d = np.asarray(c.deq, np.float64)
    out = {"sxx": (x * x).sum(axis=1), "sdx": (d * x).sum(axis=1)}
    excess, sdi, sig2 = _excess(fmt, c, x, d)
    out["over"] = (excess > 0).sum(axis=1) if fmt.bounded else np.zeros(len(x), np.int64)
    out["worst"] = excess.max(axis=1)
    out["sdi"] = sdi if sdi is not None else np.zeros(len(x))
    out["sig2"] = sig2 if sig2 is not None else np.zeros(len(x))
    return out


def _excess(fmt: Format, c: Chunk, x: np.ndarray, d: np.ndarray):
    """(excess [r, n] in steps or ulps, (deq - ideal) x summed per row, near-boundary |step x| per block
    summed, squared and summed per row) of rows x (the original) and d (the shipped values) in float64."""
    arith = 4 * ulp(np.maximum(np.abs(x), np.abs(d)), "F32")
    if not fmt.block:  # a float format: rounding to nearest of the stored type
        u = ulp(x, fmt.dtype)
        excess = (np.abs(d - x) - 0.5 * u - arith) / u
        return excess, None, None
    r, n = x.shape
    nb = n // fmt.block
    # per block [r, nb, 1], broadcast over the block's values [r, nb, block] (no repeated copies)
    x, d, arith = (a.reshape(r, nb, fmt.block) for a in (x, d, arith))
    S = c.step.astype(np.float64).reshape(r, nb, 1)
    B = c.offset.astype(np.float64).reshape(r, nb, 1)
    Sa = np.abs(S)
    safe = np.where(Sa > 0, S, 1.0)
    q = np.where(Sa > 0, np.round((d - B) / safe), 0.0)
    slack = arith + (0.5 * ulp(x, fmt.input_dtype) if fmt.input_dtype != "F32" else 0.0)
    if fmt.grid_dtype:
        slack = slack + np.abs(q) * ulp(S, fmt.grid_dtype) + ulp(B, fmt.grid_dtype)
    if fmt.search_rel:  # the q chosen on a step and offset refitted after them: a share of the grid's extent
        slack = slack + fmt.search_rel * ((fmt.qmax - fmt.qmin) * Sa + np.abs(B))
    ends = (B + S * fmt.qmin, B + S * fmt.qmax)
    lo, hi = np.minimum(*ends), np.maximum(*ends)
    xc = np.minimum(np.maximum(x, lo), hi)
    err = np.abs(d - xc) - (0.5 * Sa + slack)
    short = 0.0 if c.range_slack is None else c.range_slack.astype(np.float64).reshape(r, nb, 1)
    clipped = np.abs(x - xc) - ((fmt.clip_steps + fmt.clip_range * (fmt.qmax - fmt.qmin)) * Sa + short + slack)
    unit = np.where(Sa > 0, Sa, np.maximum(slack, np.finfo(np.float64).tiny))
    excess = np.maximum(err, clipped) / unit
    t = np.where(Sa > 0, (x - B) / safe, 0.0)
    ideal = np.minimum(np.maximum(np.round(t), fmt.qmin), fmt.qmax) * S + B
    near = (np.abs(t - np.floor(t) - 0.5) * Sa <= slack) & (x == xc)
    sdi = ((d - ideal) * x).reshape(r, n).sum(axis=1)
    blocks = (near * np.abs(S * x)).sum(-1)
    return excess.reshape(r, n), sdi, (blocks ** 2).sum(axis=1)


def judge(src: TensorSource) -> dict:
    """One tensor's row: its status, the elements over the bound and the largest excess (where: the
    expert of a stacked tensor, the rows), and the worst unit's systematic fit."""
    fmt = src.fmt
    rows_total = int(np.prod(src.shape[:-1], dtype=np.int64)) if len(src.shape) > 1 else 1
    per = src.unit_rows or rows_total
    units: dict[int, _Unit] = {}
    elements = 0
    for c in src.chunks():
        x = np.asarray(c.x).reshape(len(c.x), -1)  # float64 row group by row group (_chunk_stats)
        d = np.asarray(c.deq).reshape(x.shape)
        if not np.all(np.isfinite(d)):
            bad = np.flatnonzero(~np.isfinite(d).all(axis=1))[0]
            return _row(src, Status.FAIL, elements + x.size, None, {}, note=f"non-finite value at row {c.row0 + bad}")
        per_row = _chunk_stats(fmt, Chunk(c.row0, x, d, c.step, c.offset, c.range_slack))
        elements += x.size
        rows = c.row0 + np.arange(len(x))
        over_rows, worst_rows = per_row["over"], per_row["worst"]
        stats = {k: per_row[k] for k in ("sxx", "sdx", "sdi", "sig2")}
        for k in np.unique(rows // per):
            sel = rows // per == k
            u = units.setdefault(int(k), _Unit())
            for name, v in stats.items():
                setattr(u, name, getattr(u, name) + float(v[sel].sum()))
            bad = rows[sel][over_rows[sel] > 0]
            if len(bad):
                u.over += int(over_rows[sel].sum())
                u.worst = max(u.worst, float(worst_rows[sel][over_rows[sel] > 0].max()))
                u.rows = [int(bad[0]) if u.rows[0] is None else u.rows[0], int(bad[-1])]
    return _row(src, None, elements, per, units)


def _row(src: TensorSource, status, elements: int, per, units: dict, note: str | None = None) -> dict:
    fmt = src.fmt
    out = {"name": src.name, "label": src.label, "format": fmt.name, "shape": list(src.shape),
           "elements": elements, "status": status, "over": 0, "max_excess": None, "where": None,
           "systematic": None, "note": note}
    if status is not None:
        return out
    over = sum(u.over for u in units.values())
    worst_key = max((k for k, u in units.items() if u.over), key=lambda k: units[k].worst, default=None)
    if worst_key is not None:
        u = units[worst_key]
        out["over"], out["max_excess"] = over, u.worst
        out["where"] = _where(src, worst_key, u.rows, per)
        bad = sorted(k for k, v in units.items() if v.over)
        if src.unit_rows and len(bad) > 1:
            listed = ", ".join(map(str, bad[:8])) + (f" (+{len(bad) - 8})" if len(bad) > 8 else "")
            out["where"] = f"experts {listed}; worst {out['where']}"
    sys_rows = []
    for k, u in units.items():
        if u.sxx <= 0:
            continue
        limit = Z_SYSTEMATIC * np.sqrt(u.sig2) / u.sxx + 4 * 2.0 ** -23  # + the dequantizer's fp32 rounding
        scale = u.sdi / u.sxx
        sys_rows.append((abs(scale) / limit, k, scale, limit, u.sdx / u.sxx))
    if sys_rows and fmt.block:
        ratio, k, scale, limit, slope = max(sys_rows)
        out["systematic"] = {"unit": _unit_name(src, k), "scale_error": scale, "limit": limit, "ratio": ratio,
                             "slope": slope}
    elif sys_rows:
        ratio, k, scale, limit, slope = max(sys_rows, key=lambda r: abs(r[4] - 1))
        out["systematic"] = {"unit": _unit_name(src, k), "slope": slope}
    failed = fmt.bounded and (over > 0 or (out["systematic"] or {}).get("ratio", 0) > 1)
    out["status"] = Status.NA if not fmt.bounded else Status.FAIL if failed else Status.PASS
    if not fmt.bounded:
        out["note"] = fmt.bound()
    return out


def _unit_name(src: TensorSource, k: int) -> str | None:
    return f"expert {k}" if src.unit_rows else None


def _where(src: TensorSource, k: int, rows: list, per: int) -> str:
    first, last = (r - k * per for r in rows)
    span = f"row {first}" if first == last else f"rows {first}-{last}"
    return f"expert {k}, {span}" if src.unit_rows else span


def check_tensors(sources: Iterator[TensorSource], progress=None) -> dict:
    """The weight check of a shipped file: every tensor judged (judge), the failing ones named. Status
    `fail` where any tensor is beyond its format's bound or its fit; `pass` otherwise (a codebook
    tensor, which has no bound here, is listed `n/a`)."""
    rows, formats = [], {}
    for i, src in enumerate(sources):
        if progress:
            progress(f"weights: {src.name}")
        rows.append(judge(src))
        formats[src.fmt.name] = src.fmt.bound()
    failed = [r for r in rows if r["status"] == Status.FAIL]
    unbounded = [r["name"] for r in rows if r["status"] == Status.NA]
    worst = max(failed, key=lambda r: (r["max_excess"] or 0, (r["systematic"] or {}).get("ratio", 0)), default=None)
    return {"status": Status.FAIL if failed else Status.PASS, "tensors": len(rows), "failed": len(failed),
            "unbounded": unbounded, "worst": worst, "bounds": dict(sorted(formats.items())), "rows": rows}


def summary_line(w: dict) -> str:
    """One line for the report: what the weight check found."""
    if w["status"] == Status.PASS:
        extra = f"; {len(w['unbounded'])} codebook tensor(s) not bounded" if w["unbounded"] else ""
        return f"every tensor ({w['tensors']}) within its format's rounding of the original{extra}"
    r = w["worst"]
    where = f" ({r['where']})" if r.get("where") else ""
    if r.get("note"):
        return f"{w['failed']} of {w['tensors']} tensors are not a correct conversion: {r['name']}: {r['note']}"
    if r["max_excess"] is not None:
        what = (f"{r['over']} value(s) beyond the bound, the largest {r['max_excess']:.3g} "
                f"{'steps' if r['format'] not in FLOATS else 'ulps'} past it")
    else:
        s = r["systematic"]
        what = (f"a systematic scale error of {s['scale_error']:+.3%} on {s['unit'] or 'the tensor'} "
                f"(a correct quantizer: within ±{100 * s['limit']:.2g}%)")
    return (f"conversion defect: {w['failed']} of {w['tensors']} tensors; worst {r['name']} [{r['label']}]{where}: "
            f"{what} ({r['format']})")
