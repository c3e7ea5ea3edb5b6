"""The weight check of the weights a given program carries outside itself (oracle/verdict/conversion.py): an
ExecuTorch program's `.ptd` and an IREE program's `.irpa` hold the production model's parameters by their
state-dict names (models/layers/), so the original is brought there by the family's own `sanitize()`
(`Family.production_tensors`, a decoder layer at a time). A float tensor is within half an ulp of its
stored type of the original (exactly the original at fp32); a tensor of another type (a quantized
ExecuTorch weight in torchao's layout) is listed without a bound."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from oracle.verdict.conversion import FLOATS, Chunk, Format, TensorSource

# ExecuTorch's ScalarType -> (numpy dtype, float type name)
ET_TYPES = {6: (np.float32, "F32"), 5: (np.float16, "F16"), 15: (np.uint16, "BF16")}


def _bf16(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def ptd_tensors(path: Path) -> dict:
    """name -> (shape, type name, read() -> float32 array or None) of an ExecuTorch .ptd, memory-mapped."""
    from exporters.executorch.rebind import flat_tensor_table

    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        _, base, flat = flat_tensor_table(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    out = {}
    for nd in flat.named_data:
        seg = flat.segments[nd.segment_index]
        layout = nd.tensor_layout
        st = int(getattr(layout.scalar_type, "value", layout.scalar_type)) if layout is not None else None
        shape = tuple(layout.sizes) if layout is not None else ()
        np_type, name = ET_TYPES.get(st, (None, f"scalar type {st}"))
        start = base + seg.offset

        def read(start=start, size=seg.size, np_type=np_type, shape=shape, name=name):
            a = np.frombuffer(data, dtype=np_type, count=int(np.prod(shape, dtype=np.int64)), offset=start)
            return (_bf16(a) if name == "BF16" else a.astype(np.float32)).reshape(shape)

        if layout is None:  # a delegate's data, keyed by the sha256 of its bytes
            out.setdefault("__content__", {})[nd.key] = (seg.size, lambda start=start, size=seg.size: np.frombuffer(
                data, dtype=np.uint8, count=size, offset=start))
            continue
        out[nd.key] = (shape, name, read if np_type is not None else None)
    return out


def irpa_tensors(path: Path) -> dict:
    """name -> (shape, type name, read()) of an IREE parameter archive, memory-mapped."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(path), mmap=True)
    out = {}
    for key, entry in index.items():
        a = rt.parameter_index_entry_as_numpy_ndarray(entry)
        kind = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(a.dtype, str(a.dtype))
        out[key] = (tuple(a.shape), kind, (lambda a=a: np.asarray(a, np.float32)) if kind in FLOATS else None)
    out["__keep__"] = index  # the mapping lives as long as the readers
    return out


def _decoded(read_bytes, kind: str):
    """A reader of a delegate entry's raw bytes as float32 values of `kind` (F32 or BF16)."""
    if kind == "BF16":
        return lambda: _bf16(read_bytes().view(np.uint16))
    return lambda: read_bytes().view(np.float32).astype(np.float32)


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(int(np.prod(x.shape[:-1], dtype=np.int64)) if x.ndim > 1 else 1, -1)


def production_tensor_sources(original, stored: dict, by_content: dict | None = None):
    """A TensorSource per parameter of the production model the file holds: by its name (`stored`), or, for
    a delegate's copy keyed by the sha256 of its bytes (`by_content`: key -> (bytes, read_f32)), by content:
    the original's bytes (fp32 or bf16) under their own hash are the original exactly; a parameter found
    neither way is paired with a delegate entry of its size that no parameter claims (its values judged:
    a copy that differs), else not checked (listed)."""
    import hashlib

    keep = stored.pop("__keep__", None)  # noqa: F841 (holds the archive's mapping open)
    by_content = dict(by_content or {})
    unmatched = []
    for group in original.family.production_tensors(original.model_dir, original.args):
        for name, t in sorted(group.items()):
            x = t.float().numpy()
            unit = x.shape[1] if x.ndim == 3 else 0
            if name in stored:
                shape, kind, read = stored[name]
                rows = _rows(x.reshape(shape))
                if read is None:
                    yield TensorSource(name, name, shape, Format(kind, bounded=False), lambda: iter(()))
                    continue
                yield TensorSource(name, name, shape, Format(kind, dtype=kind),
                                   lambda rows=rows, read=read: iter([Chunk(0, rows, _rows(read()).reshape(rows.shape))]),
                                   unit_rows=unit)
                continue
            found = None
            for kind, data in (("F32", x.astype(np.float32)), ("BF16", t.bfloat16().view(__import__("torch").int16).numpy())):
                key = hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()
                if key in by_content:
                    found = kind, _decoded(by_content.pop(key)[1], kind)
                    break
            if found:  # the delegate's copy, keyed by the original's hash: its bytes judged all the same (the
                # key was computed when the file was written; the bytes may have changed since)
                rows, read = _rows(x), found[1]
                yield TensorSource(name, f"{name} (a delegate's copy, by content)", x.shape, Format(found[0], dtype=found[0]),
                                   lambda rows=rows, read=read: iter([Chunk(0, rows, read().reshape(rows.shape))]),
                                   unit_rows=unit)
            else:
                unmatched.append((name, x))
    for name, x in unmatched:  # a copy that differs from every parameter: its values against the one of its size
        same = [k for k, (nbytes, _) in by_content.items() if nbytes == x.size * 4]
        if not same:
            yield TensorSource(name, f"{name} (not in the file: kept inside the program)", x.shape,
                               Format("F32", bounded=False), lambda: iter(()))
            continue
        rows = _rows(x)
        best = min(same, key=lambda k: float(np.square(_decoded(by_content[k][1], "F32")().reshape(rows.shape) - rows).sum()))
        read = _decoded(by_content.pop(best)[1], "F32")
        yield TensorSource(name, f"{name} (the delegate's entry {best[:12]}...)", x.shape, Format("F32", dtype="F32"),
                           lambda rows=rows, read=read: iter([Chunk(0, rows, read().reshape(rows.shape))]),
                           unit_rows=x.shape[1] if x.ndim == 3 else 0)
