"""CheckResult and its JSON form (schema oracle-report/v1). Everything here is data:
renderers never recompute numbers."""

from __future__ import annotations

import enum
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = "oracle-report/v1"


class Status(enum.StrEnum):
    """Every status a check, row, gate or step has. A str: JSON, markdown, HTML and comparisons
    with the strings read back from a report are the value itself ("pass", ...)."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"  # the candidate (or a stage of the check) raised
    SKIPPED = "skipped"  # the backend is unavailable here, or the check was refused
    XFAIL = "xfail"  # a failure its known divergence explains (oracle/verdict/expected.py)
    NA = "n/a"  # a block row the backend cannot isolate
    REPORTED = "reported"  # measured and shown, not judged (a quantization's own error)


# the statuses of a whole check
STATUSES = (Status.PASS, Status.FAIL, Status.XFAIL, Status.SKIPPED, Status.ERROR)
# composite blocks contain others: a fault is localised to the most specific failing block
SPECIFICITY = {"router": 0, "attention": 1, "moe": 1, "mlp": 1, "layer": 2, "final_norm": 3, "logits": 3}


@dataclass
class BlockRow:
    layer: int | None
    kind: str
    status: Status  # pass | fail | error (the candidate raised) | n/a
    mode: str  # isolated: fed the reference's inputs; in-situ: the candidate's own intermediate
    metrics: dict
    limits: dict
    ratio: float  # worst metric / its limit; > 1 fails
    detail: str = ""  # e.g. 'linear_attention'


@dataclass
class E2E:
    status: Status
    prompt_tokens: list[int]
    reference_tokens: list[int]  # greedy continuation of the reference
    candidate_tokens: list[int]  # candidate argmax at each step, fed the reference's tokens
    token_exact: bool
    steps: list[dict]  # per step: step, pos, max_abs, rel_l2, ratio, ref_margin, ref/cand token, status
    limits: dict
    first_mismatch: dict | None = None
    ties: list[int] = field(default_factory=list)
    # quantized precisions: KL mean/p99/max, same_top1, delta_p_* over all positions, status, ratio
    distribution: dict | None = None
    error: str | None = None  # the candidate raised at this step; the later steps were not run
    note: str = (
        "teacher forcing: the candidate is fed the reference's tokens, so per-step logits stay "
        "comparable after a divergence; up to the first mismatch this is the candidate's own greedy run"
    )
    # routing replay (oracle/verdict/replay.py): the candidate's selection recorded or not (why), every
    # difference from the reference's with its gap, tie bound and verdict (tie / divergence: fails),
    # whether the steps were judged against the routing-aligned reference, and then the plain
    # comparison with the reference beside it
    routing: dict | None = None
    # fp32 beyond its table: how the steps were judged against fp32's own measured error (oracle/verdict/e2e.py)
    measured_noise: str | None = None


@dataclass
class GateRow:
    name: str
    status: Status
    value: object
    limit: object
    message: str = ""


@dataclass
class CheckResult:
    spec: dict
    status: Status
    provenance: dict
    blocks: list[BlockRow] = field(default_factory=list)
    e2e: E2E | None = None
    gates: list[GateRow] = field(default_factory=list)
    structures: dict = field(default_factory=dict)  # name -> canonical text (op/node histograms)
    reference: dict = field(default_factory=dict)  # margins of the reference (how far from ties)
    worst: dict | None = None  # the localised fault: the most specific failing block row
    error: str | None = None
    skipped_reason: str | None = None
    timings: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)  # artifacts: name, sha256, cached (run state, like timings)
    # a shipped quantized directory: its format and bits, and (with the original checkpoint) the
    # quantization error rows `rows` (HF original vs HF on the dequantized weights: blocks, e2e,
    # status); `blocks`/`e2e` above are then the implementation error (the candidate vs HF on
    # the dequantized weights)
    quantization: dict | None = None
    # --prompt/--prompts: each prompt's e2e, and over all of them the logits distribution (KL,
    # same top-1) and the perplexity of the prompts' own next tokens (candidate / reference)
    prompts: dict | None = None
    # a known candidate defect (goldens/known_divergences.toml) that applies to this check: the
    # entry, what failed, and the verdict (expected failure / stale / unexpected): oracle/verdict/expected.py
    expected: dict | None = None
    # the drill-down inside blocks (oracle/drill/points.py): {"blocks": [Drill.as_dict()], "error"?}
    drill: dict | None = None
    # what a serving engine runs otherwise (oracle/verdict/invariance.py): the repeat, chunked and batched rows
    # (InvarianceRow.as_dict()), each against the same backend's e2e path; None where not run (--invariance off)
    invariance: list | None = None
    schema: str = SCHEMA

    def to_dict(self) -> dict:
        return _clean(asdict(self))


def place(layer: int | None) -> str:
    """Where a row is, in words: "layer N", or "model" for the rows outside the layers."""
    return "model" if layer is None else f"layer {layer}"


# where each block runs inside a decoder layer (for in-situ rows: program order)
PROGRAM_ORDER = {"attention": 0, "router": 1, "moe": 2, "mlp": 2, "layer": 3}


def worst_row(rows: list[BlockRow]) -> BlockRow | None:
    """The failing row that localises the fault.

    Isolated rows (fed the reference's inputs) fail only where the fault is: take the most
    specific failing kind (a router inside a failing MoE, an attention inside a failing
    layer), then the largest ratio. In-situ rows (the candidate's own intermediates) also
    fail downstream of the fault: if any failing row is in-situ, take the first failing
    block in program order (layer by layer, sub-blocks before their layer, then the final
    norm and the logits)."""
    failing = [r for r in rows if r.status in (Status.FAIL, Status.ERROR)]
    if not failing:
        return None
    if any("in-situ" in r.mode for r in failing):
        return min(failing, key=lambda r: (math.inf if r.layer is None else r.layer,
                                           PROGRAM_ORDER.get(r.kind, SPECIFICITY.get(r.kind, 9) + 4)))
    return min(failing, key=lambda r: (SPECIFICITY.get(r.kind, 9), -_num(r.ratio)))


def _num(x) -> float:
    return x if isinstance(x, (int, float)) else math.inf


def _clean(obj):
    """JSON-safe and stable: non-finite floats as strings, floats to 7 significant digits."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return float(f"{obj:.7g}")
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def dumps(result: CheckResult) -> str:
    return json.dumps(result.to_dict(), indent=1, sort_keys=True) + "\n"


def output_problem(path: str | Path, directory: bool = False) -> str | None:
    """What stops `path` (a report file, or with directory=True a report directory) from being
    written, checked before any work: its directory is created if missing and must take a
    file. None when it can be written; "-" (standard output) always can."""
    if str(path) == "-" and not directory:
        return None
    p = Path(path)
    if not directory and p.is_dir():
        return f"{p} is a directory"
    if directory and p.exists() and not p.is_dir():
        return f"{p} exists and is not a directory"
    d = p if directory else p.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".oracle-write-test-", dir=d)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return f"cannot write {p}: {e.strerror or e} ({e.filename or d})"
    return None


def write_atomic(path: str | Path, text: str) -> None:
    """Write via a temp file in the same directory + rename: never a half-written report.
    "-" writes to standard output."""
    if str(path) == "-":
        import sys

        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from oracle.cache.files import temp_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path.parent, f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
