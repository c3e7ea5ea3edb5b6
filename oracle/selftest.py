"""`oracle selftest`: an oracle is only worth what it catches.

Runs the seeded-fault catalogue (models/faults.py) through a backend and requires every
fault to fail its check with the worst row at the right layer and block kind; then runs
every family unmodified over several seeds and requires a pass (no false alarms).

At a precision judged against its own measured error (bf16: oracle/noise.py), a fault too small
to tell from that error cannot be required: each fault also runs at fp32, and its error on the
block it targets, in units of that block's limit at the precision (`noise_ratio`), says whether it
is above the precision's noise (> 1). The faults below it are stated, not required; every fault
above it must be detected, and 90 % of them localised.

A family with a known divergence (goldens/known_divergences.toml) fails some rows without any fault.
A fault aimed at one of those rows (ERNIE's router on mlx-lm) cannot be told apart there: it is
`masked`, stated with whether it was detected anyway, not required.

A backend takes part by providing `with_fault(fault) -> backend | None` (None: the fault
cannot be expressed on this backend, e.g. it patches a torch module mlx-lm does not have; an optional
`fault_not_applicable(fault) -> str` says why). A faulted candidate that refuses to load (InputError:
the fault has no form on this family's model) is listed as not applicable with its reason.

A run cut short (a shard's time limit, a stopped machine) resumes from its own --json report
(`resume`): the rows it finished are kept, the rest run. The report records what decides its
numbers (backend, seeds, precision, weights, options, drill); a report of another run is refused.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from models import FAMILY_NAMES, faults
from oracle import thresholds
from oracle.backend import GIB, CheckSpec, InputError, MemoryRefusal, available_memory
from oracle.check import resident_bytes, run_check
from oracle.sources import model_source
from oracle.validation import validate
from oracle.result import Status, place, worst_row

SCHEMA = "oracle-selftest/v1"
LOCALIZE_MIN = 0.9  # share of detected faults whose worst row must name the right block
# --drill: share of the drilled faults whose point the backend exposes that the drill must name (issue 32's
# target for the compiled backends and mlx; eager reaches 95 %, docs/drill.md)
POINT_MIN = 0.8


@dataclass
class FaultRow:
    family: str
    fault: str
    what: str
    precision: str
    expected: dict  # layer, kind
    # the check's status: fail (detected where a block or e2e row failed; crashed where every failing
    # row raised), pass (missed), error (crashed: the faulted candidate raised, not a
    # detection), xfail (a known divergence failing as it says)
    status: str
    detected: bool
    localized: bool
    worst: dict | None  # layer, kind, metric, value, limit, ratio
    seconds: float
    # at a noise-relative precision: the fault's fp32 error on its block over that block's limit at
    # the precision (> 1: above the precision's own error, so it must be detected); None at fp32
    noise_ratio: float | None = None
    # False: the faulted candidate computed exactly what the clean one did (every row's numbers and
    # every token the same): the fault never reached it, so it is neither detected nor missed
    injected: bool = True
    # True: the block the fault targets fails without it (the family's known divergence there), so
    # the fault cannot be localised or told apart at its block: stated, not required
    masked: bool = False
    # --drill: the point inside the block the fault breaks (models.faults.POINTS) and the first point
    # the check's drill-down named (oracle/points.py; None: not drilled, or every point agreed)
    point: str | tuple | None = None
    drill_point: str | None = None
    drilled: bool = False  # the check drilled the fault's block (a drill finding no divergence is a miss)
    # the backend exposes the fault's point in that drill (False: it is n/a there, e.g. computed inline
    # by mlx-lm; the drill can then only name a later point: listed apart, with the reason)
    point_exposed: bool = True
    point_reason: str = ""
    # the faulted candidate raised: the check, or a row that does not raise without the fault (None: a
    # report written before this field)
    raised: bool | None = None
    failed_gates: list = field(default_factory=list)  # names of the gates that failed (no row failed: a miss)
    error: str | None = None  # what it raised (first line), where it raised

    @property
    def point_localized(self) -> bool:
        return self.drill_point in (self.point if isinstance(self.point, (tuple, list)) else (self.point,))

    @property
    def crashed(self) -> bool:  # the check raised, or a row raised and none failed by a measurement (a
        # check failing by a gate alone raised nothing: a miss, or not injected where the numbers are the same)
        if self.status == Status.ERROR:
            return True
        if self.detected:
            return False
        if self.raised is not None:
            return self.raised
        return self.status == Status.FAIL or (self.status == Status.XFAIL and self.worst is not None)  # as then

    @property
    def required(self) -> bool:
        return self.injected and not self.masked and (self.noise_ratio is None or self.noise_ratio > 1.0)


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
    refused: list[dict] = field(default_factory=list)  # families the backend cannot check: family, why
    # checks refused for want of memory here (MemoryRefusal), even in fresh workers: family, what, why. Not
    # run, so the self-test is not ok; a resumed run tries them again
    unrun: list[dict] = field(default_factory=list)
    schema: str = SCHEMA
    weights: str = "normal"  # the weight profile of the tiny checkpoints (models/trained.py)
    precision: str = "fp32"  # the clean runs' and every fault's (dtype faults: bf16 always)
    options: dict = field(default_factory=dict)  # --option, passed to every check
    drill: bool = False

    def summary(self) -> dict:
        req = [r for r in self.faults if r.required]
        n = len(req)
        d = sum(r.detected for r in req)
        loc = sum(r.localized for r in req)
        m = len(self.false_alarms)
        f = sum(r.status not in CLEAN for r in self.false_alarms)
        out = {"detected": d, "localized": loc, "faults": n, "distinct_faults": len({r.fault for r in self.faults}),
               "crashed": sum(r.crashed for r in req), "false_alarms": f, "clean_runs": m,
               "not_injected": sum(not r.injected for r in self.faults), "refused": len(self.refused),
               "not_applicable": len(self.not_applicable), "unrun": len(self.unrun),
               "ok": n > 0 and d == n and loc >= LOCALIZE_MIN * n and f == 0 and m > 0 and not self.unrun}
        masked = [r for r in self.faults if r.injected and r.masked]
        if masked:  # at a block that fails without them (a known divergence): stated, not required
            out["masked"] = len(masked)
            out["masked_detected"] = sum(r.detected for r in masked)
        # the faults the drill can name (a dtype fault's numbers agree: POINTS None), drilled at their block
        drilled = [r for r in req if r.drilled and r.localized and r.point is not None]
        if drilled:  # --drill: the share whose drill names the point the fault breaks, where the backend exposes it
            exposed = [r for r in drilled if r.point_exposed]
            out["drilled"] = len(exposed)
            out["point_localized"] = sum(r.point_localized for r in exposed)
            if len(exposed) < len(drilled):
                out["point_not_exposed"] = len(drilled) - len(exposed)
            out["ok"] = out["ok"] and out["point_localized"] >= POINT_MIN * len(exposed)
        below = [r for r in self.faults if r.injected and not r.masked and not r.required]
        if below:  # below the precision's noise: stated, not required
            out["below_noise"] = len(below)
            out["below_noise_detected"] = sum(r.detected for r in below)
        return out

    def summary_line(self) -> str:
        s = self.summary()
        line = (f"detected {s['detected']}/{s['faults']}, localized {s['localized']}/{s['faults']}, "
                f"false alarms {s['false_alarms']}/{s['clean_runs']}")
        if "drilled" in s:
            line += f"; drill names the fault's point {s['point_localized']}/{s['drilled']}"
            if s.get("point_not_exposed"):
                line += (f" (+ {s['point_not_exposed']} whose point the backend does not expose: the drill "
                         "names a later one)")
        if s["crashed"]:
            line += f"; {s['crashed']} crashed (the faulted candidate raised: not a detection)"
        if s["not_injected"]:
            line += f"; {s['not_injected']} not injected (the candidate computed the same as without the fault)"
        if s["refused"]:
            line += f"; {s['refused']} famil{'y' if s['refused'] == 1 else 'ies'} refused by the backend"
        if s["unrun"]:
            line += f"; {s['unrun']} check(s) not run: not enough memory here (not ok; --resume runs them)"
        if s["not_applicable"] and not s["faults"]:  # nothing judged: say why
            line += f"; {s['not_applicable']} fault(s) not applicable, none judged"
        if "masked" in s:
            line += (f"; {s['masked']} fault(s) at a block that fails without them (a known divergence), "
                     f"not required ({s['masked_detected']} detected anyway)")
        if "below_noise" in s:
            line += (f"; {s['below_noise']} fault(s) below {self.precision}'s own error, not required "
                     f"({s['below_noise_detected']} detected anyway)")
        return line

    def to_dict(self, complete: bool = True) -> dict:
        """`complete` False: a report of the rows finished so far (written after each, so a run cut
        short keeps them)."""
        d = {**asdict(self), "summary": self.summary(), "summary_line": self.summary_line(), "complete": complete}
        if self.weights == "normal":  # a report of the normal profile stays as before the profiles
            del d["weights"]
        for k, default in (("options", {}), ("drill", False), ("unrun", [])):  # likewise where not asked for / none
            if d[k] == default:
                del d[k]
        if self.precision == "fp32":  # likewise at fp32, before the precision option
            del d["precision"]
            for r in d["faults"]:
                del r["noise_ratio"]
        for r in d["faults"]:  # only where a known divergence masks the fault's block
            if not r["masked"]:
                del r["masked"]
            if r["error"] is None:  # only where the faulted candidate raised
                del r["error"]
            if r["point"] is None:  # not drilled: no point to expose
                del r["point_exposed"], r["point_reason"]
        return d


def load_report(path) -> SelftestResult:
    """The rows of a --json report (complete or cut short); InputError where it is not one."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{path}: not a readable selftest report ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise InputError(f"{path}: not a selftest report (schema {SCHEMA!r} expected)")

    def rows(cls, key):
        names = {f.name for f in fields(cls)}
        try:
            return [cls(**{k: v for k, v in r.items() if k in names}) for r in d.get(key) or []]
        except (TypeError, AttributeError) as e:
            raise InputError(f"{path}: a malformed {key} row ({e})") from None
    try:
        return SelftestResult(d["backend"], list(d["families"]), list(d["seeds"]), rows(FaultRow, "faults"),
                              rows(AlarmRow, "false_alarms"), list(d.get("not_applicable") or []),
                              list(d.get("refused") or []), weights=d.get("weights", "normal"),
                              precision=d.get("precision", "fp32"), options=dict(d.get("options") or {}),
                              drill=bool(d.get("drill", False)), unrun=list(d.get("unrun") or []))
    except (KeyError, TypeError) as e:
        raise InputError(f"{path}: a malformed selftest report ({e!r})") from None


