"""`oracle selftest --conversion`: does the weight check catch a converter's defects?

For each family and each file format the backend ships (`Backend.shipped_formats`: mlx q8/q4 at group 32
and 64; GGUF F32, Q8_0, Q4_K_M), the backend's own exporter writes the file, which is checked as shipped
against the original (`--candidate-dir` / `--gguf`): it must pass (a failure is a false alarm). Then each
conversion defect (oracle/selftest/conversion_faults.py: experts exchanged, a projection transposed, q/k rows
permuted, one expert scaled 1 %, a router row zeroed, written by the exporter from a faulted checkpoint;
and the backend's `file_faults`, written into the file: a scale for another group) must fail the weight
check (detected) with the tensor it edited as the worst (localised). The check runs whole, as a user runs
it: a defect the weight check misses but the logits catch is a miss of the weight check all the same.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from models import FAMILY_NAMES
from oracle.selftest.conversion_faults import CATALOGUE, faulted_checkpoint, folded, target_layer
from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.reports.result import Status
from oracle.source.sources import model_source
from oracle.source.validation import validate

SCHEMA = "oracle-conversion-selftest/v1"
LOCALIZE_MIN = 0.9  # as the block self-test (oracle/selftest/)


@dataclass
class ConversionRow:
    family: str
    format: str  # the backend's label of the file format ("q4 g32", "Q8_0")
    fault: str | None  # None: the file as the exporter wrote it
    what: str
    status: str  # the whole check's ("refused": its InputError in `error`)
    weights: str | None  # the weight check's status
    detected: bool  # a fault: the weight check failed; a clean file: (always False)
    localized: bool  # the weight check's worst tensor is the one the fault edited
    expected: list = field(default_factory=list)  # the tensors the fault edited (checkpoint names, experts folded; or the file's)
    failing: list = field(default_factory=list)  # the tensors the weight check failed
    seconds: float = 0.0
    error: str | None = None


@dataclass
class ConversionSelftest:
    backend: str
    families: list
    formats: list
    rows: list = field(default_factory=list)
    not_applicable: list = field(default_factory=list)
    refused: list = field(default_factory=list)
    schema: str = SCHEMA

    def summary(self) -> dict:
        faults = [r for r in self.rows if r.fault is not None]
        clean = [r for r in self.rows if r.fault is None]
        d, loc = sum(r.detected for r in faults), sum(r.localized for r in faults)
        alarms = sum(r.weights != Status.PASS for r in clean)  # the weight check's: the check's own status
        # also judges the quantization's loss by the logits (a q4 of a tiny model may fail that table)
        return {"detected": d, "localized": loc, "faults": len(faults), "false_alarms": alarms, "clean": len(clean),
                "not_applicable": len(self.not_applicable), "refused": len(self.refused),
                "ok": bool(faults) and d == len(faults) and loc >= LOCALIZE_MIN * len(faults) and alarms == 0}

    def summary_line(self) -> str:
        s = self.summary()
        return (f"conversion defects detected by the weight check {s['detected']}/{s['faults']}, localised "
                f"{s['localized']}/{s['faults']}; unmodified files failing {s['false_alarms']}/{s['clean']}"
                + (f"; {s['not_applicable']} not applicable" if s["not_applicable"] else "")
                + (f"; {s['refused']} refused" if s["refused"] else ""))

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary(), "summary_line": self.summary_line()}


def _shipped(backend, files: list, out: Path) -> Path:
    """What a check is given: the directory (a backend that loads directories) or the file of its suffix."""
    if backend.loads_directory:
        return out
    return next(Path(f) for f in files if Path(f).suffix == backend.artifact_suffix)


def _check_spec(spec: CheckSpec, backend, shipped: Path) -> CheckSpec:
    given = {"candidate_dir": str(shipped)} if backend.loads_directory else {"artifact": str(shipped)}
    return replace(spec, precision="fp32", options={}, drill="off", **given)


def _check(spec: CheckSpec, backend, shipped: Path):
    """The check of a shipped file, or the InputError it was refused with (a row, not the end of the run)."""
    try:
        return run_check(_check_spec(spec, backend, shipped), backend)
    except InputError as e:
        return e


def _judge(row: ConversionRow, r, t0: float) -> ConversionRow:
    row.seconds = time.perf_counter() - t0
    if isinstance(r, InputError):
        row.status, row.error = "refused", str(r).splitlines()[0][:300]
        return row
    w = (r.quantization or {}).get("weights") or {}
    row.status, row.weights = str(r.status), w.get("status")
    failing = [x for x in w.get("rows") or [] if x["status"] == Status.FAIL]
    row.failing = [x["name"] for x in failing]
    if row.fault is not None:
        row.detected = w.get("status") == Status.FAIL
        worst = w.get("worst") or {}
        held = set((worst.get("label") or "").split(", ")) | {worst.get("name")}
        row.localized = row.detected and bool(held & set(row.expected))
    if w.get("error"):
        row.error = str(w["error"]).splitlines()[0][:300]
    elif r.error:
        row.error = r.error.splitlines()[0][:300]
    return row


def run_conversion_selftest(backend_name: str, families=None, formats=None, fault_names=None, progress=None,
                            on_row=None) -> ConversionSelftest:
    families = list(families or FAMILY_NAMES)
    progress = progress or (lambda msg: None)
    base = validate(CheckSpec(family=families[0], backend=backend_name))
    if not base.shipped_formats or base.export is None or base.shipped_tensors is None:
        raise InputError(f"backend {backend_name} ships no file the weight check reads (no shipped_formats, export "
                         "and shipped_tensors): --conversion runs on mlx and llamacpp")
    known = [f.name for f in CATALOGUE] + list(base.file_faults)
    unknown = [n for n in fault_names or () if n not in known]
    if unknown:
        raise InputError(f"unknown conversion fault(s) {', '.join(map(repr, unknown))}; the catalogue: {', '.join(known)}")
    labels = [f[0] for f in base.shipped_formats]
    chosen = [f for f in base.shipped_formats if not formats or f[0] in formats]
    if formats and len(chosen) < len(set(formats)):
        raise InputError(f"unknown format(s) {', '.join(sorted(set(formats) - set(labels)))}: backend {backend_name} "
                         f"ships {', '.join(labels)}")
    ok, reason = base.availability()
    if not ok:
        raise InputError(f"backend {backend_name} is unavailable here: {reason}")
    res = ConversionSelftest(backend_name, families, [f[0] for f in chosen])

    def add(rows, row):
        rows.append(row)
        if on_row is not None:
            on_row(res, row)

    for family in families:
        spec = CheckSpec(family=family, backend=backend_name, drill="off")
        try:
            validate(spec)
            src = model_source(spec)
        except InputError as e:
            add(res.refused, {"family": family, "why": str(e)})
            continue
        args = src.args
        with tempfile.TemporaryDirectory(prefix="moe-oracle-conversion-") as tmp:
            for label, precision, options in chosen:
                fspec = replace(spec, precision=precision, options=dict(options))
                try:
                    out = Path(tmp) / label.replace(" ", "_") / "clean"
                    out.mkdir(parents=True)
                    clean_file = _shipped(base, base.export(src, fspec, out), out)
                except Exception as e:  # noqa: BLE001 - the exporter refuses the family at this format
                    add(res.refused, {"family": family, "format": label,
                                      "why": f"the exporter: {type(e).__name__}: {str(e).splitlines()[0][:200]}"})
                    continue
                progress(f"{family} {label} unmodified")
                t = time.perf_counter()
                r = _check(spec, base, clean_file)
                add(res.rows, _judge(ConversionRow(family, label, None, "the file as the exporter wrote it", "", None,
                                                   False, False), r, t))
                for fault in CATALOGUE:
                    if fault_names and fault.name not in fault_names:
                        continue
                    made = faulted_checkpoint(src.model_dir, src.checkpoint_sha256, fault, args)
                    if made is None:
                        add(res.not_applicable, {"family": family, "format": label, "fault": fault.name,
                                                 "why": "the model has nothing it breaks"})
                        continue
                    fdir, edited = made
                    progress(f"{family} {label} {fault.name}")
                    t = time.perf_counter()
                    out = Path(tmp) / label.replace(" ", "_") / fault.name
                    out.mkdir(parents=True)
                    try:
                        fsrc = model_source(replace(spec, model_dir=str(fdir)))
                        shipped = _shipped(base, base.export(fsrc, fspec, out), out)
                    except Exception as e:  # noqa: BLE001 - the exporter refuses the faulted checkpoint
                        add(res.not_applicable, {"family": family, "format": label, "fault": fault.name,
                                                 "why": f"the exporter refused it: {type(e).__name__}: "
                                                        f"{str(e).splitlines()[0][:200]}"})
                        continue
                    r = _check(spec, base, shipped)
                    add(res.rows, _judge(ConversionRow(family, label, fault.name, fault.what, "", None, False, False,
                                                       sorted({folded(n) for n in edited})), r, t))
                for name, what in base.file_faults.items():
                    if fault_names and name not in fault_names:
                        continue
                    t = time.perf_counter()
                    out = Path(tmp) / label.replace(" ", "_") / name
                    shutil.copytree(clean_file.parent if not base.loads_directory else clean_file, out)
                    shipped = out if base.loads_directory else out / clean_file.name
                    edited = base.apply_file_fault(name, shipped, src, args, progress)
                    if edited is None:
                        add(res.not_applicable, {"family": family, "format": label, "fault": name,
                                                 "why": "the file has nothing it breaks (no quantized tensor there)"})
                        continue
                    progress(f"{family} {label} {name}")
                    r = _check(spec, base, shipped)
                    add(res.rows, _judge(ConversionRow(family, label, name, what, "", None, False, False, [edited]), r, t))
    return res


def render(res: ConversionSelftest) -> str:
    lines = [f"conversion selftest of backend {res.backend}: families {', '.join(res.families)}; formats "
             f"{', '.join(res.formats)}", "",
             f"{'family':12s} {'format':8s} {'fault':22s} {'detected':8s} {'localised':9s} failing tensors"]
    for r in res.rows:
        if r.fault is None:
            if r.weights != Status.PASS:
                lines.append(f"{r.family:12s} {r.format:8s} {'(unmodified)':22s} FALSE ALARM: weights {r.weights}: "
                             f"{', '.join(r.failing[:3]) or r.error or ''}")
            continue
        det = "yes" if r.detected else "NO"
        loc = "yes" if r.localized else "NO"
        lines.append(f"{r.family:12s} {r.format:8s} {r.fault:22s} {det:8s} {loc:9s} "
                     f"{', '.join(r.failing[:3]) or r.error or '-'}" + ("" if r.localized else f" (expected {', '.join(r.expected)})"))
    for x in res.refused:
        lines.append(f"REFUSED {x['family']} {x.get('format', '')}: {x['why']}")
    return "\n".join(lines + ["", res.summary_line()]) + "\n"


def row_line(row) -> str:
    if isinstance(row, dict):
        return f"{row['family']} {row.get('format', '')} {row.get('fault', '')}: {'not applicable' if 'fault' in row else 'refused'}: {row['why']}"
    if row.fault is None:
        ok = row.weights == Status.PASS
        return (f"{row.family} {row.format} unmodified: weights {'pass' if ok else 'FALSE ALARM'}, check {row.status}"
                f" ({row.seconds:.0f} s)")
    verdict = ("detected" + ("" if row.localized else ", NOT localised")) if row.detected else "MISSED"
    return f"{row.family} {row.format} {row.fault}: {verdict} ({row.seconds:.0f} s)"
