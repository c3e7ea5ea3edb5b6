"""Time and memory of the weight check of one shipped file (docs/conversion.md, docs/benchmarks.md).

Runs only the weight check (oracle/verdict/conversion.py through the backend's shipped_tensors) of FILE against
the checkpoint of --family/--config/--layers, in this process, and prints its wall time, the peak resident
memory of the process (VmHWM, the mapped files' pages included) and its peak anonymous memory (RssAnon,
sampled), the largest tensor of the file and its verdict. The original's conversion
to the file's layout (mlx-lm's unquantized directory, llama.cpp's f32 GGUF) is built first if not cached
and timed apart.

    python benchmarks/weight_check.py --backend llamacpp --config olmoe-1b-7b-0924 --layers 2 FILE.gguf
    python benchmarks/weight_check.py --backend mlx --config olmoe-1b-7b-0924 --layers 2 DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def status_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2 ** 20


def peak_rss_gib() -> float:
    """VmHWM: the peak resident set, the file pages of the memory-mapped files read included."""
    return status_gib("VmHWM")


class AnonPeak:
    """The peak of RssAnon (memory the process itself holds, not the mapped files' pages the kernel
    can drop), sampled every 10 ms in a thread while the check runs."""

    def __enter__(self):
        import threading

        self.peak, self.stop = status_gib("RssAnon"), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def run(self):
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, status_gib("RssAnon"))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--backend", required=True)
    p.add_argument("--family")
    p.add_argument("--config")
    p.add_argument("--layers", type=int)
    a = p.parse_args(argv)

    from models import family_for_model_type
    from oracle.source.published import published_config
    from oracle.backend import CheckSpec, resolve
    from oracle.verdict.conversion import check_tensors
    from oracle.source.sources import model_source

    family = a.family or family_for_model_type(published_config(a.config, a.layers)["model_type"])
    original = model_source(CheckSpec(family=family, backend=a.backend, config=a.config, layers=a.layers))
    backend = resolve(a.backend)
    t0 = time.perf_counter()
    sources = list(backend.shipped_tensors(original, Path(a.file), lambda msg: None))
    prepared = time.perf_counter() - t0
    largest = max(sources, key=lambda s: int(__import__("numpy").prod(s.shape)))
    rss0, anon0 = peak_rss_gib(), status_gib("RssAnon")
    t1 = time.perf_counter()
    with AnonPeak() as anon:
        w = check_tensors(iter(sources))
    took = time.perf_counter() - t1
    n = int(__import__("numpy").prod(largest.shape))
    print(f"{a.file}: weights {w['status']} ({w['tensors']} tensors, {w['failed']} failed); the original's "
          f"conversion ready in {prepared:.1f} s; the check {took:.1f} s; peak RSS {peak_rss_gib():.2f} GiB "
          f"({rss0:.2f} before the check), of it anonymous (not the mapped files' pages) {anon.peak:.2f} GiB "
          f"({anon0:.2f} before); largest tensor {largest.name} {list(largest.shape)} = "
          f"{n * 4 / 2 ** 30:.2f} GiB at fp32")
    return 0 if w["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
