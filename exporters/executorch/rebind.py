"""ExecuTorch programs (`executorch`, `executorch-mlx`): another checkpoint's weights in a program already
lowered, instead of lowering again.

Two production models with one program identity (exporters/shared/identity.py: modules, attributes, tensor
names, shapes and dtypes, buffer values) lower to one program whatever their weight values: another seed
of a family, or a seeded fault that edits weights alone. The program keeps its weights as named data: in
model.ptd beside it (`executorch`: the portable ops' weights by their state-dict names, XNNPACK's by the
sha256 of their bytes, a key the .pte's delegate payload names) or in the .pte's own segments (the MLX
delegate's, by its names). The second model's program is the first's with the second's bytes in those
entries and the content keys renamed: byte for byte what lowering it writes (benchmarks/
executorch_rebind.py), in a second or two instead of the lowering's minutes.

A binding says what each entry holds, by tensor name (or a tensor's axes in the delegate's order: XNNPACK
keeps a depthwise convolution's [C, 1, K] filter as [1, K, C]); it is recorded beside the program's
identity the first time a program of that identity is lowered (OneLowering)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
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
        if not one_value(t):
            out.setdefault(hashlib.sha256(tensor_bytes(t)).hexdigest(), []).append(name)
    return out


def one_value(t: torch.Tensor) -> bool:
    """A tensor of one value repeated (or a scalar): its bytes tell no weight from a constant the lowering made."""
    flat = t.detach().reshape(-1)
    return flat.numel() <= 1 or bool((flat == flat[0]).all())


def flat_tensor_table(data) -> tuple[int, int, object]:
    """(the end of the header and table, the segments' base offset, the table) of an ExecuTorch flat tensor
    file's bytes (.ptd; a bytes-like or mmap, read up to the table's end)."""
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

    header = FlatTensorHeader.from_bytes(bytes(data[8:8 + FlatTensorHeader.EXPECTED_LENGTH]))
    if not header.is_valid():
        raise ValueError("not an ExecuTorch flat tensor file (.ptd)")
    table_end = header.flatbuffer_offset + header.flatbuffer_size
    return table_end, header.segment_base_offset, _deserialize_to_flat_tensor(bytes(data[:table_end]))


def ptd_layout(path: Path) -> tuple[int, list[tuple[str, str, int, int]]]:
    """(the end of the file's header and table, [(key, kind, data offset, data size)]) of the named data of an
    ExecuTorch flat tensor file (.ptd) or program (.pte). kind: "name", the key is a tensor's state-dict
    name (a .ptd entry with a tensor layout); "content", the key is the sha256 of the bytes (a delegate's
    .ptd entry); "slot", the key is the delegate's own name for it (a .pte's named data)."""
    if path.suffix == ".pte":
        return pte_layout(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            table_end, base, flat = flat_tensor_table(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    entries = []
    for nd in flat.named_data:
        seg = flat.segments[nd.segment_index]
        entries.append((nd.key, "name" if nd.tensor_layout is not None else "content", base + seg.offset, seg.size))
    return table_end, entries


def pte_layout(path: Path) -> tuple[int, list[tuple[str, str, int, int]]]:
    """ptd_layout of a .pte's named data (its segments after the program's flatbuffer)."""
    from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

    data = path.read_bytes()
    eh = _get_extended_header(data)
    if eh is None or not eh.is_valid():
        return len(data), []  # no segments: nothing outside the flatbuffer
    program = _flatbuffer_to_program(data[:eh.program_size])
    return eh.program_size, [(nd.key, "slot", eh.segment_base_offset + program.segments[nd.segment_index].offset,
                              program.segments[nd.segment_index].size) for nd in program.named_data]


PERMUTED_CANDIDATES = 64  # tensors of an entry's size tried in other axis orders, at most (else: not bound)


def permuted_as(entry, tensors: dict[str, torch.Tensor]) -> list[list]:
    """[[name, axis order], ...]: the model tensors (of `tensors`, taken before the lowering) whose bytes in
    another order of their axes are `entry`'s bytes (a layout the delegate chose: XNNPACK's depthwise
    convolution filter [1, K, C] of a [C, 1, K] conv1d weight). Tensors of one value repeated are left out
    (tensor_hashes); too many tensors of the entry's size to try, none."""
    size = len(entry)
    same = [(n, t) for n, t in tensors.items() if t.dim() >= 2 and t.numel() * t.element_size() == size]
    if len(same) > PERMUTED_CANDIDATES:
        return []
    out = []
    for name, t in [(n, t) for n, t in same if not one_value(t)]:
        for order in itertools.permutations(range(t.dim())):
            if order != tuple(range(t.dim())) and bytes(tensor_bytes(t.detach().permute(order))) == entry:
                out.append([name, list(order)])
                break
    return out


