"""HF checkpoints on disk: strict reading, tiny deterministic checkpoints, weight loading.

A checkpoint is an HF `save_pretrained` directory: config.json + model.safetensors or
sharded `model-*.safetensors` with `model.safetensors.index.json`. Pickle formats
(.bin/.pt) are refused: loading them runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TINY_STD = 0.1  # large enough that router top-k and final argmax are not near ties
TINY_FORMAT = 2  # bump when the tiny-weight recipe changes (invalidates the cache)


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message says which file or tensor and why."""


def cache_root() -> Path:
    return Path(os.environ.get("MOE_ORACLE_CACHE", Path.home() / ".cache" / "moe-oracle"))


def read_config(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"--model-dir {model_dir}: not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected an HF save_pretrained directory)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise CheckpointError(f"{path}: no 'model_type' key")
    return cfg


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a checkpoint, validated against the index if there is one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{model_dir}: only pickle weights ({', '.join(pickles)}); refused, safetensors only "
            "(pickles run arbitrary code on load). Convert with transformers: "
            "AutoModelForCausalLM.from_pretrained(d).save_pretrained(out, safe_serialization=True)"
        )
    raise CheckpointError(f"{model_dir}: no *.safetensors weights found")


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint; truncated/corrupt shards and index mismatches are errors."""
    model_dir = Path(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for shard in shard_files(model_dir):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for bad headers / short files
            raise CheckpointError(f"{shard}: truncated or corrupt safetensors file ({e})") from None
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        listed = set(json.loads(index.read_text())["weight_map"])
        absent = sorted(listed - set(weights))
        if absent:
            raise CheckpointError(f"{index}: {len(absent)} tensor(s) listed but not in any shard, e.g. {absent[0]}")
    return weights


def dir_digest(model_dir: Path) -> str:
    """sha256 over config.json and the weight files (names + bytes): the checkpoint's identity."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    for p in [model_dir / "config.json", *shard_files(model_dir)]:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


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
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        for e in range(n):
            for p in names:
                if (e, p) not in parts:
                    raise CheckpointError(f"missing tensor {prefix}.{e}.{p}.weight (experts 0..{n - 1} expected)")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, gate], parts[e, up]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, down] for e in range(n)])
    return out


PER_EXPERT = r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"


def stack_hf_experts(weights: dict) -> dict:
    """The per-expert layout transformers' save_pretrained writes, stacked."""
    return stack_experts(weights, PER_EXPERT, ("gate_proj", "up_proj", "down_proj"))


def validate_state(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every parameter of `model` present in `weights` with its shape, nothing unexpected;
    each problem is an error naming the tensor. Works on a meta-device model."""
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


def load_state(model: nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Copy `weights` into `model`'s parameters, strictly (see validate_state). State
    buffers are not loaded."""
    validate_state(model, weights)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = weights[name].detach().to(dtype).clone()


def _draw(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """One tiny weight, N(0, TINY_STD), except the Gated DeltaNet decay parameters: drawn
    so the recurrent state is remembered across tokens (per-token decay 0.85-0.98); a
    decay near 0 would hide a state that is not carried."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.05, 0.5, generator=gen).log()
    noise = torch.randn(shape, generator=gen) * TINY_STD
    if name.endswith("dt_bias"):
        return noise - 1.0
    return noise


def write_tiny_checkpoint(hf_config, hf_class, seed: int, out: Path) -> None:
    """Instantiate the HF model and overwrite every tensor deterministically from `seed`.
    Norm weights keep the identity HF initialises them to (1 for w * x, 0 for (1 + w) * x)
    plus the noise."""
    torch.manual_seed(seed)
    model = hf_class(hf_config)
    gen = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    with torch.no_grad():
        for name in sorted(sd):
            t = sd[name]
            if not torch.is_floating_point(t):
                continue
            w = _draw(name, t.shape, gen)
            if "norm" in name and name.endswith("weight"):
                w = w + t.mean()  # HF's identity init: all ones or all zeros
            t.copy_(w)
    model.save_pretrained(out, safe_serialization=True)


def tiny_checkpoint(family, seed: int) -> Path:
    """The family's tiny checkpoint for `seed`, built once into a content-addressed cache dir."""
    import transformers

    recipe = {
        "family": family.name,
        "config": family.tiny_config,
        "seed": seed,
        "std": TINY_STD,
        "format": TINY_FORMAT,
        "transformers": transformers.__version__,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:20]
    final = cache_root() / "checkpoints" / f"{family.name}-s{seed}-{key}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        cfg = family.hf_config(family.tiny_config)
        write_tiny_checkpoint(cfg, family.hf_class(), seed, tmp)
        (tmp / "oracle_tiny.json").write_text(json.dumps(recipe, indent=1, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