def _resumable(done: SelftestResult, res: SelftestResult, where: str) -> None:
    """InputError naming what differs where `done` was not run as `res` is (its rows would not be
    this run's numbers)."""
    differ = [f"{k} {getattr(done, k)!r} (this run: {getattr(res, k)!r})"
              for k in ("backend", "seeds", "precision", "weights", "options", "drill")
              if getattr(done, k) != getattr(res, k)]
    if differ:
        raise InputError(f"cannot resume from {where}: it was run with " + ", ".join(differ)
                         + "; run with the same settings, or write the report elsewhere")


CLEAN = (Status.PASS, Status.XFAIL)  # a clean run that fails as its known divergence says is no false alarm


def same_numbers(a, b) -> bool:
    """Whether two checks of the same spec measured exactly the same: every block row's metrics
    and every e2e step and token (a fault that changed nothing in the candidate)."""
    if a.status == Status.ERROR or b.status == Status.ERROR:
        return False
    rows = lambda r: {(x.layer, x.kind): (x.status, x.metrics) for x in r.blocks}  # noqa: E731
    e2e = lambda r: None if r.e2e is None else (r.e2e.candidate_tokens, [s.get("max_abs") for s in r.e2e.steps])  # noqa: E731
    return rows(a) == rows(b) and e2e(a) == e2e(b)


