"""Thresholds at real widths (not a test): `oracle check --config NAME --layers 2` for the
published configs of the five families against Linux backends, and, per precision and
block kind, the largest measured error as a fraction of its limit (the row's `ratio`: 1.0 is
the limit). This is how the numbers in oracle/verdict/thresholds.toml were re-measured at real widths.

    python benchmarks/real_width.py                       # every config x eager,hf,mlx,iree,executorch,llamacpp
    python benchmarks/real_width.py --configs olmoe-1b-7b-0924 --checks mlx:q4,mlx:q8

A check a backend refuses (exit 2: e.g. the memory guard's estimate above what is available)
is listed with its reason. Each check runs as its own process; reports go to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("olmoe-1b-7b-0924", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "qwen3.5-35b-a3b", "mixtral-8x7b-v0.1")
CHECKS = "eager:fp32,eager:bf16,hf:fp32,hf:bf16,mlx:fp32,mlx:q8,mlx:q4,iree-llvm-cpu:fp32,executorch:fp32,llamacpp:fp32"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--checks", default=CHECKS, help="backend:precision,... (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "real_width")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per check (default %(default)s)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, worst = [], {}
    gnu_time = shutil.which("time")  # the check's peak RSS (%M, KiB), where the host has GNU time
    gnu_time = gnu_time if gnu_time and Path(gnu_time).resolve().name == "time" else None
    for config in args.configs.split(","):
        for item in args.checks.split(","):
            backend, _, precision = item.partition(":")
            out = args.out / f"{config}-L{args.layers}-{backend}-{precision}.json"
            cmd = [sys.executable, "-m", "oracle", "check", "--config", config, "--layers", str(args.layers),
                   "--backend", backend, "--precision", precision, "--json", str(out)]
            rss = out.with_suffix(".maxrss")
            rss.unlink(missing_ok=True)
            if gnu_time:
                cmd = [gnu_time, "-f", "%M", "-o", str(rss), *cmd]
            t = time.perf_counter()
            try:
                p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p = subprocess.CompletedProcess(cmd, 124, "", f"timed out after {args.timeout:.0f} s")
            wall = time.perf_counter() - t
            res = json.loads(out.read_text()) if p.returncode in (0, 1) and out.is_file() else {}
            peak = f", peak RSS {int(rss.read_text().split()[-1]) / 2**20:.1f} GiB" if rss.is_file() else ""
            why = (p.stderr.strip().splitlines() or [""])[-1] if not res else ""
            status = res.get("status", f"exit {p.returncode}")
            ratio = {}
            for b in res.get("blocks", []):
                if b.get("ratio") is not None:
                    k = (precision, b["kind"])
                    ratio[b["kind"]] = max(ratio.get(b["kind"], 0.0), b["ratio"])
                    worst[k] = max(worst.get(k, (0.0, ""))[0], b["ratio"]), config
            e2e = res.get("e2e") or {}
            rows.append((config, item, status, wall, ratio, e2e.get("token_exact"), why))
            top = max(ratio.items(), key=lambda kv: kv[1]) if ratio else ("-", float("nan"))
            print(f"{config} {item}: {status} in {wall:.0f} s{peak}, worst block {top[0]} at {top[1]:.3g} of its "
                  f"limit, tokens exact {e2e.get('token_exact')}{f' ({why})' if why else ''}", flush=True)
    print("\n| precision | kind | worst ratio (measured / limit) | where |")
    print("|---|---|---|---|")
    for (precision, kind), (r, config) in sorted(worst.items()):
        print(f"| {precision} | {kind} | {r:.3g} | {config} |")
    return 0 if all(r[2] == "pass" or r[2] == "exit 2" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
