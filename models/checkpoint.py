"""HF checkpoints on disk: strict reading, tiny deterministic checkpoints, weight loading.

A checkpoint is an HF `save_pretrained` directory: config.json + model.safetensors or
sharded `model-*.safetensors` with `model.safetensors.index.json`. Pickle formats
(.bin/.pt) are refused: loading them runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors import safe_open

from models import cache
from models.cache import cache_root  # noqa: F401  (where the harness has always imported it from)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TINY_STD = 0.1  # large enough that router top-k and final argmax are not near ties
TINY_FORMAT = 2  # bump when the tiny-weight recipe changes (invalidates the cache)


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message says which file or tensor and why."""


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def temp_dir(parent: Path, prefix: str | None = None) -> Path:
    """A new directory in `parent` to build in and rename into place, with the permissions
    mkdir gives (the umask's), not mkdtemp's 0700: a cache or output another user shares
    stays readable. The default prefix names the writer (models/cache.temp_prefix)."""
    d = Path(tempfile.mkdtemp(prefix=cache.temp_prefix() if prefix is None else prefix, dir=parent))
    os.chmod(d, 0o777 & ~_umask())
    return d


def temp_file(parent: Path, prefix: str = ".tmp-", suffix: str = "") -> tuple[int, str]:
    """mkstemp in `parent` (fd, path), with the permissions open() gives (the umask's), not 0600."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=parent)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, path


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
             "U32": "uint32"}  # U32: quantized weights packed as words (models/quantized.py)


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
    return out


def parameter_count(model_dir: Path) -> int:
    """Elements in every tensor of a checkpoint, from the safetensors headers only."""
    return sum(math.prod(shape) for _, _, shape in tensor_index(model_dir).values())


LAYER = re.compile(r"\.layers\.(\d+)\.")  # a decoder layer's tensor names: ...layers.N....


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


def read_tensors(index: dict, names: list[str]) -> dict:
    """These tensors of a checkpoint (`index`: tensor_index of it), each read once from its
    shard's memory map."""
    by_shard: dict = {}
    for n in names:
        by_shard.setdefault(index[n][0], []).append(n)
    out = {}
    for shard, ns in by_shard.items():
        with open_shard(shard) as f:
            for n in ns:
                out[n] = f.get_tensor(n)
    return out


def read_weights(model_dir: Path) -> dict:
    """All tensors of a checkpoint; truncated/corrupt shards and index mismatches are errors."""
    index = tensor_index(model_dir)
    return read_tensors(index, list(index))


# bit patterns of a non-finite value (exponent all ones) per floating dtype: (uint view, mask)
_NONFINITE_BITS = {"F64": (np.uint64, 0x7FF0000000000000), "F32": (np.uint32, 0x7F800000),
                   "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80),
                   "F8_E4M3": (np.uint8, 0x7F), "F8_E5M2": (np.uint8, 0x7C)}
_CHUNK = 64 << 20  # bytes read at a time (a multiple of every element size)


def _scan_file(path: Path, h) -> list[tuple[str, int]]:
    """Feed the file's bytes to `h` in order, one pass, and count the non-finite values of
    every floating tensor on the way: [(tensor name, count)] of the bad ones."""
    bad = []
    with open(path, "rb") as f:
        if path.suffix != ".safetensors":
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
            return bad
        head = f.read(8)
        n = int.from_bytes(head, "little")
        header_bytes = f.read(n)
        h.update(head)
        h.update(header_bytes)
        header = json.loads(header_bytes)
        header.pop("__metadata__", None)
        pos = 0  # relative to the data section
        for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = t["data_offsets"]
            if begin > pos:
                h.update(f.read(begin - pos))
            view = _NONFINITE_BITS.get(t["dtype"])
            count = 0
            for start in range(begin, end, _CHUNK):
                chunk = f.read(min(_CHUNK, end - start))
                h.update(chunk)
                if view is not None:
                    bits = np.frombuffer(chunk, dtype=view[0])
                    count += int(np.count_nonzero((bits & view[1]) == view[1]))
            pos = max(pos, end)
            if count:
                bad.append((name, count))
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return bad


