"""The quantization / implementation error table of docs/benchmarks.md (not a test): for each family,
an mlx-lm directory written by `oracle export --backend mlx` (mlx-lm's quantizer and writers)
at q4 group 32 and q8 group 64, checked with `--candidate-dir` against the tiny checkpoint.

    python benchmarks/shipped.py [--families olmoe,mixtral] [--recipes q4g32,q8g64,mixed_4_6]

Per row: the implementation error (the mlx candidate vs HF on the dequantized weights, at the
fp32 limits: worst block ratio, worst block rel_l2, e2e logits max_abs, tokens exact) and the
quantization error (HF on the original weights vs HF on the dequantized ones, at the q4/q8
limits: worst block rel_l2 and ratio, e2e KL mean, status).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MOE_ORACLE_CACHE", str(ROOT / ".cache" / "moe-oracle"))

RECIPES = {"q4g32": ("q4", {"group_size": 32}), "q8g64": ("q8", {"group_size": 64}),
           "mixed_4_6": ("q4", {"recipe": "mixed_4_6", "group_size": 32})}


def worst(rows, key):
    vals = [r[key] if isinstance(r, dict) else getattr(r, key) for r in rows]
    return max(v for v in vals if isinstance(v, (int, float)))


def rel(rows):
    return max((r["metrics"] if isinstance(r, dict) else r.metrics).get("rel_l2") or 0.0 for r in rows)


def main() -> int:
    from models import FAMILY_NAMES
    from oracle.backend import CheckSpec
    from oracle.check import run_check
    from oracle.export import run_export

    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILY_NAMES))
    ap.add_argument("--recipes", default="q4g32,q8g64")
    a = ap.parse_args()
    print(f"host: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}")
    print("| family | shipped | implementation: worst ratio | rel_l2 | e2e logits max_abs | tokens | "
          "quantization: worst rel_l2 | ratio | KL mean | status |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            for recipe in a.recipes.split(","):
                precision, opts = RECIPES[recipe]
                d = Path(tmp) / f"{family}-{recipe}"
                run_export(CheckSpec(family=family, backend="mlx", precision=precision, options=dict(opts)), str(d))
                r = run_check(CheckSpec(family=family, backend="mlx", candidate_dir=str(d)))
                q, rows = r.quantization, r.quantization["rows"]
                e2e_max = max(s["max_abs"] for s in r.e2e.steps if s["max_abs"] is not None)
                kind = q["kind"] + (f" ({', '.join(q['modules'])})" if q["kind"] == "mixed" else "")
                print(f"| {family} | {kind} | {worst(r.blocks, 'ratio'):.3g} | {rel(r.blocks):.2g} | {e2e_max:.2g} | "
                      f"{'exact' if r.e2e.token_exact else 'differ'} | {rel(rows['blocks']):.3g} | "
                      f"{worst(rows['blocks'], 'ratio'):.2f} | {rows['e2e']['distribution']['kl_mean']:.3g} | "
                      f"{r.status} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