def laid_out(t: torch.Tensor, order: list[int] | None) -> memoryview:
    """A tensor's bytes in the entry's axis order (None: its own)."""
    return tensor_bytes(t if order is None else t.detach().permute(order))


def binding(weights: Path, hashes: dict[str, list[str]], names: set[str],
            code_constant=lambda key: False, tensors: dict[str, torch.Tensor] | None = None) -> tuple[dict | None, str]:
    """(what each named data entry of a lowered program's weights file holds, or None, why not): {"file": its
    name, "named": the entries that are the model tensor of their name, "content" and "slots": {key: the
    tensors whose bytes it is}, "permuted": {key: {"kind": "content" or "slot", "tensors": [[name, axis
    order], ...]}}: the tensors whose bytes in that order it is (permuted_as, given the model's `tensors`)}.
    An entry named for no model tensor, or one `code_constant(key)` says the lowering made from the code
    (the MLX delegate's scalars), keeps its bytes: the same for every checkpoint of one identity. Any
    other entry that is no tensor's bytes in any order (a weight the delegate derived) makes the program
    one that cannot take other weights."""
    _, entries = ptd_layout(weights)
    bound = {"file": weights.name, "named": [], "content": {}, "slots": {}, "permuted": {}}
    with open(weights, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for key, kind, off, size in entries:
            if kind == "name":
                if key in names:
                    bound["named"].append(key)
                continue
            # a delegate's entry: whose bytes? (a content key is their hash; a slot's bytes are hashed here)
            whose = hashes.get(key if kind == "content" else hashlib.sha256(data[off:off + size]).hexdigest())
            if whose:
                bound["content" if kind == "content" else "slots"][key] = whose
            elif code_constant(key):
                continue
            elif tensors and (moved := permuted_as(data[off:off + size], tensors)):
                bound["permuted"][key] = {"kind": kind, "tensors": moved}
            else:
                return None, (f"the delegate's weight {key[:40]} is no tensor of the model in any order of its "
                              "axes (derived while lowering) or one of a single repeated value")
    return bound, ""


def rebind(program: Path, bound: dict, model: nn.Module, dest: Path, keep: tuple[str, ...]) -> str | None:
    """Write at `dest` (a .pte; its weights file and the files named in `keep` beside it) the program at
    `program`, lowered for other weights of `model`'s identity (`bound`: binding() of its weights file),
    with `model`'s weights. None when written, else why it cannot be (nothing is left at `dest`'s files):
    a tensor the first weights shared in one entry differs here, or two entries would get one key."""
    tensors = model_tensors(model)
    src = program.with_name(bound["file"])
    table_end, entries = ptd_layout(src)
    by_key = {key: (off, size) for key, _, off, size in entries}
    writes, renames = [], {}
    permuted = bound.get("permuted", {})  # (records written before it existed have none)
    for key, held in [*((k, [[k, None]]) for k in bound["named"]),
                      *((k, [[n, None] for n in names]) for k, names in [*bound["content"].items(), *bound["slots"].items()]),
                      *((k, p["tensors"]) for k, p in permuted.items())]:
        data = laid_out(tensors[held[0][0]], held[0][1])
        if any(bytes(laid_out(tensors[n], order)) != bytes(data) for n, order in held[1:]):
            return (f"{', '.join(n for n, _ in held)} are one weight of the program (equal where it was lowered) "
                    "and differ here")
        off, size = by_key[key]
        if data.nbytes != size:
            return f"{held[0][0]}: {data.nbytes} bytes here, {size} in the program"
        if key in bound["content"] or permuted.get(key, {}).get("kind") == "content":
            renames[key.encode()] = hashlib.sha256(data).hexdigest().encode()
        writes.append((off, data))
    if len(set(renames.values())) < len(renames):
        return "two of the program's weights are equal here (lowering would keep one entry)"
    out = dest.with_name(bound["file"])
    written = [dest, out, *(dest.with_name(n) for n in keep)]
    try:
        shutil.copyfile(src, out)
        with open(out, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            m[:table_end] = renamed(bytes(m[:table_end]), renames)
            for off, data in writes:
                m[off:off + data.nbytes] = data
            m.flush()
        if out != dest:  # the weights beside the program: its delegate payload names the renamed keys
            dest.write_bytes(renamed(program.read_bytes(), renames))
        for name in keep:
            if program.with_name(name).is_file():
                shutil.copyfile(program.with_name(name), dest.with_name(name))
    except BaseException:
        for f in written:
            f.unlink(missing_ok=True)
        raise
    return None


def renamed(data: bytes, renames: dict[bytes, bytes]) -> bytes:
    """`data` with every old key of `renames` replaced by its new key, all at once: a new key may be another
    entry's old one (a checkpoint whose tensors are another's in other places: DeepSeek-V4's tiny draw after
    580bffb has its shared experts' gate the old up's bytes), which a replacement one key after another would
    rename twice (two entries with one key: the program read one weight for both, logits 3.33 off)."""
    import re

    if not renames:
        return data
    return re.sub(b"|".join(re.escape(k) for k in renames), lambda hit: renames[hit.group(0)], data)


RECORDS = "executorch-programs"  # the cache's records of the first program lowered per identity


class OneLowering:
    """One lowering per program identity, for the cache entry `parts` of artifacts/`kind` being built:
    entered around cached_artifact, whose build calls `build`. The first program of an identity is
    lowered and recorded with its binding (on leaving, once it is in place); a later one is that
    program with its own weights (rebind), or lowered where it cannot be (recorded so, or refused
    here). Programs of one identity are lowered one at a time: a lock on the record, taken in `build`
    and held until the caller's program is in place, so a second check waits for the first and takes
    its program. `weights`: the file holding the named data ("model.ptd", or "model.pte" itself);
    `keep`: the files beside the program copied with it; `code_constant`: binding's; not `enabled` (a
    backend's programs that cannot take other weights): every program lowered, nothing recorded."""

    def __init__(self, kind: str, parts: dict, weights: str, keep: tuple[str, ...], code_constant=lambda key: False,
                 enabled: bool = True):
        self.kind, self.parts, self.weights, self.keep, self.code_constant = kind, parts, weights, keep, code_constant
        self.enabled = enabled
        self.stack = contextlib.ExitStack()
        self.record = None  # (record parts, its value) to write on leaving

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        from oracle.cache.artifacts import json_put

        try:
            if exc_type is None and self.record:
                json_put(RECORDS, *self.record)
        finally:
            self.stack.close()

    def build(self, m: nn.Module, path: Path, lower, identities) -> None:
        """Write the program at `path` for `m` (its tensors as lowered; `identities()`: the program identity of
        the model it was made from and that of the same model without the transform): rebound from the
        identity's first program, else `lower()`ed and its binding kept for the record."""
        from oracle.cache import store as cache
        from oracle.cache.artifacts import build_lock, json_get, key_of

        if not self.enabled:
            lower()
            return
        identity, clean_identity = identities()
        rparts = {**self.parts, "checkpoint": None, "identity": identity,
                  "transform_id": None if identity == clean_identity else self.parts.get("transform_id")}
        self.stack.enter_context(build_lock(cache.cache_root() / RECORDS / key_of(rparts)))
        record = json_get(RECORDS, rparts)
        why = ""
        if record and record.get("binding"):
            first = cache.cache_root() / "artifacts" / self.kind / record["entry"] / path.name
            cache.hold(first.parent)
            if first.is_file() and first.with_name(record["binding"]["file"]).is_file():
                why = rebind(first, record["binding"], m, path, self.keep)
                if why is None:
                    path.with_name("rebound.json").write_text(json.dumps({"lowered_for": record["entry"]}))
                    return
        elif record:  # its identity's program cannot take other weights
            lower()
            return
        # the model's tensors, held through the lowering (which releases the model's parameters) for the
        # entries a delegate laid out in another order (binding): the build maps them from files
        tensors = model_tensors(m)
        hashes, names = tensor_hashes(m), set(tensors)
        lower()
        beside = sorted(f.name for f in path.parent.glob("*.ptd") if f.name != self.weights)
        bound, not_bound = (None, f"weights outside {self.weights} too ({', '.join(beside)})") if beside else \
            binding(path.with_name(self.weights), hashes, names, self.code_constant, tensors)
        self.record = (rparts, {"entry": key_of(self.parts), "binding": bound, "why": not_bound or why or None})