def _identity_stamp(model_dir: Path) -> tuple[list[Path], list, Path]:
    """The files of a checkpoint's identity, their (name, size, mtime) and the cache entry."""
    files = [model_dir / "config.json", *shard_files(model_dir)]
    stamp = []
    for p in files:
        try:
            st = p.stat()
            stamp.append([p.name, st.st_size, st.st_mtime_ns])
        except OSError as e:
            raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
    entry = cache_root() / "identities" / (hashlib.sha256(str(model_dir).encode()).hexdigest()[:24] + ".json")
    return files, stamp, entry


def cached_identity(model_dir: Path) -> str | None:
    """The checkpoint's sha256 from the identity cache when no file changed (path, size, mtime),
    else None: reads no tensor data."""
    _, stamp, entry = _identity_stamp(Path(model_dir).resolve())
    return _identity_entry(entry, stamp)


def _identity_entry(entry: Path, stamp: list) -> str | None:
    try:
        doc = json.loads(entry.read_text())
        return doc["sha256"] if doc.get("files") == stamp else None
    except (OSError, ValueError, KeyError):
        return None


def checkpoint_identity(model_dir: Path) -> str:
    """The checkpoint's sha256 (config.json and the weight files, names and bytes), computed
    in one streamed pass that also checks every floating tensor for NaN/Inf (a non-finite
    weight is an error naming the tensor: the checkpoint is bad, not the backend).

    Cached like git's index: keyed by each file's path, size and mtime, so a second check of
    an unchanged directory reads no tensor data."""
    model_dir = Path(model_dir).resolve()
    files, stamp, entry = _identity_stamp(model_dir)
    known = _identity_entry(entry, stamp)
    if known:
        return known
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        try:
            bad = _scan_file(p, h)
        except PermissionError as e:
            raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{p}: truncated or corrupt file ({type(e).__name__}: {e})") from None
        if bad:
            name, count = bad[0]
            more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
            raise CheckpointError(f"checkpoint tensor {name} in {p.name} has {count} NaN/Inf value(s){more}: "
                                  "the checkpoint is bad, no backend can be judged on it")
    digest = h.hexdigest()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_file(entry.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"dir": str(model_dir), "files": stamp, "sha256": digest}) + "\n")
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache: the identity is recomputed next time
    return digest


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


def _draw(name: str, shape, gen, std: dict | None = None):
    """One tiny weight, N(0, TINY_STD) (or the family's `tiny_std` for names ending so), except
    the Gated DeltaNet decay parameters: drawn so the recurrent state is remembered across tokens
    (per-token decay 0.85-0.98); a decay near 0 would hide a state that is not carried."""
    import torch

    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.05, 0.5, generator=gen).log()
    sd = next((v for k, v in (std or {}).items() if name.endswith(k)), TINY_STD)
    noise = torch.randn(shape, generator=gen) * sd
    if name.endswith("dt_bias"):
        return noise - 1.0
    return noise


def write_tiny_checkpoint(hf_config, hf_class, seed: int, out: Path, std: dict | None = None,
                          rewrite=None) -> None:
    """Instantiate the HF model and overwrite every tensor deterministically from `seed`.
    Norm weights keep the identity HF initialises them to (1 for w * x, 0 for (1 + w) * x)
    plus the noise. `rewrite` (a weight profile's, models.trained): applied to the state dict
    before it is saved."""
    import torch

    torch.manual_seed(seed)
    model = hf_class(hf_config)
    gen = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    with torch.no_grad():
        for name in sorted(sd):
            t = sd[name]
            if not torch.is_floating_point(t):
                continue
            w = _draw(name, t.shape, gen, std)
            if "norm" in name and name.endswith("weight"):
                w = w + t.mean()  # HF's identity init: all ones or all zeros
            t.copy_(w)
    if rewrite is not None:
        rewrite(sd)
    model.save_pretrained(out, safe_serialization=True)