def measured_failure(r) -> bool:
    """Whether a check failed by a measurement (a block or e2e row that failed), not only by rows whose
    candidate raised (status error: a crash, not a detection). Gates are not counted: a candidate that
    raised has no tokens, and its golden-tokens gate fails for that alone."""
    return any(x.status == Status.FAIL for x in [*r.blocks, *([r.e2e] if r.e2e is not None else [])])


def new_rows(faulted, clean) -> list:
    """The faulted check's block rows that did not already fail without the fault (a family with a
    known divergence fails some rows clean: those say nothing about the fault)."""
    failed_clean = {(b.layer, b.kind) for b in clean.blocks if b.status in (Status.FAIL, Status.ERROR)}
    return [b for b in faulted.blocks if (b.layer, b.kind) not in failed_clean]


def raised(faulted, clean) -> bool:
    """Whether the faulted candidate raised: the whole check, or a block or e2e row that does not
    raise without the fault (a known divergence may raise clean)."""
    e2e = [faulted.e2e] if faulted.e2e is not None and (clean.e2e is None or clean.e2e.status != Status.ERROR) else []
    return faulted.status == Status.ERROR or any(x.status == Status.ERROR for x in [*new_rows(faulted, clean), *e2e])


def error_of(r) -> str | None:
    """What a check's candidate raised, first line: the check's error, else a row's, else e2e's."""
    msgs = [r.error, *(b.metrics.get("exception") for b in r.blocks), r.e2e.error if r.e2e is not None else None]
    m = next((x for x in msgs if x), None)
    return str(m).strip().splitlines()[0][:300] if m else None


def new_worst(faulted, clean) -> dict | None:
    """The row that localises a fault: the faulted check's worst row among new_rows. asdict of
    the row, or None."""
    if not any(b.status in (Status.FAIL, Status.ERROR) for b in clean.blocks):
        return faulted.worst
    w = worst_row(new_rows(faulted, clean))
    return asdict(w) if w else None


def _worst(doc_worst: dict | None) -> dict | None:
    if not doc_worst:
        return None
    m, lim = doc_worst["metrics"], doc_worst["limits"]
    if m.get("shape_mismatch") or m.get("invalid_output"):  # a measured finding (e.g. k-1 experts per token
        # where k were expected), not a malformed row
        metric, value, limit = "shape", m.get("shape_mismatch") or m["invalid_output"], "the reference's shape"
    elif doc_worst["kind"] == "router":
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


def noise_ratio(fp32_result, bf_result, expected: dict) -> float | None:
    """The fault's fp32 error on the block it targets over that block's limit at the noise-relative
    precision (the row of `bf_result` has the limits HF's own error there sets): > 1, above the
    precision's noise. inf where the fp32 run has no comparable row (it crashed, or the block is
    not isolated): such a fault stays required."""
    def row(result):
        return next((b for b in result.blocks if (b.layer, b.kind) == (expected["layer"], expected["kind"])
                     and b.status != Status.NA), None)

    a, b = row(fp32_result), row(bf_result)
    if a is None or b is None or fp32_result.status == Status.ERROR:
        return float("inf")
    m, lim = a.metrics, b.limits
    if expected["kind"] == "router":
        if m.get("topk_agreement", 1.0) < lim.get("min_agreement", 1.0):
            return float("inf")  # the fault routes tokens elsewhere at fp32
        return _over(m.get("weight_max_abs"), lim.get("weight_atol"))
    return max(_over(m.get("max_abs"), lim.get("max_abs")), _over(m.get("rel_l2"), lim.get("rel_l2")))


