"""What a self-test worker keeps after each check: resident memory and the object census's growth.

    python benchmarks/worker_memory.py [--backend executorch] [--family olmoe] [FAULT ...]

Runs the clean check and then each fault's check one after another in this process, as a worker of
`oracle selftest -j N` does (oracle.selftest.run._pooled_check), and prints after each: the resident set, what
gc.collect() freed, and the twelve object types that grew most. Found with it (2026-11-29, olmoe on
executorch, an empty cache): about 45 MB and 7000 torch.fx Nodes (whole graphs) kept a lowered check, held
by ExecuTorch's unbounded `is_same_node` lru_cache (emptied since by exporters/executorch/torch_lowering.py); a part of the
memory growth remains (docs/benchmarks.md), so `oracle selftest -j N` replaces its workers when they outgrow the
memory left (oracle.selftest.run.Checks).
"""

import argparse
import collections
import gc
import time

from oracle.check import resident_bytes
from oracle.selftest.run import _pooled_check, family_spec


def rss_gib() -> float:
    return resident_bytes() / 2**30


def census() -> collections.Counter:
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="executorch")
    ap.add_argument("--family", default="olmoe")
    ap.add_argument("faults", nargs="*", default=["router_sigmoid", "expert_index_off_by_one", "rope_interleaved"])
    a = ap.parse_args()
    setting = (a.backend, {}, "normal", "fp32")
    spec = family_spec(a.backend, a.family, 0, {}, "normal", "fp32", False)
    before = None
    for fault in [None, *a.faults]:
        t = time.perf_counter()
        result = _pooled_check(setting, spec, fault)
        freed = gc.collect()
        now = census()
        grew = (now - before).most_common(12) if before is not None else []
        print(f"{fault or 'clean'}: {result.status.value}, {time.perf_counter() - t:.0f} s, resident {rss_gib():.2f} GiB "
              f"(gc.collect() freed {freed} objects); grew: {grew}", flush=True)
        before = now


if __name__ == "__main__":
    main()
