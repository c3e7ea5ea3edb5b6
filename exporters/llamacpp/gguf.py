"""A GGUF as shipped (`oracle check --backend llamacpp --gguf FILE --model-dir ORIGINAL`): its weights
as an HF checkpoint, for the two row sets of a shipped artifact (implementation: llama.cpp against HF
on the GGUF's own weights; quantization: HF on those weights against HF on the original).

Where each GGUF element comes from is learned from llama.cpp's converter itself, never written here
per family: the converter is run on the original checkpoint's tensor shapes with every element
replaced by its own index (two runs: the low and the high bits, each exact in float32), and what it
writes says, for every element of every GGUF tensor, which HF element it moved there (its
permutations of q/k rows, expert stacking, gate/up splits and fusions). The map is kept run-length
encoded (a row or more per run) and checked on the original: the f32 GGUF of the original, pulled
back through the map, must give the original HF tensors bit for bit. A GGUF tensor whose values the
converter transforms (a norm stored as 1 + w, -exp(A_log)) has no such map; it must then hold exactly
what the original's f32 conversion holds (llama-quantize keeps those tensors in F32), else the file is
refused with the tensor's name.

Refused before any row (exit 2): a GGUF of another architecture than the original converts to, a
hyper-parameter (a `<arch>.*` key) that differs from or is missing against the original's conversion
(the key named), a tensor missing, extra, or of another shape.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from exporters.llamacpp.setup import converter_dir, gguf_module
from oracle.backend import InputError
from oracle.cache.artifacts import sha256_file

FORMAT = 1  # bump when the map's or the dequantized checkpoint's recipe changes
LOW = 1 << 22  # each probe's values lie in [LOW, 2 * LOW): exact in float32, and a transform shows
BLOCK = re.compile(r"^blk\.(\d+)\.")


# ---------------------------------------------------------------- the element map (child process)

def _probe_main(model_dir: str, out: str) -> None:
    """In the child: llama.cpp's converter run twice on index-valued tensors of the checkpoint's
    shapes; writes `out` (npz): per GGUF tensor its run starts and first indices, or nothing where
    its values are not indices (a value transform)."""
    import logging

    d = converter_dir()
    sys.path[:0] = [str(d), str(d / "gguf-py")]
    logging.basicConfig(level=logging.ERROR)
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    from models.checkpoint import ReleaseIndex, tensor_index

    hparams = ModelBase.load_hparams(Path(model_dir), False)
    cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    release = tensor_index(Path(model_dir))  # a checkpoint in a released quantized format: what it defines
    release = release if isinstance(release, ReleaseIndex) else None
    if getattr(cls, "supports_mtp_export", False):
        cls.no_mtp = True

    def runs(a: np.ndarray, step: int):
        """(run starts, the value at each start) of a probe's flat values, runs where they go up by
        `step`; None where they are not whole numbers in [LOW, 2 LOW) (not an index: transformed)."""
        if a.dtype != np.float32:
            return None
        f = a.reshape(-1).astype(np.float64)
        if not (np.all((f >= LOW) & (f < 2 * LOW)) and np.all(f == np.floor(f))):
            return None
        v = f.astype(np.int64) - LOW
        starts = np.concatenate([[0], np.flatnonzero(np.diff(v) != step) + 1]).astype(np.int64)
        return starts, v[starts]

    def run(part: str):
        """The converter on index-valued tensors (`part`: the index's low or high bits): per GGUF tensor
        its shape and runs (one tensor in memory at a time: each is run-length encoded as written)."""
        model = cls(Path(model_dir), gguf.LlamaFileType.ALL_F32, Path(out).with_suffix(".unused"), eager=True)
        if release is not None:  # the converter's plain path on the tensors the release defines (its packed
            # path writes the same GGUF tensors, of packed values: the map is of where each value goes)
            model._is_mxfp4 = model._is_nvfp4 = False
            model.hparams.pop("quantization_config", None)
            names, shapes = sorted(release), {n: tuple(release[n][2]) for n in release}
        else:
            names = sorted(model.model_tensors)
            shapes = {n: tuple(model.model_tensors[n]().shape) for n in names}
        offset, offsets = 0, {}
        for n in names:
            offsets[n] = offset
            offset += int(np.prod(shapes[n], dtype=np.int64))

        def ids(n):
            i = torch.arange(offsets[n], offsets[n] + int(np.prod(shapes[n], dtype=np.int64)), dtype=torch.int64)
            v = (i % LOW if part == "lo" else i // LOW) + LOW
            return v.to(torch.float32).reshape(shapes[n])

        model.model_tensors = {n: (lambda n=n: ids(n)) for n in names}
        got = {}

        def capture(name, data, raw_dtype=None, **kw):
            got[name] = (tuple(np.shape(data)), runs(np.asarray(data), 1 if part == "lo" else 0))

        model.gguf_writer.add_tensor = capture
        with torch.inference_mode():
            model.prepare_tensors()
        return got, names, shapes, offsets

    lo, names, shapes, offsets = run("lo")
    hi, *_ = run("hi")
    total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values())
    arrays = {"hf_names": np.array(names), "hf_offsets": np.array([offsets[n] for n in names], np.int64),
              "hf_shapes": np.array(json.dumps({n: list(shapes[n]) for n in names}))}
    for name, (shape, lo_runs) in lo.items():
        hi_shape, hi_runs = hi.get(name, (None, None))
        if lo_runs is None or hi_runs is None or hi_shape != shape:
            continue  # not an index: the converter transforms these values
        n = int(np.prod(shape, dtype=np.int64))
        # a run of the index: where neither the low bits' run (+1 a step) nor the high bits' (constant) breaks
        starts = np.union1d(lo_runs[0], hi_runs[0]).astype(np.int64)
        lo_at = lo_runs[1][np.searchsorted(lo_runs[0], starts, side="right") - 1] + (
            starts - lo_runs[0][np.searchsorted(lo_runs[0], starts, side="right") - 1])
        hi_at = hi_runs[1][np.searchsorted(hi_runs[0], starts, side="right") - 1]
        first = hi_at * LOW + lo_at
        lengths = np.diff(np.append(starts, n))
        order = np.argsort(first, kind="stable")  # an index, each element at most once: runs do not overlap
        if (first + lengths).max(initial=0) > total or np.any(first[order][1:] < (first + lengths)[order][:-1]):
            continue
        arrays[f"starts:{name}"] = starts
        arrays[f"ids:{name}"] = first
        arrays[f"shape:{name}"] = np.array(shape, np.int64)
    np.savez(out, **arrays)


class ElementMap:
    """Where each element of each GGUF tensor comes from in the HF checkpoint (see the module)."""

    def __init__(self, path: Path):
        z = np.load(path)
        self.hf_names = [str(n) for n in z["hf_names"]]
        self.hf_offsets = z["hf_offsets"]
        self.hf_shapes = {k: tuple(v) for k, v in json.loads(str(z["hf_shapes"])).items()}
        self.runs = {k.split(":", 1)[1]: (z[k], z["ids:" + k.split(":", 1)[1]], tuple(z["shape:" + k.split(":", 1)[1]]))
                     for k in z.files if k.startswith("starts:")}

    def named_as(self, checkpoint_names) -> "ElementMap":
        """The map with the HF tensors under the checkpoint's own names: the converter reads some under
        another spelling (ERNIE's `moe_statics.e_score_correction_bias` as `...e_score_correction.bias`),
        matched where they differ only in '.' against '_' (a name with no such unique match stays)."""
        names = set(checkpoint_names)
        spelled = {}
        for n in names:
            spelled.setdefault(n.replace("_", "."), []).append(n)

        def own(n):
            match = spelled.get(n.replace("_", "."), [])
            return n if n in names or len(match) != 1 else match[0]

        self.hf_names = [own(n) for n in self.hf_names]
        self.hf_shapes = {own(k): v for k, v in self.hf_shapes.items()}
        return self

    def sources(self, name: str) -> list[tuple[int, int, str, int]]:
        """(gguf start, length, HF tensor, its flat start) pieces of GGUF tensor `name`: its runs cut at
        the HF tensors' boundaries."""
        starts, ids, shape = self.runs[name]
        n = int(np.prod(shape, dtype=np.int64))
        ends = np.append(starts[1:], n)
        out = []
        for s, e, i in zip(starts.tolist(), ends.tolist(), ids.tolist()):
            while s < e:
                t = int(np.searchsorted(self.hf_offsets, i, side="right") - 1)
                hf = self.hf_names[t]
                size = int(np.prod(self.hf_shapes[hf], dtype=np.int64))
                local = i - int(self.hf_offsets[t])
                take = min(e - s, size - local)
                out.append((s, take, hf, local))
                s, i = s + take, i + take
        return out


def element_map(original, converter_version: str) -> ElementMap:
    """The cached map of the original checkpoint (by its identity, the converter's version and this code)."""
    from models.checkpoint import tensor_index
    from oracle.cache.artifacts import cached_artifact

    code = sha256_file(Path(__file__))
    parts = {"checkpoint": original.checkpoint_sha256, "converter": converter_version, "code": code, "format": FORMAT}

    def build(path: Path):
        r = subprocess.run([sys.executable, "-m", "exporters.llamacpp.gguf", "probe", str(original.model_dir),
                            str(path)], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"]
            raise InputError(f"llama.cpp's converter could not map this checkpoint's tensors: {tail[0]}")

    art = cached_artifact("llamacpp-map", parts, "map.npz", build)
    return ElementMap(Path(art.path)).named_as(tensor_index(Path(original.model_dir)))


# ---------------------------------------------------------------- reading and checking a GGUF

def reader(path: Path):
    gguf = gguf_module()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: its reason
        raise InputError(f"--gguf {path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def arch_of(reader, where: str = "the GGUF") -> str:
    f = reader.fields.get("general.architecture")
    if f is None:
        raise InputError(f"{where}: no general.architecture key (not a model GGUF)")
    return str(f.contents())


def _hparams(reader, arch: str) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(arch + ".")}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and np.isclose(a, b, rtol=1e-6, atol=0)
    return a == b


def ne(t) -> tuple:
    """A GGUF tensor's dimensions (ggml's ne, fastest first) without trailing 1s: ggml pads every tensor to four
    dimensions of which the trailing ones are 1, and writers differ in how many they keep (llama-quantize writes
    a [64, 1] f32 vector as [64])."""
    dims = [int(x) for x in t.shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def check_matches(shipped, reference, path: Path) -> None:
    """InputError where the shipped GGUF is not the reference conversion's model: another
    architecture, a hyper-parameter that differs or is missing (named), a tensor missing, extra or of
    another shape."""
    arch, want = arch_of(shipped, f"--gguf {path}"), arch_of(reference, "the original's conversion")
    if arch != want:
        raise InputError(f"--gguf {path} is a GGUF of architecture {arch!r}; the original checkpoint converts to "
                         f"{want!r} (llama.cpp's converter): another model")
    mine, ref = _hparams(shipped, arch), _hparams(reference, arch)
    for k in sorted(set(mine) | set(ref)):
        if k not in mine:
            raise InputError(f"--gguf {path}: hyper-parameter {k} is missing (the original's conversion has {ref[k]!r})")
        if k not in ref:
            raise InputError(f"--gguf {path}: hyper-parameter {k} = {mine[k]!r} is not in the original's conversion "
                             "(another converter's model, or a hand-edited file)")
        if not _same(mine[k], ref[k]):
            raise InputError(f"--gguf {path}: hyper-parameter {k} = {mine[k]!r}, but the original checkpoint's "
                             f"config gives {ref[k]!r}")
    a = {t.name: ne(t) for t in shipped.tensors}
    b = {t.name: ne(t) for t in reference.tensors}
    for name in sorted(set(a) | set(b)):
        if name not in a:
            raise InputError(f"--gguf {path}: tensor {name} is missing (the original's conversion has it, shape {list(b[name])})")
        if name not in b:
            raise InputError(f"--gguf {path}: tensor {name} is not a tensor of the original's conversion")
        if a[name] != b[name]:
            raise InputError(f"--gguf {path}: tensor {name} has shape {list(a[name])}; the original's is {list(b[name])}")


def bits_of(type_name: str) -> int:
    """The bits per weight a GGML type is named for (Q4_K: 4, IQ3_S: 3, BF16: 16, F32: 32)."""
    m = re.match(r"^(?:I?Q|TQ)(\d)", type_name)
    if m:
        return int(m.group(1))
    return {"F32": 32, "F16": 16, "BF16": 16, "F64": 64, "MXFP4": 4}.get(type_name, 32)


def values(t) -> np.ndarray:
    """A GGUF tensor's values as float32 in numpy order (dequantized by gguf-py's own dequantizer)."""
    gguf = gguf_module()
    q = gguf.GGMLQuantizationType(t.tensor_type)
    if q == gguf.GGMLQuantizationType.F32:
        return np.asarray(t.data, np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
    return gguf.quants.dequantize(t.data, q).astype(np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))


# ---------------------------------------------------------------- the HF checkpoint of a GGUF

def dequantized_gguf(family, original, path: Path, reference_gguf: Path, converter_version: str,
                     progress=None) -> tuple[Path, dict]:
    """(the cached HF checkpoint of the GGUF's weights, dequantized to fp32, with the original's
    config.json; the quantization summary). `reference_gguf`: the original converted at f32 by the same
    converter (what the GGUF must match in architecture, keys and tensors)."""
    from models.checkpoint import read_tensors, tensor_index
    from oracle.cache.files import cached_dir

    path = Path(path)
    if not path.is_file():
        raise InputError(f"--gguf {path}: no such file")
    shipped, reference = reader(path), reader(reference_gguf)
    check_matches(shipped, reference, path)
    gguf = gguf_module()
    types = {}
    for t in shipped.tensors:
        name = gguf.GGMLQuantizationType(t.tensor_type).name
        types[name] = types.get(name, 0) + 1
    ftype = shipped.fields.get("general.file_type")
    try:
        kind = gguf.LlamaFileType(int(ftype.contents())).name.removeprefix("MOSTLY_") if ftype else "file type unset"
    except ValueError:
        kind = f"file type {ftype.contents()}"
    summary = {"format": "GGUF", "kind": kind, "tensor_types": dict(sorted(types.items())),
               "modules": {k: n for k, n in sorted(types.items()) if bits_of(k) < 16},
               "file_type": None if ftype is None else int(ftype.contents()),
               "bits": sorted({bits_of(n) for n in types if bits_of(n) < 16}) or [16],
               "dequantizer": "gguf-py (llama.cpp's converter's copy) quants.dequantize"}
    # llama.cpp rounds the activations of a weight product to the weight's dot-product type: 8 bits for the
    # quantized types, bf16 / fp16 for BF16 / F16 weights (oracle/verdict/arithmetic.py): the implementation is
    # judged against HF with that arithmetic (the coarsest the file has)
    if any(bits_of(n) < 16 for n in types):
        summary["activations"] = "a8"
    elif "BF16" in types or "F16" in types:
        summary["activations"] = "abf16" if "BF16" in types else "af16"
    recipe = {"gguf_sha256": sha256_file(path), "original_sha256": original.checkpoint_sha256, "format": FORMAT,
              "code": sha256_file(Path(__file__)), "converter": converter_version,
              "family": family.name}

    def build(out: Path):
        import torch
        from safetensors.torch import save_file

        emap = element_map(original, converter_version)
        index = tensor_index(Path(original.model_dir))
        ref_tensors = {t.name: t for t in reference.tensors}
        groups: dict = {}
        for t in shipped.tensors:
            m = BLOCK.match(t.name)
            groups.setdefault(int(m.group(1)) if m else -1, []).append(t)
        order = sorted(groups, key=lambda k: (k < 0, k))
        weight_map, changed_tensors = {}, 0
        for gi, key in enumerate(order):
            if progress:
                progress(f"dequantizing the GGUF's {'layer ' + str(key) if key >= 0 else 'embeddings and head'} "
                         f"({gi + 1}/{len(order)})")
            hf: dict[str, np.ndarray] = {}
            originals: dict[str, np.ndarray] = {}
            for t in groups[key]:
                new = values(t)
                old = values(ref_tensors[t.name])
                if np.array_equal(new, old):
                    continue  # the original's values: its HF sources stay as they are
                if t.name not in emap.runs:
                    raise InputError(f"--gguf {path}: tensor {t.name} differs from the original's conversion, and "
                                     "llama.cpp's converter transforms its values (not only their layout): its HF "
                                     "weights cannot be recovered")
                pieces = emap.sources(t.name)
                for name in {p[2] for p in pieces} - set(hf):
                    if name in weight_map:
                        raise InputError(f"--gguf {path}: HF tensor {name} is spread over GGUF tensors of two "
                                         "layers: not a layout this reader maps back")
                    originals[name] = read_tensors(index, [name])[name].float().numpy().reshape(-1)
                    hf[name] = originals[name].copy()
                flat_new, flat_old = new.reshape(-1), old.reshape(-1)
                for s, n, name, local in pieces:
                    # the map checked on the original: its f32 conversion pulled back is the original, bit for bit
                    if not np.array_equal(flat_old[s:s + n], originals[name][local:local + n]):
                        raise InputError(f"--gguf {path}: tensor {t.name}: the converter's element map does not "
                                         f"reproduce {name} from the original's conversion; refusing to guess")
                    hf[name][local:local + n] = flat_new[s:s + n]
                changed_tensors += 1
            if hf:
                shard = f"model-{gi + 1:05d}-of-{len(order):05d}.safetensors"
                save_file({k: torch.from_numpy(v.reshape(emap.hf_shapes[k])).contiguous() for k, v in hf.items()},
                          str(out / shard), metadata={"format": "pt"})
                weight_map.update({k: shard for k in hf})
        rest = [n for n in index if n not in weight_map]
        for i in range(0, len(rest), 64):  # every tensor the GGUF leaves as the original's: copied
            part = read_tensors(index, rest[i:i + 64])
            shard = f"model-original-{i // 64:05d}.safetensors"
            save_file({k: v.float().contiguous() for k, v in part.items()}, str(out / shard), metadata={"format": "pt"})
            weight_map.update({k: shard for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
        (out / "config.json").write_text(json.dumps(original.config, indent=1, sort_keys=True))
        info = {**summary, "tensors_changed": changed_tensors}
        (out / "oracle_quantization.json").write_text(json.dumps(info, indent=1, sort_keys=True))

    out = cached_dir(recipe, f"gguf-{family.name}", "oracle_dequantized.json", build)
    return out, json.loads((out / "oracle_quantization.json").read_text())


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        _probe_main(*sys.argv[2:4])
    else:
        print("usage: python -m exporters.llamacpp.gguf probe MODEL_DIR OUT.npz", file=sys.stderr)
        sys.exit(2)