def _over(x, limit) -> float:
    if not isinstance(x, (int, float)) or not isinstance(limit, (int, float)):
        return float("inf")  # nothing to compare: required
    return x / limit if limit > 0 else float("inf")


def point_exposed(point, drilled_points: list[dict]) -> tuple[bool, str]:
    """Whether a drill's points include the fault's point (one of them, for a tuple) with a value on
    the candidate's side; else why not (its n/a reason, or "not a point of this backend's block")."""
    if point is None or not drilled_points:
        return True, ""
    names = point if isinstance(point, (tuple, list)) else (point,)
    found = [p for p in drilled_points if p["name"] in names]
    if any(p["status"] != Status.NA for p in found):
        return True, ""
    return False, (found[0]["reason"] if found else "not a point of this backend's block")


def family_spec(backend: str, family: str, seed: int, options: dict, weights: str, precision: str,
                drill: bool) -> CheckSpec:
    """A self-test check's spec: the drill-down inside each fault's check only with `drill` (it adds an HF
    run per detected fault; the self-test localises by block rows)."""
    return CheckSpec(family=family, backend=backend, seed=seed, options=dict(options), weights=weights,
                     precision=precision, drill="auto" if drill else "off")


def fault_precision(fault, precision: str) -> str:
    """The precision a fault's check runs at: the self-test's, a dtype fault's own (bf16) for those."""
    return precision if fault.precision == "fp32" else fault.precision


