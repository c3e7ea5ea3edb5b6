"""Goldens: data frozen from a check that passed against the HF reference.

goldens/<family>/<backend>/tokens.json      greedy token ids of the tiny model (fixed prompt, seed)
goldens/<family>/<backend>/<name>.txt       structural goldens: a backend's op / node histogram
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

from oracle.result import GateRow, write_atomic

TOKEN_SPEC_KEYS = ("seed", "prompt_len", "decode_tokens", "precision")


def root() -> Path:
    return Path(os.environ.get("MOE_ORACLE_GOLDENS", Path(__file__).resolve().parent.parent / "goldens"))


def golden_dir(family: str, backend: str) -> Path:
    return root() / family / backend


def _token_spec(spec) -> dict:
    return {k: getattr(spec, k) for k in TOKEN_SPEC_KEYS}


def token_gate(spec, candidate_tokens: list[int]) -> GateRow | None:
    """Exact golden tokens, when the golden was frozen for this spec (tiny model only)."""
    path = golden_dir(spec.family, spec.backend) / "tokens.json"
    if spec.model_dir is not None or not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc["spec"] != _token_spec(spec):
        return None
    want = doc["tokens"]
    if candidate_tokens == want:
        return GateRow("golden_tokens", "pass", len(want), len(want), f"{path.relative_to(root())}")
    pos = next((i for i, (a, b) in enumerate(zip(candidate_tokens, want)) if a != b),
               min(len(want), len(candidate_tokens)))
    got = candidate_tokens[pos] if pos < len(candidate_tokens) else None
    exp = want[pos] if pos < len(want) else None
    msg = (f"{spec.family}/{spec.backend}: golden token mismatch at position {pos} (generated token {pos}): "
           f"golden {exp}, candidate {got}; golden {want}, candidate {candidate_tokens}")
    return GateRow("golden_tokens", "fail", got, exp, msg)


def structure_gates(spec, structures: dict[str, str]) -> list[GateRow]:
    """Byte-exact structural goldens, with a readable line diff on mismatch."""
    rows = []
    for name, text in sorted(structures.items()):
        path = golden_dir(spec.family, spec.backend) / f"{name}.txt"
        if spec.model_dir is not None or not path.is_file():
            continue
        want = path.read_text()
        if text == want:
            rows.append(GateRow(f"structure:{name}", "pass", "identical", str(path.relative_to(root()))))
            continue
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            f"golden {path.relative_to(root())}", "candidate", n=1))
        rows.append(GateRow(f"structure:{name}", "fail", "differs", str(path.relative_to(root())),
                            f"{spec.family}/{spec.backend} {name} differs from the golden:\n{diff}"))
    return rows


def freeze(spec, backend=None) -> tuple[bool, str, list[Path]]:
    """Run the numeric check (golden gates ignored); write goldens only if it passed."""
    from oracle.check import run_check

    result = run_check(spec, backend, goldens=False)
    if result.status != "pass":
        why = result.skipped_reason or result.error or (
            f"worst block {result.worst['layer']} {result.worst['kind']}" if result.worst else "e2e or a gate failed")
        return False, f"{spec.family}/{spec.backend}: check {result.status}, not freezing: {why}", []
    d = golden_dir(spec.family, spec.backend)
    written = []
    tokens = {"spec": _token_spec(spec), "prompt": result.e2e.prompt_tokens, "tokens": result.e2e.candidate_tokens,
              "frozen_with": {k: v for k, v in result.provenance["versions"].items()
                              if k in ("torch", "transformers", "executorch", "iree-base-compiler", "mlx")}}
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
    path = golden_dir(family, backend) / "tokens.json"
    if path.is_file():
        spec = replace(spec, **json.loads(path.read_text())["spec"])
    return spec if like is None else replace(like, **{k: v for k, v in asdict(spec).items() if k in TOKEN_SPEC_KEYS})
