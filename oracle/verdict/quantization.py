"""The quantization error of a shipped (or backend-written) quantized directory: HF on the original
weights against HF on the dequantized ones, block by block and end to end."""

from __future__ import annotations

from dataclasses import asdict, replace

from oracle.backend import CheckSpec, resolve
from oracle.reports.result import Status, worst_row
from oracle.verdict.compare import block_rows, reduction_length
from oracle.verdict.e2e import run_e2e
from oracle.reference.cached import reference_of
from oracle.source.sources import Sources


def limits_precision(quantization: dict) -> str:
    """The quantized precision whose limits judge the quantization error: q4 where any module
    has 4 bits or fewer, else q8."""
    return "q4" if min(quantization.get("bits") or [8]) <= 4 else "q8"


def quantization_rows(spec: CheckSpec, srcs: Sources, prompt: list[int], progress) -> dict:
    """The quantization error: HF on the original weights (the reference) against HF on the
    shipped weights dequantized (the candidate, transformers itself), block by block and end to
    end. Judged end to end, by the logits' distribution at the quantized precision's limits (KL,
    delta-p, same top-1: what quantization is judged by); the block rows are the scheme's own loss
    per block, each measured against the precision's fixed table and reported (`over_table`), not
    judged: with outlier features a correct group quantization exceeds a table fitted on
    normal-law weights (docs/noise.md). Of a directory the backend built for --precision q8/q4
    (`srcs.built`) nothing is judged: its loss is the chosen bits and group size on these weights,
    not the backend's doing (status `reported`)."""
    precision = limits_precision(srcs.quantization or {})
    qspec = replace(spec, precision=precision, candidate_dir=None)
    ref = reference_of(spec, srcs.original, prompt)
    out = {"precision": precision, "reference": "HF transformers fp32, original weights",
           "candidate": "HF transformers fp32, the shipped weights dequantized"}
    try:
        hf = resolve("hf").load(srcs.src, replace(qspec, precision="fp32"))
        rows = block_rows(ref, hf, qspec, srcs.original.args, lambda *a: progress("quantization", *a[1:]))
        e2e, _ = run_e2e(ref, hf, qspec, reduction_length(srcs.original.args))
    except Exception as e:
        return {**out, "status": Status.ERROR, "error": f"{type(e).__name__}: {e}"}
    w = worst_row(rows)
    status = Status.REPORTED if srcs.built else Status.FAIL if e2e.status in (Status.FAIL, Status.ERROR) else Status.PASS
    return {**out, "status": status, "blocks": [asdict(r) for r in rows],
            "e2e": asdict(e2e), "over_table": asdict(w) if w else None}
