"""`oracle selftest`: an oracle is only worth what it catches.

Runs the seeded-fault catalogue (models/faults.py) through a backend and requires every
fault to fail its check with the worst row at the right layer and block kind; then runs
every family unmodified over several seeds and requires a pass (no false alarms).

A backend takes part by providing `with_fault(fault) -> backend | None` (None: the fault
cannot be expressed on this backend, e.g. it patches a torch module mlx-lm does not have).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from models import FAMILY_NAMES, faults
from oracle.backend import CheckSpec
from oracle.backend import InputError
from oracle.check import model_source, run_check, validate

SCHEMA = "oracle-selftest/v1"
LOCALIZE_MIN = 0.9  # share of detected faults whose worst row must name the right block


@dataclass
class FaultRow:
    family: str
    fault: str
    what: str
    precision: str
    expected: dict  # layer, kind
    status: str  # check status: fail (detected), pass (missed), error (detected: the candidate crashed)
    detected: bool
    localized: bool
    worst: dict | None  # layer, kind, metric, value, limit, ratio
    seconds: float


@dataclass
class AlarmRow:
    family: str
    seed: int
    status: str
    worst: dict | None
    seconds: float


@dataclass
class SelftestResult:
    backend: str
    families: list[str]
    seeds: list[int]
    faults: list[FaultRow] = field(default_factory=list)
    false_alarms: list[AlarmRow] = field(default_factory=list)
    not_applicable: list[dict] = field(default_factory=list)
    schema: str = SCHEMA
    weights: str = "normal"  # the weight profile of the tiny checkpoints (models/trained.py)

    def summary(self) -> dict:
        n = len(self.faults)
        d = sum(r.detected for r in self.faults)
        loc = sum(r.localized for r in self.faults)
        m = len(self.false_alarms)
        f = sum(r.status != "pass" for r in self.false_alarms)
        return {"detected": d, "localized": loc, "faults": n, "distinct_faults": len({r.fault for r in self.faults}),
                "false_alarms": f, "clean_runs": m,
                "ok": n > 0 and d == n and loc >= LOCALIZE_MIN * n and f == 0 and m > 0}

    def summary_line(self) -> str:
        s = self.summary()
        return (f"detected {s['detected']}/{s['faults']}, localized {s['localized']}/{s['faults']}, "
                f"false alarms {s['false_alarms']}/{s['clean_runs']}")

    def to_dict(self) -> dict:
        d = {**asdict(self), "summary": self.summary(), "summary_line": self.summary_line()}
        if self.weights == "normal":  # a report of the normal profile stays as before the profiles
            del d["weights"]
        return d


def _worst(doc_worst: dict | None) -> dict | None:
    if not doc_worst:
        return None
    m, lim = doc_worst["metrics"], doc_worst["limits"]
    if doc_worst["kind"] == "router":
        metric, value, limit = "weight_max_abs", m.get("weight_max_abs"), lim.get("weight_atol")
        if m.get("topk_agreement", 1.0) < lim.get("min_agreement", 1.0):
            metric, value, limit = "topk_agreement", m.get("topk_agreement"), lim.get("min_agreement")
    else:
        metric, value, limit = "rel_l2", m.get("rel_l2"), lim.get("rel_l2")
        if m.get("nonfinite"):
            metric, value, limit = "nonfinite", m["nonfinite"], 0
        if m.get("dtype_mismatch"):
            metric, value, limit = "dtype", m["dtype_mismatch"], "model dtype"
    return {"layer": doc_worst["layer"], "kind": doc_worst["kind"], "metric": metric, "value": value,
            "limit": limit, "ratio": doc_worst["ratio"]}


def run_selftest(backend_name: str, families=None, seeds=(0, 1, 2), fault_names=None,
                 progress=None, options: dict | None = None, weights: str = "normal") -> SelftestResult:
    families = list(families or FAMILY_NAMES)
    progress = progress or (lambda msg: None)
    options = dict(options or {})
    for family in families:  # every family and option refused up front, not half-way through
        base = validate(CheckSpec(family=family, backend=backend_name, options=options, weights=weights))
    if not hasattr(base, "with_fault"):
        raise InputError(f"backend {backend_name} cannot take seeded faults (it has no with_fault())")
    ok, reason = base.availability()
    if not ok:
        raise InputError(f"backend {backend_name} is unavailable here: {reason}")
    res = SelftestResult(backend_name, families, list(seeds), weights=weights)
    for family in families:
        spec = CheckSpec(family=family, backend=backend_name, seed=seeds[0], options=dict(options), weights=weights)
        args = model_source(spec).args
        for fault in faults.applicable(args):
            if fault_names and fault.name not in fault_names:
                continue
            variant = base.with_fault(fault)
            if variant is None:
                res.not_applicable.append({"family": family, "fault": fault.name, "why": "not expressible on backend"})
                continue
            progress(f"{family} {fault.name}")
            t = time.perf_counter()
            r = run_check(replace(spec, precision=fault.precision), variant)
            expected = {"layer": fault.layer(args), "kind": fault.kind}
            w = r.worst
            localized = bool(w) and w["layer"] == expected["layer"] and w["kind"] == expected["kind"]
            # a fault that makes the candidate crash is caught too (status error), if not as neatly
            res.faults.append(FaultRow(family, fault.name, fault.what, fault.precision, expected, r.status,
                                       r.status != "pass",
                                       localized, _worst(w), time.perf_counter() - t))
        for seed in seeds:
            progress(f"{family} clean seed {seed}")
            t = time.perf_counter()
            r = run_check(replace(spec, seed=seed), base)
            res.false_alarms.append(AlarmRow(family, seed, r.status, _worst(r.worst), time.perf_counter() - t))
    return res


def render(res: SelftestResult) -> str:
    profile = "" if res.weights == "normal" else f"; {res.weights} weights"
    lines = [f"selftest of backend {res.backend}: families {', '.join(res.families)}; "
             f"clean seeds {res.seeds}{profile}", ""]
    lines.append(f"{'family':12s} {'fault':30s} {'detected':8s} {'localized':9s} worst row")
    for r in res.faults:
        w = r.worst
        where = "-" if not w else (f"{'model' if w['layer'] is None else 'layer ' + str(w['layer'])} {w['kind']}: "
                                   f"{w['metric']} {_g(w['value'])} vs {_g(w['limit'])}")
        exp = f" (expected {'model' if r.expected['layer'] is None else 'layer ' + str(r.expected['layer'])}" \
              f" {r.expected['kind']})" if not r.localized else ""
        lines.append(f"{r.family:12s} {r.fault:30s} {'yes' if r.detected else 'NO':8s} "
                     f"{'yes' if r.localized else 'NO':9s} {where}{exp}")
    bad = [a for a in res.false_alarms if a.status != "pass"]
    for a in bad:
        lines.append(f"FALSE ALARM {a.family} seed {a.seed}: {a.status} {a.worst}")
    lines += ["", res.summary_line()]
    return "\n".join(lines) + "\n"


def _g(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)