class Checks:
    """The self-test's checks, run where they are asked for (`jobs` 1), or by `jobs` worker processes
    ahead of the loop that judges them: `plan` queues a family's checks in the order the loop asks
    for them, `run` waits for one (submitting it if it was not planned) and keeps up to WINDOW a worker
    submitted ahead. A worker runs each check as the loop would (oracle.check.run_check, the faulted
    backend rebuilt from the fault's name) and sends back its CheckResult; the workers come from a fork
    server that imported the oracle and the backend once (oracle.worker), each runs many checks (its
    imports and the backend's lowering modules are loaded once). A check that refuses (InputError)
    raises in `run` as it would in place.

    A long-lived worker keeps what the libraries it calls never free (ExecuTorch's lowering kept ~40 MB
    a check: docs/benchmarks.md), so the pool is recycled when its workers outgrow the memory left
    (`outgrown`): the checks already submitted finish, then a new pool forks fresh workers. A check
    refused for memory (MemoryRefusal) while the workers held memory runs again in fresh workers, once.
    A worker that dies (a crash in a native library) takes the pool with it: the checks not finished are
    submitted again to a new pool, once."""

    WINDOW = 2  # checks submitted ahead a worker: enough to keep it busy, few to finish before a recycle

    def __init__(self, backend: str, options: dict, weights: str, precision: str, jobs: int = 1, notice=None):
        self.setting = (backend, dict(options), weights, precision)
        self.jobs, self.pool, self.futures, self.tasks = jobs, None, {}, {}
        self.queue: deque = deque()  # keys planned, not yet submitted, in the order the loop asks for them
        self.rss: dict[int, int] = {}  # worker pid -> its resident bytes after its last check
        self.notice = notice or (lambda msg: None)  # a line for the run's log (a pool replaced)
        self.spent = 0.0  # seconds the checks asked for took, each its own (a row's time: its checks')

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if self.pool is not None:
            if kind is not None:  # interrupted: the running checks are stopped, not waited for
                for proc in list(getattr(self.pool, "_processes", {}).values()):
                    proc.kill()
            self.pool.shutdown(wait=kind is None, cancel_futures=True)
            self.pool = None
        if self.jobs > 1:  # (the fork server outlives a recycled pool)
            from oracle.matrix import stop_fork_server

            stop_fork_server()
        return False

    @staticmethod
    def key(spec: CheckSpec, fault: str | None) -> tuple:
        return spec.family, spec.seed, spec.precision, fault

    def _pool(self):
        if self.pool is None:
            from concurrent.futures import ProcessPoolExecutor

            from oracle.matrix import start_fork_server

            ctx = start_fork_server([self.setting[0]], dict(os.environ))
            self.pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx)
        return self.pool

    def submit(self, spec: CheckSpec, fault: str | None):
        k = self.key(spec, fault)
        self.tasks.setdefault(k, (spec, fault))
        if k not in self.futures:
            if k in self.queue:
                self.queue.remove(k)
            self.futures[k] = self._pool().submit(pooled_check, self.setting, spec, fault)
        return self.futures[k]

    def later(self, spec: CheckSpec, fault: str | None) -> None:
        """Queue the check for the workers (submitted when a place in the window is free)."""
        k = self.key(spec, fault)
        if k not in self.futures and k not in self.queue:
            self.tasks[k] = (spec, fault)
            self.queue.append(k)

    def _top_up(self) -> None:
        while self.queue and sum(not f.done() for f in self.futures.values()) < self.WINDOW * self.jobs:
            self.submit(*self.tasks[self.queue[0]])

    def plan(self, family, seeds, fault_names, base, catalogue, done, done_clean, drill, relative) -> None:
        """Queue the checks the loop of run_selftest will ask for on `family`, in its order."""
        backend, options, weights, precision = self.setting
        spec = family_spec(backend, family, seeds[0], options, weights, precision, drill)
        try:
            validate(spec)
            args = model_source(spec).args
            todo = [(n, f) for n, f, v, _ in selection(base, catalogue, family, args, fault_names)
                    if v is not None and (family, n) not in done]
        except InputError:
            return  # refused: the loop says why
        if (family, seeds[0]) not in done_clean or todo:
            self.later(spec, None)
        for name, fault in todo:
            at = fault_precision(fault, precision)
            self.later(replace(spec, precision=at), name)
            if at != precision:
                self.later(replace(spec, precision=at), None)
            if relative and fault.precision == "fp32":
                self.later(replace(spec, precision="fp32"), name)
        for seed in seeds[1:]:
            if (family, seed) not in done_clean:
                self.later(replace(spec, seed=seed), None)

    def run(self, spec: CheckSpec, backend, fault: str | None = None):
        """The check of `spec` on `backend` (the base backend, or the one with `fault` injected)."""
        if self.jobs <= 1:
            t = time.perf_counter()
            try:
                return run_check(spec, backend)
            finally:
                self.spent += time.perf_counter() - t
        from concurrent.futures import FIRST_COMPLETED, wait
        from concurrent.futures.process import BrokenProcessPool

        k = self.key(spec, fault)
        for attempt in (0, 1):
            future = self.submit(spec, fault)
            while not future.done():  # the window kept full while this one runs
                self._top_up()
                wait([f for f in self.futures.values() if not f.done()], return_when=FIRST_COMPLETED)
            try:
                result, seconds, pid, rss = future.result()
            except BrokenProcessPool:
                if attempt:
                    raise RuntimeError(f"a worker process died twice (a crash in a native library?) while the check of "
                                       f"{spec.family} seed {spec.seed} {spec.precision} {fault or 'without a fault'} "
                                       "was pending; run again with --jobs 1 to see which check crashes") from None
                self._restart()
                continue
            except MemoryRefusal:
                self.futures.pop(k, None)
                if attempt or not self.rss:
                    raise
                self._recycle("a check was refused for memory")  # the workers' own growth may be what took it
                continue
            except BaseException:
                self.futures.pop(k, None)
                raise
            self.futures.pop(k, None)
            self.spent += seconds
            self.rss[pid] = rss or 0
            held = sum(self.rss.values())
            if outgrown(held, available_memory()):
                self._recycle(f"the workers held {held / GIB:.1f} GiB")
            self._top_up()
            return result

    def _recycle(self, why: str) -> None:
        """The checks already submitted finish in this pool (their results kept), then its workers exit:
        the next check starts a new pool of fresh workers."""
        from concurrent.futures import wait

        if self.pool is None:
            return
        wait(list(self.futures.values()))
        self.pool.shutdown(wait=True)
        self.pool, self.rss = None, {}
        self.notice(f"worker processes restarted ({why})")

    def _restart(self) -> None:
        """A new pool, every check not finished submitted to it again in its order."""
        pending = [k for k, f in self.futures.items() if not f.done() or f.cancelled() or f.exception() is not None]
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool, self.rss = None, {}
        for k in pending:
            del self.futures[k]
            self.submit(*self.tasks[k])


def outgrown(held: int, available: int | None) -> bool:
    """Whether workers resident with `held` bytes between checks should be replaced by fresh ones: they hold
    more than the memory still `available` to the next check (None: not known, never)."""
    return available is not None and held > available


_WORKER: dict = {}  # in a worker: (backend, options, weights, precision) -> (base backend, catalogue)


def pooled_check(setting: tuple, spec: CheckSpec, fault: str | None):
    """In a worker process (Checks): the check of `spec` on the backend of `setting`, with `fault` injected
    as selection gives it for the family, the seconds it took, and the worker's pid and resident bytes after it."""
    t = time.perf_counter()
    result = _pooled_check(setting, spec, fault)
    return result, time.perf_counter() - t, os.getpid(), resident_bytes()


def _pooled_check(setting: tuple, spec: CheckSpec, fault: str | None):
    backend, options, weights, precision = setting
    k = (backend, repr(sorted(options.items())), weights, precision)
    if k not in _WORKER:
        _WORKER[k] = _faultable(backend, [spec.family], None, options, weights, precision)
    base, catalogue = _WORKER[k]
    if fault is None:
        return run_check(spec, base)
    args = model_source(spec).args
    variant = next(v for n, _, v, _ in selection(base, catalogue, spec.family, args, [fault]) if n == fault)
    return run_check(spec, variant)


