"""Goldens: data frozen from a check that passed against the HF reference.

goldens/<family>/<backend>/tokens.json      greedy token ids of the tiny model (fixed prompt, seed)
goldens/<family>/<backend>/<name>.txt       structural goldens: a backend's op / node histogram
goldens/<family>/<backend>/<name>.<P>.txt   the same at precision P, where its graph differs (bf16: the
                                            casts around what the model keeps in fp32 at bf16, as HF does)
goldens/<family>/<backend>/gates.toml       hand-written gate limits (e.g. a cast-count maximum)

A check compares what exists for its family and backend: tokens exactly (only when the
check's spec is the one frozen), structures byte-exact with a line diff on mismatch.
`freeze` writes new goldens only after the numeric check passes; it never touches
another family's or backend's goldens.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

from oracle.reports.result import GateRow, Status, write_atomic

# a golden applies to the spec it was frozen for: these fields and the backend options (an
# option can change the artifact, e.g. a partitioner, or the tokens, e.g. weight quantization),
# and the weight profile (tokens frozen on normal weights say nothing of trained ones)
TOKEN_SPEC_KEYS = ("seed", "prompt_len", "decode_tokens", "precision", "options", "weights")


def root() -> Path:
    return Path(os.environ.get("MOE_ORACLE_GOLDENS", Path(__file__).resolve().parents[2] / "goldens"))


def golden_dir(family: str, backend: str) -> Path:
    return root() / family / backend


def histogram_text(counts: dict, header: str) -> str:
    """A structural golden's canonical text: a header line, then `name count` sorted by name."""
    return f"# {header}\n" + "".join(f"{k} {v}\n" for k, v in sorted(counts.items()))


def _token_spec(spec) -> dict:
    # the normal profile is left out: goldens frozen before the profiles have no weights key, and
    # refreezing one writes the same bytes
    return {k: getattr(spec, k) for k in TOKEN_SPEC_KEYS if not (k == "weights" and spec.weights == "normal")}


def frozen_spec(family: str, backend: str) -> dict | None:
    """The spec fields the goldens of family/backend were frozen with (None: no goldens)."""
    path = golden_dir(family, backend) / "tokens.json"
    if not path.is_file():
        return None
    # goldens frozen before options counted, and before the weight profiles (normal)
    return {"options": {}, "weights": "normal", **json.loads(path.read_text())["spec"]}


def applies(spec, keys=TOKEN_SPEC_KEYS) -> bool:
    """Goldens compare only for the tiny model and the spec they were frozen for (these fields of it)."""
    frozen = frozen_spec(spec.family, spec.backend)
    return (spec.model_dir is None and getattr(spec, "config", None) is None and frozen is not None
            and getattr(spec, "candidate_dir", None) is None  # a shipped directory: other weights
            and all(frozen.get(k) == getattr(spec, k) for k in keys))


def token_gate(spec, candidate_tokens: list[int]) -> GateRow | None:
    """Exact golden tokens, when the golden was frozen for this spec (tiny model only)."""
    path = golden_dir(spec.family, spec.backend) / "tokens.json"
    if not applies(spec):
        return None
    doc = json.loads(path.read_text())
    want = doc["tokens"]
    if candidate_tokens == want:
        return GateRow("golden_tokens", Status.PASS, len(want), len(want), f"{path.relative_to(root())}")
    pos = next((i for i, (a, b) in enumerate(zip(candidate_tokens, want)) if a != b),
               min(len(want), len(candidate_tokens)))
    got = candidate_tokens[pos] if pos < len(candidate_tokens) else None
    exp = want[pos] if pos < len(want) else None
    msg = (f"{spec.family}/{spec.backend}: golden token mismatch at position {pos} (generated token {pos}): "
           f"golden {exp}, candidate {got}; golden {want}, candidate {candidate_tokens}")
    return GateRow("golden_tokens", Status.FAIL, got, exp, msg)


