"""The weight check's bounds against the formats' own quantizers (docs/conversion.md).

For mlx's affine quantizer (mx.quantize at fp32, bf16 and fp16; 2-8 bits; groups 32, 64, 128) and
llama.cpp's (ggml_quantize_chunk, as llama-quantize runs it: every legacy and K-quant type, with and
without an imatrix), on blocks of six shapes (normal, t(3), t(2), outlier columns, shifted, one-signed)
over three decades of scale: the largest excess over the element bound (must be <= 0: a correct
quantizer never fails), the largest systematic ratio (must be < 1), and which defects the check catches
(two rows exchanged, one row's values 1 % too large before quantizing, its stored scales 1 % too large,
a row zeroed). Usage: python benchmarks/conversion_bounds.py [--seed N] [--trials N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle.verdict.conversion import Chunk, Format, TensorSource, judge  # noqa: E402

KINDS = ("normal", "t3", "t2", "outliers", "shifted", "one-signed")


def draw(rng, kind: str, shape) -> np.ndarray:
    x = {"t3": lambda: rng.standard_t(3, shape), "t2": lambda: rng.standard_t(2, shape)}.get(
        kind, lambda: rng.standard_normal(shape))()
    if kind == "outliers":
        x[:, ::37] *= 20
    if kind == "shifted":
        x = x + 0.3
    if kind == "one-signed":
        x = np.abs(x)
    return (x * 0.02 * 10 ** rng.uniform(-2, 1)).astype(np.float32)


def source(x, deq, step, offset, fmt, short=None) -> TensorSource:
    return TensorSource("t", "t", x.shape, fmt, lambda: iter([Chunk(0, x, deq, step, offset, short)]), unit_rows=1)


def defects(x: np.ndarray) -> dict:
    """name -> (values to quantize, how the stored result is then edited)."""
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    scaled = x.copy()
    scaled[0] *= 1.01
    zeroed = x.copy()
    zeroed[0] = 0
    return {"rows exchanged": swapped, "row scaled 1 % before": scaled, "row zeroed": zeroed}


def mlx_rows(rng, trials: int, shape) -> list:
    import mlx.core as mx

    out = []
    for dt, name in ((mx.float32, "F32"), (mx.bfloat16, "BF16"), (mx.float16, "F16")):
        for bits in (2, 3, 4, 5, 6, 8):
            for g in (32, 64, 128):
                fmt = Format(f"mlx {bits}-bit g{g} {name}", block=g, qmin=0, qmax=2 ** bits - 1, grid_dtype=name,
                             input_dtype=name, clip_steps=1.0)
                worst, sys_ratio, caught = -np.inf, 0.0, {}
                for trial in range(trials):
                    x = draw(rng, KINDS[trial % len(KINDS)], shape)
                    xs = np.array(mx.array(x).astype(dt).astype(mx.float32))

                    def run(values, post_scale=1.0):
                        w, s, b = mx.quantize(mx.array(values).astype(dt), group_size=g, bits=bits)
                        if post_scale != 1.0:
                            s = (s.astype(mx.float32) * post_scale).astype(dt)
                            b = (b.astype(mx.float32) * post_scale).astype(dt)
                        # dequantized in fp32, as the weight check reads a file (mlx's own at bf16 rounds the result)
                        deq = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=g, bits=bits))
                        return judge(source(xs, deq, np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)), fmt))

                    row = run(xs)
                    worst = max(worst, row["max_excess"] if row["max_excess"] is not None else -1.0)
                    sys_ratio = max(sys_ratio, row["systematic"]["ratio"])
                    for d, values in defects(xs).items():
                        caught.setdefault(d, []).append(run(values)["status"] == "fail")
                    caught.setdefault("row's scales 1 % too large", []).append(run(xs, 1.01)["status"] == "fail")
                out.append((fmt.name, worst, sys_ratio, {k: float(np.mean(v)) for k, v in caught.items()}))
    return out


def ggml_rows(rng, trials: int, shape) -> list:
    from exporters.llamacpp.weights import GRIDS, block_source, ggml_quantize

    out = []
    for imatrix in (False, True):
        for t in GRIDS:
            worst, sys_ratio, caught = -np.inf, 0.0, {}
            for trial in range(trials):
                x = draw(rng, KINDS[trial % len(KINDS)], shape)
                imx = rng.uniform(0.01, 10, shape[1]).astype(np.float32) if imatrix else None
                row = judge(block_source("t", x, ggml_quantize(x, t, imx), t, imatrix, unit_rows=1))
                worst = max(worst, row["max_excess"] if row["max_excess"] is not None else -1.0)
                sys_ratio = max(sys_ratio, row["systematic"]["ratio"])
                for d, values in defects(x).items():
                    bad = judge(block_source("t", x, ggml_quantize(values, t, imx), t, imatrix, unit_rows=1))
                    caught.setdefault(d, []).append(bad["status"] == "fail")
            out.append((t + (" imatrix" if imatrix else ""), worst, sys_ratio, {k: float(np.mean(v)) for k, v in caught.items()}))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=20261127)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--cols", type=int, default=512)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    shape = (a.rows, a.cols)
    rows = []
    try:
        rows += mlx_rows(rng, a.trials, shape)
    except ImportError as e:
        print(f"mlx: not measured ({e})", file=sys.stderr)
    try:
        rows += ggml_rows(rng, a.trials, shape)
    except (ImportError, OSError) as e:
        print(f"llama.cpp: not measured ({e})", file=sys.stderr)
    names = list(dict.fromkeys(n for r in rows for n in r[3]))
    print(f"blocks of {shape[0]} x {shape[1]}, {a.trials} trials per format, seed {a.seed}\n")
    print("| format | largest excess (steps; <= 0: no false alarm) | systematic ratio (< 1) | "
          + " | ".join(f"{n}: caught" for n in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    bad = 0
    for name, worst, ratio, caught in rows:
        bad += worst > 0 or ratio >= 1
        print(f"| {name} | {worst:.3f} | {ratio:.3f} | " + " | ".join(f"{caught[n]:.0%}" if n in caught else "-" for n in names) + " |")
    print(f"\n{bad} format(s) with a false alarm")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