def _faultable(backend_name: str, families: list, fault_names, options: dict, weights: str, precision: str):
    """The backend and its catalogue (args -> faults; None: every fault it has), with the backend, its
    options, every family name and every fault name refused up front, not half-way through."""
    base = validate(CheckSpec(family=families[0], backend=backend_name, options=options, weights=weights,
                              precision=precision))
    for family in families:
        if family not in FAMILY_NAMES:
            validate(CheckSpec(family=family, backend=backend_name, options=options, weights=weights))
    if base.with_fault is None:
        raise InputError(f"backend {backend_name} cannot take seeded faults (it has no with_fault())")
    catalogue = base.fault_catalogue or (lambda args: faults.CATALOGUE if args is None else faults.applicable(args))
    known = [f.name for f in catalogue(None)]
    unknown = [n for n in fault_names or () if n not in known]
    if unknown:
        raise InputError(f"unknown fault{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} on "
                         f"{backend_name}; its catalogue: {', '.join(known)}")
    return base, catalogue


def plan(backend_name: str, families=None, fault_names=None, options: dict | None = None,
         weights: str = "normal", precision: str = "fp32") -> list[dict]:
    """What `run_selftest` would run, nothing run (`oracle selftest --list`): a row per family and
    fault, {family, fault, layer, kind, what, why}, `why` None where the fault runs; a family the
    backend refuses is one row with fault None. Needs no backend install (the availability is
    not asked). What refuses only when built (a converter refusing a family, a faulted candidate
    refusing to load) is known only when run, which then lists it as refused or not applicable."""
    families = list(families or FAMILY_NAMES)
    options = dict(options or {})
    base, catalogue = _faultable(backend_name, families, fault_names, options, weights, precision)
    rows = []
    for family in families:
        spec = CheckSpec(family=family, backend=backend_name, options=options, weights=weights, precision=precision)
        try:
            validate(spec)
            args = model_source(spec).args
        except InputError as e:
            rows.append({"family": family, "fault": None, "layer": None, "kind": None, "what": "", "why": str(e)})
            continue
        for name, f, variant, why in selection(base, catalogue, family, args, fault_names):
            rows.append({"family": family, "fault": name, "layer": f.layer(args) if why is None else None,
                         "kind": f.kind if f else None, "what": f.what if f else "", "why": why})
    return rows


def selection(base, catalogue, family: str, args, fault_names):
    """(name, fault, faulted backend, why not run) of each fault a family's self-test takes, in the
    catalogue's order: first the faults asked for by name that do not apply to the family (said, not
    skipped silently: fault None), then each applicable one (backend None where it has no form,
    `why` the backend's reason)."""
    applicable = catalogue(args)
    for name in sorted(set(fault_names or ()) - {f.name for f in applicable}):
        yield name, None, None, f"not applicable to {family} (the model lacks what the fault breaks)"
    for f in applicable:
        if not fault_names or f.name in fault_names:
            variant = base.with_fault(f)
            yield f.name, f, variant, None if variant is not None else (
                base.fault_not_applicable(f) or _precision_missing(base, f) or "not expressible on backend")


def _precision_missing(base, fault) -> str | None:
    """Why a fault that shows at another precision (a dtype fault: bf16) is not run on a backend
    without it."""
    have = base.precisions or ()  # None: every precision
    if have and fault.precision not in have:
        return f"a fault of {fault.precision} programs; backend {base.name} runs {', '.join(have)} only"
    return None