def structure_path(spec, name: str) -> Path:
    """The structural golden of `name` at the check's precision: `<name>.<precision>.txt` where one was
    frozen at it, else `<name>.txt` (frozen at the goldens' own spec; a graph whose histogram does not
    depend on the precision: executorch-mlx's in most families)."""
    d = golden_dir(spec.family, spec.backend)
    own = d / f"{name}.{spec.precision}.txt"
    return own if own.is_file() else d / f"{name}.txt"


def structure_gates(spec, structures: dict[str, str]) -> list[GateRow]:
    """Byte-exact structural goldens, with a readable line diff on mismatch. Compared when the
    check builds with the options they were frozen with (a partitioner or a sampler is another
    graph), at any length (prefill lengths are dynamic dimensions), at the precision's own golden
    where one exists (structure_path)."""
    rows = []
    if not applies(spec, ("options",)):
        return rows
    for name, text in sorted(structures.items()):
        path = structure_path(spec, name)
        if not path.is_file():
            continue
        want = path.read_text()
        if text == want:
            rows.append(GateRow(f"structure:{name}", Status.PASS, "identical", str(path.relative_to(root()))))
            continue
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            f"golden {path.relative_to(root())}", "candidate", n=1))
        rows.append(GateRow(f"structure:{name}", Status.FAIL, "differs", str(path.relative_to(root())),
                            f"{spec.family}/{spec.backend} {name} differs from the golden:\n{diff}"))
    return rows


def freeze(spec, result) -> tuple[bool, str, list[Path]]:
    """Write the goldens of `spec` from `result`, its numeric check run with the golden gates
    ignored (`run_check(spec, goldens=False)`), only if it passed."""
    if result.status != Status.PASS:
        why = result.skipped_reason or result.error or (
            f"worst block {result.worst['layer']} {result.worst['kind']}" if result.worst else "e2e or a gate failed")
        return False, f"{spec.family}/{spec.backend}: check {result.status}, not freezing: {why}", []
    d = golden_dir(spec.family, spec.backend)
    written = []
    frozen = frozen_spec(spec.family, spec.backend)
    if frozen is not None and frozen.get("precision", "fp32") != spec.precision:  # another precision's graph:
        for name, text in sorted((result.structures or {}).items()):  # its structures, the tokens untouched
            write_atomic(d / f"{name}.{spec.precision}.txt", text)
            written.append(d / f"{name}.{spec.precision}.txt")
        return True, f"{spec.family}/{spec.backend}: froze {', '.join(p.name for p in written) or 'nothing'}", written
    tokens = {"spec": _token_spec(spec), "prompt": result.e2e.prompt_tokens, "tokens": result.e2e.candidate_tokens,
              "frozen_with": {k: v for k, v in result.provenance["versions"].items()
                              if k in ("torch", "transformers", "executorch", "iree-base-compiler", "mlx",
                                       "llama-cpp-python")}}
    write_atomic(d / "tokens.json", json.dumps(tokens, indent=1, sort_keys=True) + "\n")
    written.append(d / "tokens.json")
    for name, text in sorted((result.structures or {}).items()):
        write_atomic(d / f"{name}.txt", text)
        written.append(d / f"{name}.txt")
    return True, f"{spec.family}/{spec.backend}: froze {', '.join(p.name for p in written)}", written


def present() -> list[tuple[str, str]]:
    """(family, backend) pairs that have goldens."""
    if not root().is_dir():
        return []
    return sorted((f.name, b.name) for f in root().iterdir() if f.is_dir() for b in f.iterdir() if b.is_dir())


def default_spec(family: str, backend: str, like=None):
    from oracle.backend import CheckSpec

    spec = CheckSpec(family=family, backend=backend)
    frozen = frozen_spec(family, backend)
    if frozen is not None:
        spec = replace(spec, **frozen)
    return spec if like is None else replace(like, **{k: v for k, v in asdict(spec).items() if k in TOKEN_SPEC_KEYS})
