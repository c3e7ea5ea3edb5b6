"""One lowering per program identity on `executorch` and `executorch-mlx` (exporters/executorch/rebind.py),
measured (not a test).

In an empty cache (a temporary one, or --cache): the family's clean check program of seed 0 is lowered,
then seed 1's and the weight-only faults' programs are rebound from it; in a second empty cache the
same programs are lowered directly (the backend told not to rebind). Prints each build's seconds and
whether the rebound program's files (model.pte; executorch: model.ptd, taps.json, ops.txt) are byte for
byte the lowered ones'. Two lowerings per program on 2 cores: minutes per family.

    .venv/bin/python benchmarks/executorch_rebind.py [--backend executorch-mlx] [--family olmoe ...] [--cache DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WEIGHT_FAULTS = ("expert_gate_up_swapped", "expert_weights_off_1e-3")
FILES = ("model.pte", "model.ptd", "taps.json", "ops.txt")


def build(backend_name: str, family: str, seed: int, fault: str | None, rebinds: bool) -> tuple[Path, float]:
    from models.faults import catalogue as faults
    from oracle.backend import CheckSpec
    from oracle.source.sources import model_source

    spec = CheckSpec(family=family, backend=backend_name, seed=seed)
    base = importlib.import_module("exporters." + backend_name.replace("-", "_")).BACKEND
    backend = base.with_fault(faults.get(fault)) if fault else type(base)()
    src = model_source(spec)
    backend.rebinds_weights = rebinds  # not: lowered, recorded nowhere
    t = time.perf_counter()
    art = backend.artifact(src, spec, True, False) if backend_name == "executorch-mlx" else \
        backend.artifact(src, spec, True)
    return Path(art.path), time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="executorch", choices=("executorch", "executorch-mlx"))
    ap.add_argument("--family", action="append", help="repeatable (default olmoe)")
    ap.add_argument("--cache", help="a directory for the two caches (default: a temporary one, removed)")
    a = ap.parse_args()
    from models.faults import catalogue as faults
    from oracle.backend import CheckSpec
    from oracle.source.sources import model_source

    with tempfile.TemporaryDirectory(prefix="rebind-", dir=a.cache) as root:
        for fam in a.family or ["olmoe"]:
            os.environ["MOE_ORACLE_CACHE"] = str(Path(root) / fam / "rebound")
            args = model_source(CheckSpec(family=fam, backend=a.backend)).args
            runs = [(0, None), (1, None)] + [(0, f) for f in WEIGHT_FAULTS if faults.get(f).is_applicable(args)]
            got = {}
            for rebinds, cache in ((True, "rebound"), (False, "lowered")):
                os.environ["MOE_ORACLE_CACHE"] = str(Path(root) / fam / cache)
                for seed, fault in runs:
                    got[rebinds, seed, fault] = build(a.backend, fam, seed, fault, rebinds)
            for seed, fault in runs:
                (p, s), (q, t) = got[True, seed, fault], got[False, seed, fault]
                same = all(filecmp.cmp(p.with_name(n), q.with_name(n), shallow=False) for n in FILES
                           if q.with_name(n).exists() or p.with_name(n).exists())
                how = "rebound" if p.with_name("rebound.json").exists() else "lowered"
                print(f"{a.backend} {fam} seed {seed} {fault or 'clean'}: {how} {s:.1f} s, lowered {t:.1f} s, "
                      f"byte-identical: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
