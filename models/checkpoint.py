"""HF checkpoints on disk: strict reading, the experts' layouts, weight loading into the production model.

A checkpoint is an HF `save_pretrained` directory: config.json + model.safetensors or
sharded `model-*.safetensors` with `model.safetensors.index.json`. Pickle formats
(.bin/.pt) are refused: loading them runs arbitrary code.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from safetensors import safe_open

from models import moved
from models.errors import CheckpointError  # noqa: F401  raised here; the families and exporters import it from here

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"--model-dir {model_dir}: not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected an HF save_pretrained directory)")
    return read_config_file(path)


def read_config_file(path: Path) -> dict:
    """A config.json: valid JSON, an object with a model_type."""
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    if "model_type" not in cfg:
        raise CheckpointError(f"{path}: no 'model_type' key")
    if not isinstance(cfg["model_type"], str):
        raise CheckpointError(f"{path}: model_type must be a string, got {cfg['model_type']!r:.60}")
    text = cfg.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CheckpointError(f"{path}: text_config must be an object, got {type(text).__name__}")
    return cfg


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a checkpoint, validated against the index if there is one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(index_weight_map(index).values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        # no index but the names say how many there are (model-00001-of-00004): a partial download
        numbered = [m for p in shards if (m := re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", p.name))]
        if numbered:
            stem, width, total = numbered[0].group(1), len(numbered[0].group(2)), int(numbered[0].group(3))
            want = [f"{stem}-{i:0{width}d}-of-{total:0{width}d}.safetensors" for i in range(1, total + 1)]
            missing = [n for n in want if not (model_dir / n).is_file()]
            if missing:
                raise CheckpointError(f"{model_dir}: shard(s) missing: {', '.join(missing)} "
                                      "(and no model.safetensors.index.json)")
        return shards
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{model_dir}: only pickle weights ({', '.join(pickles)}); refused, safetensors only "
            "(pickles run arbitrary code on load). Convert with transformers: "
            "AutoModelForCausalLM.from_pretrained(d).save_pretrained(out, safe_serialization=True)"
        )
    raise CheckpointError(f"{model_dir}: no *.safetensors weights found")


def index_weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map: tensor name -> the name of a shard beside it."""
    try:
        doc = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{index}: unreadable index ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: unreadable index (no \"weight_map\" of tensor names to shard files)")
    odd = [v for v in weight_map.values() if Path(v).name != v or not v.endswith(".safetensors")]
    if odd:  # a path elsewhere ("../x", "/etc/passwd") is never read
        raise CheckpointError(f"{index}: shard {odd[0]!r} is not the name of a .safetensors file beside it")
    return weight_map


