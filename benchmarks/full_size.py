"""Full-size benchmark (not a test): a seeded checkpoint of a published config, checked the way
a user checks a real one (`oracle check --model-dir`), with wall time per stage and peak RSS.

    python benchmarks/full_size.py --config olmoe-1b-7b-0924
    python benchmarks/full_size.py --config qwen3-30b-a3b --checks mlx:q4

1. writes the checkpoint (bf16, 5 GB shards + index, as the published one is laid out) into
   the cache, once (a later run reuses it);
2. runs each check (default: eager bf16, then mlx q4) as its own `oracle check --config` process
   under /usr/bin/time, and reads its JSON: status, wall time per stage, the reference side's peak
   (VmHWM after the reference stage), the whole process's peak (time's max RSS), the bytes its
   streamed models read from the checkpoint's decoder layers (and what the process read from storage:
   /proc/self/io, less what the page cache held), the schedule it ran, and the disk it wrote beside
   the checkpoint.
The first check hashes the checkpoint and captures the streamed reference; the second finds
both cached (the digest by path/size/mtime, the reference by digest/prompt/steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def timed(cmd: list[str], env: dict) -> tuple[int, float, float, str]:
    """(exit code, wall s, peak RSS GiB of the process tree's largest process, stderr tail)."""
    t = time.perf_counter()
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        p = subprocess.run(["/usr/bin/time", "-v", "-o", tf.name, *cmd], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", Path(tf.name).read_text())
    peak = int(m.group(1)) * 1024 / GIB if m else float("nan")
    return p.returncode, time.perf_counter() - t, peak, (p.stderr or "")[-3000:]


def disk_usage(root: Path, leave_out: Path) -> int:
    """Bytes of the files under `root`, those under `leave_out` (the checkpoint) left out."""
    from oracle.cache.store import size_of

    return size_of(root) - size_of(leave_out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a published config in models/configs/ (or a config.json path)")
    ap.add_argument("--layers", type=int, help="cut the depth (default: the config's)")
    ap.add_argument("--checks", default="eager:bf16,mlx:q4", help="backend:precision,... (default %(default)s)")
    ap.add_argument("--decode", type=int, default=8, help="decode steps per check (default %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "full_size", help="where the JSON reports go")
    args = ap.parse_args(argv)
    if not shutil.which("/usr/bin/time"):
        sys.exit("needs /usr/bin/time (GNU time) to measure each process's peak RSS")
    sys.path.insert(0, str(ROOT))
    from oracle.backend import InputError
    from oracle.source.validation import family_of

    try:
        family = family_of(None, args.config, args.layers)
    except InputError as e:
        sys.exit(str(e))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    rows = []

    # 1. the checkpoint, built once into the cache (its own process: its peak is its own)
    build = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from models import get_family; "
             f"from oracle.source.seeded import config_checkpoint; "
             f"print(config_checkpoint(get_family({family!r}), {args.config!r}, {args.layers!r}, 0, "
             f"progress=lambda m: print(m, file=sys.stderr, flush=True)))")
    t = time.perf_counter()
    p = subprocess.run([py, "-c", build], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if p.returncode:
        sys.exit(f"writing the checkpoint failed (exit {p.returncode})")
    ckpt = Path(p.stdout.strip().splitlines()[-1])
    from oracle.cache.store import cache_root

    cache = cache_root()
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / GIB
    shards = len(list(ckpt.glob("*.safetensors")))
    print(f"checkpoint {ckpt} ({size:.1f} GiB in {shards} shard(s), {time.perf_counter() - t:.0f} s; "
          "a few seconds when it was already in the cache)", flush=True)

    # 2. the checks
    args.out.mkdir(parents=True, exist_ok=True)
    worst = 0
    for item in args.checks.split(","):
        backend, _, precision = item.partition(":")
        out = args.out / f"{Path(args.config).stem}-{backend}-{precision or 'fp32'}.json"
        cmd = [py, "-m", "oracle", "check", "--config", args.config, *(["--layers", str(args.layers)] if args.layers else []),
               "--backend", backend, "--decode-tokens", str(args.decode), "--json", str(out)]
        if precision:
            cmd += ["--precision", precision]
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        before = disk_usage(cache, ckpt)
        code, wall, peak, err = timed(cmd, env)
        extra = (disk_usage(cache, ckpt) - before) / GIB  # what the check wrote beside the checkpoint (reference, noise)
        res = json.loads(out.read_text()) if out.is_file() else {}
        tm = res.get("timings", {})
        rows.append({"check": f"{backend} {precision or 'fp32'}", "exit": code, "status": res.get("status", "?"),
                     "wall_s": wall, "peak_gib": peak, "ref_peak_gib": tm.get("reference_peak_rss_gib"),
                     "read": tm.get("streamed_gib_read"), "disk_read": tm.get("disk_gib_read"), "extra_gib": extra,
                     "schedule": (res.get("provenance", {}).get("backend") or {}).get("schedule", "call by call"),
                     **{k: tm.get(f"{k}_s") for k in ("checkpoint", "reference", "noise", "load", "blocks", "e2e")}})
        if code not in (0, 1):
            print(err, file=sys.stderr)
        worst = max(worst, code)
        r = rows[-1]
        print(f"  exit {code} ({r['status']}), {wall:.0f} s, peak RSS {peak:.2f} GiB", flush=True)

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"\n{args.config}{f' --layers {args.layers}' if args.layers else ''}: {size:.1f} GiB bf16, "
          f"{os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB RAM\n")
    print("| check | status | checkpoint s | reference s | load s | noise s | blocks s | e2e s | wall s "
          "| reference peak GiB | process peak GiB | layers read (x checkpoint) | disk read GiB | extra disk GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        times = " | ".join(f(r[k], ".0f") for k in ("checkpoint", "reference", "load", "noise", "blocks", "e2e"))
        read = "-" if r["read"] is None else f"{r['read']:.1f} GiB ({r['read'] / size:.2f}x)"
        print(f"| {r['check']} | {r['status']} | {times} | {r['wall_s']:.0f} | {f(r['ref_peak_gib'], '.2f')} "
              f"| {r['peak_gib']:.2f} | {read} | {f(r['disk_read'], '.1f')} | {r['extra_gib']:.2f} |")
    print("\nschedules: " + "; ".join(f"{r['check']}: {r['schedule']}" for r in rows))
    return worst


if __name__ == "__main__":
    sys.exit(main())
