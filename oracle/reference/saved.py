"""A reference on disk: the cache's form (arrays in safetensors, the rest in JSON) and the
portable one `oracle reference save` writes (with its provenance and the sha256 of its files)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from oracle.reference.run import BlockCall, Reference


def save(ref: Reference, path: Path) -> None:
    """The reference as <path>.safetensors (every tensor) + <path>.json (the structure),
    each written atomically."""
    tensors, blocks = {}, []
    for i, (p, lg) in enumerate(zip(ref.positions, ref.logits)):
        tensors[f"pos.{i}"], tensors[f"logits.{i}"] = p, lg
    for key, calls in ref.inputs.items():
        name = f"{key[0]}.{key[1]}"
        for i, (c, o) in enumerate(zip(calls, ref.outputs[key])):
            tensors[f"in.{name}.{i}"] = c.x_array
            tensors[f"inpos.{name}.{i}"] = c.pos_array
            if key[1] == "router":
                tensors[f"out.{name}.{i}"], tensors[f"idx.{name}.{i}"] = o
            else:
                tensors[f"out.{name}.{i}"] = o
        blocks.append({"layer": key[0], "kind": key[1], "tokens": [c.tokens for c in calls],
                       "probe": [c.probe for c in calls]})
    for layer, probs in ref.router_probs.items():
        for i, p in enumerate(probs):
            tensors[f"probs.{layer}.{i}"] = p
    for layer, gaps in ref.group_gaps.items():
        for i, g in enumerate(gaps):
            tensors[f"ggap.{layer}.{i}"] = g
    for layer, gaps in ref.weight_gaps.items():
        for i, g in enumerate(gaps):
            tensors[f"wgap.{layer}.{i}"] = g
    for layer, alts in ref.group_alternatives.items():
        for i, g in enumerate(alts):
            tensors[f"galt.{layer}.{i}"] = g
    for layer, calls in ref.index_selected.items():
        for i, (sel, sc) in enumerate(zip(calls, ref.index_scores[layer])):
            tensors[f"isel.{layer}.{i}"], tensors[f"iscore.{layer}.{i}"] = sel, sc
    meta = {"tokens": ref.tokens, "prompt_len": ref.prompt_len, "calls": len(ref.positions), "blocks": blocks,
            "router_layers": {str(k): len(v) for k, v in ref.router_probs.items()},
            "group_gap_layers": {str(k): len(v) for k, v in ref.group_gaps.items()},
            "weight_gap_layers": {str(k): len(v) for k, v in ref.weight_gaps.items()},
            "group_alternative_layers": {str(k): len(v) for k, v in ref.group_alternatives.items()},
            "coverage": {str(k): v for k, v in ref.coverage.items()},
            "indexer_layers": {str(k): len(v) for k, v in ref.index_selected.items()}}
    save_arrays(tensors, meta, path)


def save_arrays(tensors: dict, meta: dict, path: Path) -> None:
    """<path>.safetensors (the arrays) and <path>.json (`meta`), each written atomically."""
    import json

    from safetensors.numpy import save_file

    from oracle.cache.files import temp_file
    from oracle.reports.result import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path.parent, f".{path.name}.", ".tmp.safetensors")
    os.close(fd)  # a name of its own: two processes capturing one reference never share a temp file
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp)
        os.replace(tmp, path.with_suffix(".safetensors"))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    write_atomic(path.with_suffix(".json"), json.dumps(meta))


def load(path: Path) -> Reference | None:
    """A saved reference, or None if it is not there (or unreadable: then it is rebuilt)."""
    import json

    from safetensors.numpy import load_file

    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        t = load_file(str(path.with_suffix(".safetensors")))
        return _reference_of(meta, t)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):  # not what save() writes
        return None


def _reference_of(meta: dict, t: dict) -> Reference:
    n = meta["calls"]
    ref = Reference(meta["tokens"], meta["prompt_len"], [t[f"pos.{i}"] for i in range(n)],
                    [t[f"logits.{i}"] for i in range(n)])
    for b in meta["blocks"]:
        key, name = (b["layer"], b["kind"]), f"{b['layer']}.{b['kind']}"
        ref.inputs[key] = [BlockCall(t[f"in.{name}.{i}"], t[f"inpos.{name}.{i}"], toks, probe)
                           for i, (toks, probe) in enumerate(zip(b["tokens"], b["probe"]))]
        ref.outputs[key] = [(t[f"out.{name}.{i}"], t[f"idx.{name}.{i}"]) if b["kind"] == "router"
                            else t[f"out.{name}.{i}"] for i in range(len(b["tokens"]))]
    ref.router_probs = {int(k): [t[f"probs.{k}.{i}"] for i in range(m)] for k, m in meta["router_layers"].items()}
    ref.group_gaps = {int(k): [t[f"ggap.{k}.{i}"] for i in range(m)]
                      for k, m in meta.get("group_gap_layers", {}).items()}
    ref.weight_gaps = {int(k): [t[f"wgap.{k}.{i}"] for i in range(m)]
                       for k, m in meta.get("weight_gap_layers", {}).items()}
    ref.group_alternatives = {int(k): [t[f"galt.{k}.{i}"] for i in range(m)]
                              for k, m in meta.get("group_alternative_layers", {}).items()}
    ref.coverage = {int(k): v for k, v in meta["coverage"].items()}
    ref.index_selected = {int(k): [t[f"isel.{k}.{i}"] for i in range(m)]
                          for k, m in meta.get("indexer_layers", {}).items()}
    ref.index_scores = {int(k): [t[f"iscore.{k}.{i}"] for i in range(m)]
                        for k, m in meta.get("indexer_layers", {}).items()}
    return ref


# ---------------------------------------------------------------- portable references
PORTABLE_FORMAT = 2  # 2: provenance.json records the sha256 of the reference's files


SAVED_FILES = ("reference.json", "reference.safetensors")  # what provenance.json's "files" hashes


PORTABLE_FILES = ("reference.json", "reference.safetensors", "provenance.json")


def save_portable(ref: Reference, out: Path, provenance: dict) -> list[Path]:
    """A captured reference as a directory that can be moved to another machine: every tensor
    (reference.safetensors), the structure (reference.json) and what it was captured from
    (provenance.json: family, checkpoint sha256, config, prompt, steps, seed, versions).
    Written into a temporary directory beside `out`, then renamed: never half there."""
    import json
    import shutil

    from oracle.cache.files import temp_dir

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out.parent, f".{out.name}.")
    try:
        from oracle.cache.artifacts import sha256_file

        save(ref, tmp / "reference")
        files = {f: sha256_file(tmp / f) for f in SAVED_FILES}
        (tmp / "provenance.json").write_text(json.dumps({**provenance, "format": PORTABLE_FORMAT, "files": files},
                                                        indent=1, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / f for f in PORTABLE_FILES]


def read_portable(path: Path) -> dict:
    """provenance.json of a saved reference directory; ValueError saying what is wrong."""
    import json

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--reference {path}: not a directory")
    missing = [f for f in PORTABLE_FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"--reference {path}: not a saved reference (missing {', '.join(missing)}; "
                         "write one with `oracle reference save`)")
    try:
        meta = json.loads((path / "provenance.json").read_text())
    except ValueError as e:
        raise ValueError(f"--reference {path}/provenance.json: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"--reference {path}/provenance.json: not a JSON object")
    if meta.get("format") != PORTABLE_FORMAT:
        raise ValueError(f"--reference {path}: format {meta.get('format')!r:.40}, this version reads {PORTABLE_FORMAT} "
                         "(save it again with `oracle reference save`)")
    for key, kind in (("family", str), ("checkpoint_sha256", str), ("files", dict)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"--reference {path}/provenance.json: {key} is not a {kind.__name__}")
    if not re.fullmatch(r"[0-9a-f]{64}", meta["checkpoint_sha256"]):
        raise ValueError(f"--reference {path}/provenance.json: checkpoint_sha256 is not a sha256")
    return meta


def load_portable(path: Path) -> Reference:
    """The saved reference, its files verified first against the sha256 provenance.json records
    (a reference is what `oracle reference save` wrote, byte for byte, or nothing)."""
    from oracle.cache.artifacts import sha256_file

    path = Path(path)
    files = read_portable(path)["files"]
    for name in SAVED_FILES:
        if files.get(name) != sha256_file(path / name):
            raise ValueError(f"--reference {path}/{name}: changed or damaged since it was saved (not the sha256 "
                             "provenance.json records)")
    ref = load(path / "reference")
    if ref is None:
        raise ValueError(f"--reference {path}: reference.safetensors / reference.json are unreadable")
    return ref
