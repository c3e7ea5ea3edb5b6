"""`executorch`: another checkpoint's weights in a program already lowered, instead of lowering again.

The program keeps every weight outside itself, in model.ptd (exporters/executorch.py): the weights the
portable ops read by their state-dict names, XNNPACK's by the sha256 of their bytes (a key the .pte's
delegate payload names). Two production models with one program identity (exporters/identity.py:
modules, attributes, tensor names, shapes and dtypes, buffer values) lower to one program whatever
their weight values: another seed of a family, or a seeded fault that edits weights alone. The second
is then the first's program with the second's bytes in model.ptd and its content keys renamed in both
files: byte for byte what lowering it writes (tests/test_executorch_weights.py), in a second instead of
the lowering's minutes.

A binding says what each entry of a lowered model.ptd holds, by tensor name; it is recorded beside the
program's identity the first time a program of that identity is lowered (ExecutorchBackend.artifact)."""

from __future__ import annotations

import hashlib
import mmap
import shutil
from pathlib import Path

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as a program's weights file holds them (contiguous, its own dtype)."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by name (a tensor that modules share, under each name)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def tensor_hashes(model: nn.Module) -> dict[str, list[str]]:
    """sha256 (hex) of each tensor's bytes -> the names of the tensors with those bytes; taken before the
    lowering (which releases the model's parameters). A tensor of one value repeated (a norm's ones, a
    zero bias, a scalar) is left out: a delegate's entry with its bytes could as well be a constant the
    lowering made, and binding it to the tensor would write another checkpoint's weight there."""
    out: dict[str, list[str]] = {}
    for name, t in model_tensors(model).items():
        flat = t.detach().reshape(-1)
        if flat.numel() <= 1 or bool((flat == flat[0]).all()):
            continue
        out.setdefault(hashlib.sha256(tensor_bytes(t)).hexdigest(), []).append(name)
    return out


def ptd_layout(path: Path) -> tuple[int, list[tuple[str, bool, int, int]]]:
    """(the end of the .ptd's header and table, [(key, by name, data offset, data size)]) of an ExecuTorch
    flat tensor file; by name: an entry with a tensor layout (a state-dict name), else a delegate's
    (keyed by the sha256 of its bytes)."""
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

    with open(path, "rb") as f:
        head = f.read(8 + FlatTensorHeader.EXPECTED_LENGTH)
        header = FlatTensorHeader.from_bytes(head[8:])
        if not header.is_valid():
            raise ValueError(f"{path}: not an ExecuTorch flat tensor file (.ptd)")
        f.seek(0)
        table_end = header.flatbuffer_offset + header.flatbuffer_size
        flat = _deserialize_to_flat_tensor(f.read(table_end))
    entries = []
    for nd in flat.named_data:
        seg = flat.segments[nd.segment_index]
        entries.append((nd.key, nd.tensor_layout is not None, header.segment_base_offset + seg.offset, seg.size))
    return table_end, entries


def binding(ptd: Path, hashes: dict[str, list[str]], names: set[str]) -> tuple[dict | None, str]:
    """(what each entry of a lowered program's weights file holds, or None, why not): {"named": the
    entries that are the model tensor of their name, "content": {key: the tensors whose bytes it is}}.
    An entry named for no model tensor keeps its bytes (a constant of the code, the same for every
    checkpoint of one identity); a delegate's entry that is no tensor's bytes (a weight the delegate
    derived) makes the program one that cannot take other weights."""
    _, entries = ptd_layout(ptd)
    named, content = [], {}
    for key, by_name, _, _ in entries:
        if by_name:
            if key in names:
                named.append(key)
        elif key in hashes:
            content[key] = hashes[key]
        else:
            return None, (f"the delegate's weight {key[:12]}... is no tensor of the model (derived while lowering) "
                          "or one of a single repeated value")
    return {"named": named, "content": content}, ""


def rebind(program: Path, bound: dict, model: nn.Module, dest: Path, keep: tuple[str, ...]) -> str | None:
    """Write at `dest` (a .pte; its model.ptd and the files named in `keep` beside it) the program at
    `program`, lowered for other weights of `model`'s identity (`bound`: binding() of its weights file),
    with `model`'s weights. None when written, else why it cannot be (nothing is left at `dest`'s files):
    a tensor the first weights shared in one entry differs here, or two entries would get one key."""
    tensors = model_tensors(model)
    src_ptd = program.with_name("model.ptd")
    table_end, entries = ptd_layout(src_ptd)
    by_key = {key: (off, size) for key, _, off, size in entries}
    writes, renames = [], {}
    for key in bound["named"]:
        off, size = by_key[key]
        data = tensor_bytes(tensors[key])
        if data.nbytes != size:
            return f"{key}: {data.nbytes} bytes here, {size} in the program"
        writes.append((off, data))
    for key, names in bound["content"].items():
        data = tensor_bytes(tensors[names[0]])
        if any(bytes(tensor_bytes(tensors[n])) != bytes(data) for n in names[1:]):
            return f"{', '.join(names)} are one weight of the program (equal where it was lowered) and differ here"
        off, size = by_key[key]
        if data.nbytes != size:
            return f"{names[0]}: {data.nbytes} bytes here, {size} in the program"
        renames[key.encode()] = hashlib.sha256(data).hexdigest().encode()
        writes.append((off, data))
    if len(set(renames.values())) < len(renames):
        return "two of the program's weights are equal here (lowering would keep one entry)"
    ptd = dest.with_name("model.ptd")
    try:
        shutil.copyfile(src_ptd, ptd)
        with open(ptd, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            table = bytes(m[:table_end])
            for old, new in renames.items():
                table = table.replace(old, new)
            m[:table_end] = table
            for off, data in writes:
                m[off:off + data.nbytes] = data
            m.flush()
        pte = program.read_bytes()
        for old, new in renames.items():
            pte = pte.replace(old, new)
        dest.write_bytes(pte)
        for name in keep:
            if program.with_name(name).is_file():
                shutil.copyfile(program.with_name(name), dest.with_name(name))
    except BaseException:
        for f in (dest, ptd, *(dest.with_name(n) for n in keep)):
            f.unlink(missing_ok=True)
        raise
    return None