def plan_text(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["fault"] is None:
            lines.append(f"{r['family']:12s} REFUSED: {r['why']}")
        elif r["why"] is None:
            lines.append(f"{r['family']:12s} {r['fault']:30s} {place(r['layer'])} {r['kind']}: {r['what']}")
        else:
            lines.append(f"{r['family']:12s} {r['fault']:30s} not run: {r['why']}")
    n = sum(r["fault"] is not None and r["why"] is None for r in rows)
    return "\n".join(lines + ["", f"{n} fault check(s) would run"]) + "\n"


def run_selftest(backend_name: str, families=None, seeds=(0, 1, 2), fault_names=None,
                 progress=None, options: dict | None = None, weights: str = "normal",
                 precision: str = "fp32", drill: bool = False, on_row=None,
                 resume: SelftestResult | None = None, resume_from: str = "the report",
                 jobs: int = 1, notice=None) -> SelftestResult:
    """`drill`: each detected fault's check drills its worst block (oracle/points.py) and the row
    records the first point named against the point the fault breaks (models.faults.POINTS).
    `on_row(res, row)`: after each row is added (a FaultRow, an AlarmRow, or a refusal's or a not
    applicable fault's dict): `res` then holds every row finished so far (a partial report).
    `resume`: a report of the same settings cut short (load_report): its finished rows are taken as
    they are, in their place, and only the others run (the clean seed-0 check again where a fault is
    left, as the faults are judged against it).
    `jobs` > 1: up to that many checks at once, each in a worker process (Checks): the rows, their
    order and the partial reports are the same as one at a time; `notice(line)` is told when the workers
    are replaced (Checks.notice)."""
    families = list(families or FAMILY_NAMES)
    progress = progress or (lambda msg: None)
    options = dict(options or {})
    relative = thresholds.noise_relative(precision)
    base, catalogue = _faultable(backend_name, families, fault_names, options, weights, precision)
    ok, reason = base.availability()
    if not ok:
        raise InputError(f"backend {backend_name} is unavailable here: {reason}")
    res = SelftestResult(backend_name, families, list(seeds), weights=weights, precision=precision,
                         options=options, drill=drill)
    if resume is not None:
        _resumable(resume, res, resume_from)
    # (family, fault) -> its finished row: a FaultRow, or a faulted candidate's refusal (not applicable)
    done = {(r.family, r.fault): r for r in (resume.faults if resume else [])}
    done |= {(r["family"], r["fault"]): r for r in (resume.not_applicable if resume else [])
             if r.get("why", "").startswith("refused: ")}
    done_clean = {(r.family, r.seed): r for r in (resume.false_alarms if resume else [])}
    checks = Checks(backend_name, options, weights, precision, jobs, notice)
    if jobs > 1:  # every check this run will need, in the order it will need them: the workers run ahead (Checks.WINDOW)
        for family in families:
            checks.plan(family, seeds, fault_names, base, catalogue, done, done_clean, drill, relative)

    def add(rows: list, row) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(res, row)
    with checks:
        for family in families:
            spec = family_spec(backend_name, family, seeds[0], options, weights, precision, drill)
            try:  # a family the backend cannot check is reported with its reason; the others go on
                validate(spec)
                args = model_source(spec).args
                chosen = list(selection(base, catalogue, family, args, fault_names))
                # the clean seed-0 check again where a fault is left to judge against it, or it did not finish
                run_clean = (family, seeds[0]) not in done_clean or any(
                    variant is not None and (family, name) not in done for name, _, variant, _ in chosen)
                if run_clean:
                    progress(f"{family} clean seed {seeds[0]}")
                    t = checks.spent
                    clean = {precision: checks.run(spec, base)}
            except MemoryRefusal as e:
                add(res.unrun, {"family": family, "check": f"clean seed {seeds[0]}", "why": str(e)})
                continue
            except InputError as e:
                add(res.refused, {"family": family, "why": str(e)})
                continue
            if run_clean:
                add(res.false_alarms, AlarmRow(family, seeds[0], clean[precision].status,
                                               _worst(clean[precision].worst), checks.spent - t))
            else:  # every fault of the family finished before
                add(res.false_alarms, done_clean[family, seeds[0]])
            if run_clean and clean[precision].error and not clean[precision].blocks:  # the candidate does not load (a known
                # divergence says why, or it is the false alarm above): no fault can be judged on it
                why = (clean[precision].expected or {}).get("verdict") or clean[precision].error.splitlines()[0]
                add(res.refused, {"family": family, "why": f"the unfaulted candidate does not run: {why}"})
                continue

            def clean_at(p):  # the unfaulted check at precision p, once
                if p not in clean:
                    clean[p] = checks.run(replace(spec, precision=p), base)
                return clean[p]

            for name, fault, variant, why in chosen:
                if variant is None:
                    add(res.not_applicable, {"family": family, "fault": name, "why": why})
                    continue
                if (family, name) in done:  # finished before
                    row = done[family, name]
                    add(res.faults if isinstance(row, FaultRow) else res.not_applicable, row)
                    continue
                progress(f"{family} {fault.name}")
                t = checks.spent
                at = fault_precision(fault, precision)
                try:
                    r = checks.run(replace(spec, precision=at), variant, name)
                except MemoryRefusal as e:
                    add(res.unrun, {"family": family, "check": fault.name, "why": str(e)})
                    continue
                except InputError as e:  # the faulted candidate refused (e.g. a config mlx-lm cannot take)
                    add(res.not_applicable, {"family": family, "fault": fault.name, "why": f"refused: {e}"})
                    continue
                expected = {"layer": fault.layer(args), "kind": fault.kind}
                base_run = clean_at(at)
                # the targeted block fails without the fault: the family's known divergence is there
                masked = base_run.status == Status.XFAIL and any(
                    (b.layer, b.kind) == (expected["layer"], expected["kind"]) and b.status in (Status.FAIL, Status.ERROR)
                    for b in base_run.blocks)
                w = _worst(new_worst(r, base_run))
                # localised: the worst row is the fault's block and holds a measured value (a null is a
                # malformed output the containment reports, not a place)
                localized = bool(w) and (w["layer"], w["kind"]) == (expected["layer"], expected["kind"]) \
                    and w["value"] is not None
                above = None
                if relative and fault.precision == "fp32":  # how far the fault is above the precision's noise
                    above = noise_ratio(checks.run(replace(spec, precision="fp32"), variant, name), r, expected)
                # detected: the check failed, or (a family failing as its known divergence says) a row
                # failed by a measurement that passes without the fault
                # (every failing row an error: the faulted candidate crashed, counted apart)
                detected = (r.status == Status.FAIL and measured_failure(r)) or (
                    r.status == Status.XFAIL and any(b.status == Status.FAIL for b in new_rows(r, base_run)))
                crash = raised(r, base_run)
                drilled = (r.drill or {}).get("blocks") or [{}]
                point = (base.fault_point(fault) or faults.POINTS.get(fault.name)) if drill else None
                exposed, why = point_exposed(point, drilled[0].get("points") or [])
                add(res.faults, FaultRow(family, fault.name, fault.what, at, expected, r.status,
                                         detected, localized, w, checks.spent - t, above,
                                         injected=not same_numbers(r, base_run), masked=masked,
                                         point=point, drill_point=drilled[0].get("first_divergence"),
                                         drilled=bool(drilled[0].get("points")), point_exposed=exposed,
                                         point_reason=why, raised=crash, error=error_of(r) if crash else None,
                                         failed_gates=[g.name for g in r.gates if g.status == Status.FAIL]))
            for seed in seeds[1:]:
                if (family, seed) in done_clean:
                    add(res.false_alarms, done_clean[family, seed])
                    continue
                progress(f"{family} clean seed {seed}")
                t = checks.spent
                try:
                    r = checks.run(replace(spec, seed=seed), base)
                except MemoryRefusal as e:
                    add(res.unrun, {"family": family, "check": f"clean seed {seed}", "why": str(e)})
                    continue
                except InputError as e:  # refused at this seed only: reported, the others go on
                    add(res.refused, {"family": family, "why": f"seed {seed}: {e}"})
                    continue
                add(res.false_alarms, AlarmRow(family, seed, r.status, _worst(r.worst), checks.spent - t))
    return res


def render(res: SelftestResult) -> str:
    profile = "" if res.weights == "normal" else f"; {res.weights} weights"
    profile += "" if res.precision == "fp32" else f"; {res.precision}"
    lines = [f"selftest of backend {res.backend}: families {', '.join(res.families)}; "
             f"clean seeds {res.seeds}{profile}", ""]
    noise = any(r.noise_ratio is not None for r in res.faults)
    lines.append(f"{'family':12s} {'fault':30s} {'detected':8s} {'localized':9s} "
                 + (f"{'x noise':8s} " if noise else "") + "worst row")
    for r in res.faults:
        w = r.worst
        where = "-" if not w else (f"{place(w['layer'])} {w['kind']}: "
                                   f"{w['metric']} {_g(w['value'])} vs {_g(w['limit'])}")
        where = f"raised: {r.error}" if r.crashed and r.error else where
        exp = f" (expected {place(r.expected['layer'])}" \
              f" {r.expected['kind']})" if not r.localized else ""
        flag = lambda ok: "yes" if ok else ("NO" if r.required else "no")  # below noise: not a miss
        above = "" if not noise else f"{'-' if r.noise_ratio is None else _g(r.noise_ratio):8s} "
        detected = "crashed" if r.crashed else "n/inj" if not r.injected else \
            f"{flag(r.detected)} (m)" if r.masked else flag(r.detected)
        point = "" if r.point is None else (f"; drill: `{r.drill_point}`" + (
            "" if r.point_localized else f" (the fault breaks `{r.point}`" + (
                ")" if r.point_exposed else f", not exposed here: {r.point_reason})")))
        lines.append(f"{r.family:12s} {r.fault:30s} {detected:8s} "
                     f"{flag(r.localized):9s} {above}{where}{exp}{point}")
    bad = [a for a in res.false_alarms if a.status not in CLEAN]
    for a in bad:
        lines.append(f"FALSE ALARM {a.family} seed {a.seed}: {a.status} {a.worst}")
    for x in res.refused:
        lines.append(f"REFUSED {x['family']}: {x['why']}")
    for x in res.unrun:
        lines.append(f"NOT RUN {x['family']} {x['check']}: {x['why']}")
    for x in res.not_applicable if not res.faults else ():  # (in every report; here when nothing was judged)
        lines.append(f"NOT APPLICABLE {x['family']} {x['fault']}: {x['why']}")
    if any(r.masked for r in res.faults):
        lines.append("(m): the fault's block fails without it (the family's known divergence): not required")
    lines += ["", res.summary_line()]
    return "\n".join(lines) + "\n"


def row_line(row) -> str:
    """One line for a finished row (the progress of a long self-test)."""
    if isinstance(row, AlarmRow):
        verdict = row.status if row.status in CLEAN else f"{row.status}: FALSE ALARM"
        return f"{row.family} clean seed {row.seed}: {verdict} ({row.seconds:.0f} s)"
    if isinstance(row, dict):
        if "check" in row:  # (SelftestResult.unrun)
            return f"{row['family']} {row['check']}: NOT RUN: {row['why']}"
        return f"{row['family']} {row['fault']}: not applicable: {row['why']}" if "fault" in row else \
            f"{row['family']}: refused: {row['why']}"
    w = row.worst
    where = "" if not w else f" at {place(w['layer'])} {w['kind']}"
    verdict = (f"crashed: {row.error or 'a row raised'}" if row.crashed else "not injected" if not row.injected
               else ("detected" + where + ("" if row.localized else ", NOT localised")) if row.detected
               else "MISSED" + _by_gates(row) if row.required else "not detected (not required)")
    return f"{row.family} {row.fault}: {verdict} ({row.seconds:.0f} s)"


def _by_gates(row) -> str:
    return f" by every row (failed gate {', '.join(row.failed_gates)} only)" if row.failed_gates else ""


def _g(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)
