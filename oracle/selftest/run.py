"""`oracle selftest`: an oracle is only worth what it catches.

Runs the seeded-fault catalogue (models/faults/) through a backend and requires every
fault to fail its check with the worst row at the right layer and block kind; then runs
every family unmodified over several seeds and requires a pass (no false alarms).

At a precision judged against its own measured error (bf16: oracle/verdict/noise.py), a fault too small
to tell from that error cannot be required: each fault also runs at fp32, and its error on the
block it targets, less the unfaulted candidate's own error there at the precision, in units of that
block's limit at the precision (`noise_ratio`), says whether it is above the precision's noise (> 1:
detection guaranteed whatever the rounding's signs, oracle/selftest/judge.py). The faults below it are stated, not required; every fault
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

import os
import time
from collections import deque
from dataclasses import replace

from models import FAMILY_NAMES
from models.faults import catalogue as faults
from oracle.backend import GIB, CheckSpec, InputError, MemoryRefusal, available_memory
from oracle.check import resident_bytes, run_check
from oracle.reports.result import Status, place
from oracle.selftest.judge import (INVARIANCE, error_of, invariance_localised, invariance_unjudgeable, measured_failure,
                                   new_rows, new_worst, noise_ratio, point_exposed, raised, same_numbers, worst_summary)
from oracle.selftest.result import AlarmRow, FaultRow, SelftestResult, resumable
from oracle.source.sources import model_source
from oracle.source.validation import validate
from oracle.verdict import thresholds


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
    """`drill`: each detected fault's check drills its worst block (oracle/drill/points.py) and the row
    records the first point named against the point the fault breaks (models.faults.catalogue.POINTS).
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
        resumable(resume, res, resume_from)
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
                                               worst_summary(clean[precision].worst), checks.spent - t))
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
                if fault.kind.startswith(INVARIANCE) and (why_not := invariance_unjudgeable(base_run, fault)):
                    add(res.not_applicable, {"family": family, "fault": fault.name, "why": why_not})
                    continue
                # the targeted block fails without the fault: the family's known divergence is there
                masked = base_run.status == Status.XFAIL and any(
                    (b.layer, b.kind) == (expected["layer"], expected["kind"]) and b.status in (Status.FAIL, Status.ERROR)
                    for b in base_run.blocks)
                w = worst_summary(new_worst(r, base_run))
                # localised: the worst row is the fault's block and holds a measured value (a null is a
                # malformed output the containment reports, not a place); an invariance fault: its row fails
                localized = bool(w) and (w["layer"], w["kind"]) == (expected["layer"], expected["kind"]) \
                    and w["value"] is not None
                if fault.kind.startswith(INVARIANCE):
                    expected["layer"] = None
                    w = invariance_localised(r, base_run, fault.kind) or w
                    localized = w is not None and w["kind"] == fault.kind
                above = None
                if relative and fault.precision == "fp32":  # how far the fault is above the precision's noise
                    above = noise_ratio(checks.run(replace(spec, precision="fp32"), variant, name), r, expected, base_run)
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
                add(res.false_alarms, AlarmRow(family, seed, r.status, worst_summary(r.worst), checks.spent - t))
    return res