def tiny_checkpoint(family, seed: int, weights: str = "normal") -> Path:
    """The family's tiny checkpoint for `seed` and weight profile (models.trained.PROFILES),
    built once into a content-addressed cache dir."""
    from importlib.metadata import version

    from models.trained import profile_rewrite, profile_recipe

    rewrite = profile_rewrite(family, family.tiny_config, weights, seed)
    recipe = {
        "family": family.name,
        "config": family.tiny_config,
        "seed": seed,
        "std": TINY_STD,
        **({"tiny_std": family.tiny_std} if family.tiny_std else {}),
        "format": TINY_FORMAT,
        "transformers": version("transformers"),
        **profile_recipe(weights),
    }
    stem = f"{family.name}-s{seed}" + ("" if weights == "normal" else f"-{weights}")
    return cached_dir(recipe, stem, "oracle_tiny.json",
                      lambda out: write_tiny_checkpoint(family.hf_config(family.tiny_config), family.hf_class(),
                                                        seed, out, family.tiny_std, rewrite))


# ------------------------------------------------------------------ real configs, seeded
CONFIGS_DIR = Path(__file__).with_name("configs")
SHARD_BYTES = 5 * 10**9  # the 5 GB shards the published checkpoints use


def config_names() -> list[str]:
    """The published configs shipped in models/configs/ (by lower-cased repository name)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def known_configs() -> str:
    """The published configs for a message; where none are found, where they were looked for
    (an empty list would hide an install that lacks its package data)."""
    return ", ".join(config_names()) or f"none (no *.json in {CONFIGS_DIR})"


def published_config(name: str, layers: int | None = None) -> dict:
    """models/configs/<name>.json (or a config.json path of your own), with the depth cut to
    `layers` when given. A cut keeps the pattern's last `layers` entries of `layer_types` (a
    hybrid model keeps both kinds)."""
    path = Path(name) if name.endswith(".json") else CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        raise CheckpointError(f"--config {name}: no such published config (or .json file); "
                              f"known: {known_configs()}")
    cfg = read_config_file(path)
    if layers is not None:
        text = cfg.get("text_config", cfg)
        if layers > text["num_hidden_layers"]:
            raise CheckpointError(f"--layers {layers}: {name} has {text['num_hidden_layers']} layers")
        text["num_hidden_layers"] = layers
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][-layers:]
    return cfg


def write_seeded_checkpoint(family, cfg: dict, seed: int, out: Path, dtype=None,
                            shard_bytes: int = SHARD_BYTES, progress=None, rewrite=None) -> None:
    """A checkpoint of `cfg`'s shapes with weights from HF's own initialisation (normal with the
    config's initializer_range, norms at identity), seeded, written as save_pretrained writes
    it (HF's reverse weight conversion: per-expert names; sharded with an index), one decoder
    layer at a time: peak memory is one layer in fp32, not the model. dtype: torch's (default bf16).
    `rewrite` (a weight profile's, models.trained): applied to each layer's (and the modules outside
    the layers') fp32 state dict before it is stored."""
    import torch
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    dtype = dtype or torch.bfloat16
    hf_cfg = family.hf_config(cfg)
    with torch.device("meta"):
        model = family.hf_class()(hf_cfg)
    torch.manual_seed(seed)
    decoder = model.get_decoder()
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    groups = [(f"{prefix}.layers.{i}.", layer) for i, layer in enumerate(decoder.layers)]
    shards, pending, size = [], {}, 0

    def flush():
        nonlocal pending, size
        if pending:
            path = out / f".shard-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            shards.append((path, sorted(pending)))
            pending, size = {}, 0

    def add(module, name_prefix):
        nonlocal size
        module.to_empty(device="cpu")
        for sub in module.modules():
            model._init_weights(sub)
        sd = {name_prefix + k: v for k, v in module.state_dict().items()}
        if rewrite is not None:
            rewrite(sd)
        for k, v in revert_weight_conversion(model, sd).items():
            t = v.to(dtype) if v.is_floating_point() else v
            pending[k] = t.contiguous()
            size += t.numel() * t.element_size()
        module.to("meta")  # freed
        if size >= shard_bytes:
            flush()

    for n, (name_prefix, layer) in enumerate(groups):
        if progress:
            progress(f"layer {n + 1}/{len(groups)}")
        add(layer, name_prefix)
    # then the modules outside the decoder layers (embeddings, final norm, head), initialised the
    # same way; a tied head is not written (as save_pretrained does)
    done = {id(layer) for _, layer in groups}
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    for name, _ in list(model.named_parameters(remove_duplicate=False)):
        mod_name = name.rpartition(".")[0]
        mod = model.get_submodule(mod_name)
        if any(name.startswith(g) for g, _ in groups) or id(mod) in done:
            continue
        done.add(id(mod))
        if tied and mod is model.get_output_embeddings():
            continue
        add(mod, mod_name + ".")
    flush()
    total = len(shards)
    weight_map = {}
    for i, (path, names) in enumerate(shards):
        final = out / (f"model-{i + 1:05d}-of-{total:05d}.safetensors" if total > 1 else "model.safetensors")
        os.replace(path, final)
        weight_map.update({k: final.name for k in names})
    if total > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def config_checkpoint(family, name: str, layers: int | None, seed: int, dtype: str = "bf16",
                      progress=None, weights: str = "normal", build: bool = True) -> Path | None:
    """The seeded checkpoint of a published config (--config NAME [--layers N]) and weight profile
    (models.trained.PROFILES), built once into the content-addressed cache (`build` False: None where
    it is not built yet, nothing written: --validate-only)."""
    from importlib.metadata import version

    from models.trained import profile_recipe, profile_rewrite

    cfg = published_config(name, layers)
    rewrite = profile_rewrite(family, cfg, weights, seed)
    name = Path(name).stem if name.endswith(".json") else name
    recipe = {"family": family.name, "config": cfg, "seed": seed, "dtype": dtype, "format": TINY_FORMAT,
              "transformers": version("transformers"), **profile_recipe(weights)}
    stored = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[dtype]
    profile = "" if weights == "normal" else f"-{weights}"
    return cached_dir(recipe, f"{name}-L{layers or 'all'}-s{seed}-{dtype}{profile}", "oracle_seeded.json",
                      lambda out: write_seeded_checkpoint(family, cfg, seed, out, torch_dtype(stored),
                                                          progress=progress, rewrite=rewrite),
                      needed=lambda: config_parameters(family, cfg) * {"bf16": 2, "fp16": 2, "fp32": 4}[dtype],
                      build_it=build)


def meta_model(family, cfg: dict):
    """A config's HF model on the meta device (no memory): its parameters' names and shapes."""
    import torch

    with torch.device("meta"):
        return family.hf_class()(family.hf_config(cfg))


def config_parameters(family, cfg: dict) -> int:
    """Parameters of a config's HF model."""
    return sum(p.numel() for p in meta_model(family, cfg).parameters())


def config_layer_parameter_counts(family, cfg: dict) -> tuple[int, int]:
    """layer_parameter_counts of a config's HF model, before any checkpoint is written."""
    return split_by_layer((f".{name}", p.numel()) for name, p in meta_model(family, cfg).named_parameters())


def cached_dir(recipe: dict, stem: str, recipe_file: str, build, needed=None, build_it: bool = True) -> Path | None:
    """cache_root()/checkpoints/<stem>-<hash of recipe>: built once by `build(dir)` into a temp
    dir and renamed into place (a crash leaves nothing; a concurrent identical build wins; a killed
    one leaves a directory models/cache.remove_stale_temps removes). `needed` (bytes, or a function
    giving them): its size, refused before it is built where it cannot fit in the cache
    (models/cache.py). `build_it` False: None where it is not built."""
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:20]
    final = cache_root() / "checkpoints" / f"{stem}-{key}"
    if (final / "config.json").is_file():
        cache.hold(final)  # never evicted while this process runs
        cache.mark_used(final)
        return final
    if not build_it:
        return None
    cache.hold(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if needed is not None:
        cache.make_room(needed() if callable(needed) else needed, f"the checkpoint {stem}")
    tmp = temp_dir(final.parent)
    try:
        build(tmp)
        (tmp / recipe_file).write_text(json.dumps(recipe, indent=1, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cache.mark_used(final)
    cache.enforce_quietly(final)
    return final
