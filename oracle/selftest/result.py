"""The self-test's report: a row per fault (detected, localised, the point the drill named) and per
clean run (no false alarm), the summary judged against the targets, its JSON form (read back to
resume a run cut short) and its text."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from oracle.backend import InputError
from oracle.reports.result import Status, place
from oracle.selftest.judge import CLEAN

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
    # at a noise-relative precision: the fault's fp32 error on its block, less the clean candidate's own
    # error there at the precision, over that block's limit at the precision (> 1: detection guaranteed,
    # so it must be detected: oracle/selftest/judge.noise_ratio); None at fp32
    noise_ratio: float | None = None
    # False: the faulted candidate computed exactly what the clean one did (every row's numbers and
    # every token the same): the fault never reached it, so it is neither detected nor missed
    injected: bool = True
    # True: the block the fault targets fails without it (the family's known divergence there), so
    # the fault cannot be localised or told apart at its block: stated, not required
    masked: bool = False
    # --drill: the point inside the block the fault breaks (models.faults.catalogue.POINTS) and the first point
    # the check's drill-down named (oracle/drill/points.py; None: not drilled, or every point agreed)
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
    weights: str = "normal"  # the weight profile of the tiny checkpoints (oracle/source/trained.py)
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


def resumable(done: SelftestResult, res: SelftestResult, where: str) -> None:
    """InputError naming what differs where `done` was not run as `res` is (its rows would not be
    this run's numbers)."""
    differ = [f"{k} {getattr(done, k)!r} (this run: {getattr(res, k)!r})"
              for k in ("backend", "seeds", "precision", "weights", "options", "drill")
              if getattr(done, k) != getattr(res, k)]
    if differ:
        raise InputError(f"cannot resume from {where}: it was run with " + ", ".join(differ)
                         + "; run with the same settings, or write the report elsewhere")


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