# safetensors dtype names -> torch dtypes, by name (the ones a checkpoint can hold)
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "U32": "uint32"}  # U32: quantized weights packed as words (oracle/source/quantized.py)


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (tensor_index's)."""
    import torch

    return getattr(torch, ST_DTYPES[name])


def open_shard(shard: Path, framework: str = "pt"):
    """safe_open with the checkpoint's own error for every way a shard can be unreadable
    (framework "numpy": the headers without importing torch)."""
    try:
        open(shard, "rb").close()  # safetensors reports a permission problem as a missing file
        return safe_open(str(shard), framework=framework)
    except OSError as e:
        raise CheckpointError(f"{shard}: cannot read ({e.strerror})") from None
    except Exception as e:  # safetensors raises its own error types for bad headers / short files
        raise CheckpointError(f"{shard}: truncated or corrupt safetensors file ({e})") from None


def tensor_index(model_dir: Path) -> dict[str, tuple[Path, str, tuple]]:
    """name -> (shard, safetensors dtype name, shape) of every tensor, from the safetensors
    headers only (no tensor data is read; torch_dtype() converts the dtype). Truncated or corrupt
    shards, a name in two shards, and an index that lists a tensor no shard has are errors."""
    model_dir = Path(model_dir)
    out: dict[str, tuple[Path, str, tuple]] = {}
    for shard in shard_files(model_dir):
        with open_shard(shard, "numpy") as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"tensor {name} is in two shards: {out[name][0].name} and {shard.name}")
                sl = f.get_slice(name)
                if sl.get_dtype() not in ST_DTYPES:
                    raise CheckpointError(f"{shard.name}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                out[name] = (shard, sl.get_dtype(), tuple(sl.get_shape()))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        listed = set(index_weight_map(index))
        absent = sorted(listed - set(out))
        if absent:
            raise CheckpointError(f"{index}: {len(absent)} tensor(s) listed but not in any shard, e.g. {absent[0]}")
    return released(model_dir, out)


class ReleaseIndex(dict):
    """tensor_index of a checkpoint released in a quantized format (models/release_formats.py): the tensors
    the file defines, under HF's names with their dequantized dtype and shape; `parts` says where each packed
    one's parts are (role -> raw name), `raw` is the files' own index, `format` the release's. read_tensors
    dequantizes as it reads."""

    def __init__(self, entries: dict, format, parts: dict, raw: dict):
        super().__init__(entries)
        self.format, self.parts, self.raw = format, parts, raw


def released(model_dir: Path, raw: dict) -> dict:
    """`raw` (the files' index), or the checkpoint a quantized release defines where config.json declares one
    (its quantization_config's quant_method), checked from the headers."""
    from models.release_formats import release_format, released_index

    path = Path(model_dir) / "config.json"
    fmt = release_format(read_config_file(path)) if path.is_file() else None
    if fmt is None:
        return raw
    r = released_index(raw, fmt)
    return ReleaseIndex(r.entries, fmt, r.parts, raw)


def entry_bytes(entry) -> int:
    """Bytes of a tensor_index entry (shard, safetensors dtype, shape)."""
    return math.prod(entry[2]) * torch_dtype(entry[1]).itemsize


def stored_bytes(index: dict, name: str) -> int:
    """Bytes the files hold for tensor `name` of `index` (a released tensor's: its packed parts)."""
    parts = getattr(index, "parts", {}).get(name)
    return sum(entry_bytes(index.raw[p]) for p in parts.values()) if parts else entry_bytes(index[name])


def parameter_count(model_dir: Path) -> int:
    """Elements in every tensor of a checkpoint, from the safetensors headers only."""
    return sum(math.prod(shape) for _, _, shape in tensor_index(model_dir).values())


# a decoder layer's tensor names: ...layers.N.... (DBRX's release: transformer.blocks.N....)
LAYER = re.compile(r"(?:\.layers|^transformer\.blocks)\.(\d+)\.")


def layer_parameter_counts(model_dir: Path) -> tuple[int, int]:
    """(elements of the largest decoder layer, elements outside the decoder layers: embedding,
    final norm, head), from the safetensors headers only."""
    return split_by_layer((name, math.prod(shape)) for name, (_, _, shape) in tensor_index(model_dir).items())


def split_by_layer(sizes) -> tuple[int, int]:
    """(the largest decoder layer's total, the total outside the layers) of (name, size) pairs."""
    layers, outside = {}, 0
    for name, size in sizes:
        m = LAYER.search(name)
        if m:
            layers[m.group(1)] = layers.get(m.group(1), 0) + size
        else:
            outside += size
    return max(layers.values(), default=0), outside


def meta_weights(model_dir: Path) -> dict:
    """Every tensor of a checkpoint as a meta tensor (name, shape, dtype; no data): what a
    family's sanitize() and the strict name/shape check need, at no memory cost."""
    import torch

    return {name: torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
            for name, (_, dtype, shape) in tensor_index(model_dir).items()}


def layer_groups(index: dict) -> list[list[str]]:
    """Tensor names grouped by decoder layer (`...layers.N.`), then everything else (embeddings,
    final norm, head: kept together, a tied head needs the embedding). Each group is what a
    family's sanitize() needs at once (a layer's experts are stacked together)."""
    groups: dict = {}
    for name in index:
        m = LAYER.search(name)
        groups.setdefault(int(m.group(1)) if m else -1, []).append(name)
    return [sorted(groups[k]) for k in sorted(groups, key=lambda k: (k < 0, k))]


def read_tensors(index: dict, names: list[str], rows: list[int] | None = None) -> dict:
    """These tensors of a checkpoint (`index`: tensor_index of it), each read once from its
    shard's memory map (a released one's parts read and dequantized: models/release_formats.py).
    `rows`: only these indices of each tensor's first dimension (stacked experts: the chosen ones), in order."""
    import torch

    released = getattr(index, "parts", None)
    wanted = {n: (released[n] if released is not None and n in released else {None: n}) for n in names}
    raw = index.raw if released is not None else index
    by_shard: dict = {}
    for parts in wanted.values():
        for p in parts.values():
            by_shard.setdefault(raw[p][0], []).append(p)
    got = {}
    for shard, ns in by_shard.items():
        with open_shard(shard) as f:
            for n in ns:
                if rows is None:
                    got[n] = f.get_tensor(n)
                else:
                    part = f.get_slice(n)
                    got[n] = torch.stack([part[r] for r in rows])
    if released is None:
        return got
    from models.release_formats import dequantize

    return {n: got[parts[None]] if None in parts else dequantize(index.format, {r: got.pop(p) for r, p in parts.items()})
            for n, parts in wanted.items()}


def read_weights(model_dir: Path) -> dict:
    """All tensors of a checkpoint; truncated/corrupt shards and index mismatches are errors."""
    index = tensor_index(model_dir)
    return read_tensors(index, list(index))


def stack_experts(weights: dict, pattern: str, names: tuple[str, str, str]) -> dict:
    """Per-expert tensors -> stacked `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I].

    `pattern` is a regex with groups (prefix, expert, proj) matching a per-expert key, e.g.
    r"(.*\\.mlp\\.experts)\\.(\\d+)\\.(gate_proj|up_proj|down_proj)\\.weight"; `names` are the
    (gate, up, down) projection names used by the checkpoint. Fused keys pass through.
    """
    rx = re.compile(pattern)
    out, groups = {}, {}
    for key, t in weights.items():
        m = rx.fullmatch(key)
        if m is None:
            out[key] = t
        else:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    gate, up, down = names
    if groups:
        import torch
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        for e in range(n):
            for p in names:
                if (e, p) not in parts:
                    raise CheckpointError(f"missing tensor {prefix}.{e}.{p}.weight (experts 0..{n - 1} expected)")
                # checked here: torch.stack would promote an integer tensor or fail without a name
                t, first = parts[e, p], parts[0, p]
                if not torch.is_floating_point(t):
                    raise CheckpointError(f"tensor {prefix}.{e}.{p}.weight has dtype {t.dtype}, expected a floating-point tensor")
                if t.shape != first.shape:
                    raise CheckpointError(f"the experts' shapes differ: {prefix}.{e}.{p}.weight is {tuple(t.shape)}, "
                                          f"{prefix}.0.{p}.weight is {tuple(first.shape)}")
        if parts[0, gate].shape != parts[0, up].shape:
            raise CheckpointError(f"the gate and up projections' shapes differ: {prefix}.0.{up}.weight is "
                                  f"{tuple(parts[0, up].shape)}, {prefix}.0.{gate}.weight is {tuple(parts[0, gate].shape)}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, gate], parts[e, up]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, down] for e in range(n)])
    return out


PER_EXPERT = r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"


def stack_hf_experts(weights: dict) -> dict:
    """The per-expert layout transformers' save_pretrained writes, stacked."""
    return stack_experts(weights, PER_EXPERT, ("gate_proj", "up_proj", "down_proj"))


def validate_state(model, weights: dict) -> None:
    """Every parameter of `model` present in `weights` with its shape, nothing unexpected;
    each problem is an error naming the tensor. Works on a meta-device model."""
    import torch

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing:
        raise CheckpointError(f"missing tensor(s): {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor(s) (a feature this family does not implement?): "
            f"{', '.join(unexpected[:6])}{' ...' if len(unexpected) > 6 else ''}"
        )
    for name, p in params.items():
        t = weights[name]
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if not torch.is_floating_point(t):
            raise CheckpointError(f"tensor {name} has dtype {t.dtype}, expected a floating-point tensor")


def load_state(model, weights: dict, dtype) -> None:
    """Copy `weights` into `model`'s parameters, strictly (see validate_state), in `dtype` (or
    fp32 where the model keeps a parameter in fp32: models.args.stored_dtype). State buffers are not
    loaded."""
    import torch

    from models.args import stored_dtype

    validate_state(model, weights)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = weights[name].detach().to(stored_dtype(model.args, name, dtype)).clone()


# mlx-lm names -> HF names
SWITCH = re.compile(r"(.*)\.(?:switch_mlp|experts)\.(gate_proj|up_proj|down_proj|fc1|fc2)\.weight")


def unstack_experts(weights: dict, names: dict | None = None) -> dict:
    """mlx-lm's stacked experts `P.switch_mlp.{gate,up,down}_proj.weight` [E, out, in] (dots1's:
    `P.experts.*`; Nemotron-H's ungated `P.switch_mlp.{fc1,fc2}.weight`) -> HF's per-expert
    `P.experts.{e}.<name>.weight` (names: mlx projection -> HF name)."""
    out = {}
    for k, v in weights.items():
        m = SWITCH.fullmatch(k)
        if m is None or v.ndim != 3:
            out[k] = v
            continue
        for e in range(v.shape[0]):
            out[f"{m[1]}.experts.{e}.{(names or {}).get(m[2], m[2])}.weight"] = v[e]
    return out


def conv1d_from_mlx(weights: dict) -> dict:
    """mlx-lm's depthwise conv1d kernels [C, K, 1] (its sanitize moves HF's axis) -> HF's [C, 1, K]."""
    return {k: v.moveaxis(2, 1) if k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[-1] == 1 else v
            for k, v in weights.items()}


# the seeded checkpoints, the identity and the cache's files were here before 2026-12 (oracle/source/,
# oracle/cache/): their old names for one release
__getattr__ = moved.forward("models.checkpoint")
