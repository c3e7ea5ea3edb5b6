"""The backend protocol. A backend is any object with these members:

    name: str
    def availability(self) -> tuple[bool, str]:
        (True, "") or (False, "the exact reason, e.g. 'torch is a CPU build'")
    def load(self, model: ModelSource, spec: CheckSpec) -> Candidate

and a Candidate (what `load` returns) has:

    def prefill(self, tokens: list[int]) -> array [T or 1, V]
        logits of a new sequence (state reset); the last row is the last token's logits
    def decode(self, token: int, pos: int) -> array [V] (or [1, V])
        one step, carrying the state of the previous calls
    def run_block(self, layer: int | None, kind: str, calls: list[BlockCall]) -> list | None
        the block `kind` of `layer` on the reference's inputs, one output per call, state
        carried from call to call and fresh at the first; kinds: attention, router, moe,
        layer (per layer), final_norm, logits (layer None). router returns
        (weights [T, k], indices [T, k]); the others [1, T, H] (logits [1, T, V]).
        Return None for a kind the backend cannot isolate (the row is reported 'n/a').
    info: dict  (optional) executor etc. -> result provenance; info["artifacts"]: a list of
        oracle.artifacts.Artifact.as_dict() (name, path, sha256, cached, build_s)
    block_mode: str (optional) 'isolated' (default) or 'in-situ'
    gates(): list[GateRow] (optional) backend gates (e.g. cast counts)
    structures(): dict[str, str] (optional) name -> canonical text of a lowered graph (an op
        or node histogram), compared byte-exact with goldens/<family>/<backend>/<name>.txt
    sample_prefill / sample_decode / sample_logits, host_sampler, top_p_after_temperature
        (optional) an on-device sampler: see oracle/sampling.py (`--sampling` rows)

Optional backend members: `precisions` (tuple of the precisions it supports),
`option_schema` (a tuple of `Option`: the only options it accepts; none when absent; the
harness refuses unknown or ill-typed ones before any work), `check_options(spec) -> str | None`
(what is wrong with a combination of options on this host, e.g. `--device gpu` without one) and
`export(model, spec, output_dir) -> list[Path]` (for `oracle export`) and
`memory_per_param` (precision -> peak bytes per checkpoint parameter its load/build needs, with
`memory_note` saying what is held) or `memory_estimate(src, spec) -> (bytes, how)` (where the
peak follows the largest layer rather than the whole model); + BASE_MEMORY: a model that would not
fit in the available memory is refused with exit 2 and the estimate, instead of being killed
mid-build. A backend with `loads_directory` (it loads a shipped directory, --candidate-dir) and
`export` writing one checks its quantized precisions (q8/q4) on the directory it exports: the
harness builds it (cached), and judges the candidate against HF on its weights dequantized
(CheckSpec.quant_reference). Torch-based
backends take `transform` (a callable modifying the built production model, how seeded
faults are injected) and `transform_id` (part of every artifact cache key).

Arrays may be torch tensors or numpy arrays. A BlockCall (oracle/reference.py) holds its input
as numpy (`x_array`, `pos_array`) and gives torch copies as `x`, `pos`. `runs_torch = False`
(optional) says the candidate runs no torch: provenance then records no torch thread count, so
a warm check of such a backend never imports torch. Built-in backends are named; a user's own
is given as `package.module:attr` (an object as above, or a class / factory making one).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

BUILTIN = {
    "eager": "exporters.eager:BACKEND",
    "hf": "exporters.hf:BACKEND",
    "iree-llvm-cpu": "exporters.iree:BACKEND",
    "mlx": "exporters.mlx:BACKEND",
    "executorch": "exporters.executorch:BACKEND",
    "executorch-cuda": "exporters.executorch_cuda:BACKEND",
    "cuda": "exporters.cuda:BACKEND",
    "executorch-metal": "exporters.executorch_metal:BACKEND",
    "executorch-mlx": "exporters.executorch_mlx:BACKEND",
}


class InputError(ValueError):
    """Bad input (options, paths, checkpoint, lengths): the CLI prints the message and exits 2;
    nothing is written. Backends raise it for input they refuse."""


class BackendError(InputError):
    """Bad --backend value (unknown name, unimportable plugin, a protocol member missing)."""


@dataclass(frozen=True)
class Option:
    """One backend option: `--option name=VALUE`, or the CLI flag `flag` where it has one."""

    name: str
    type: type = str  # str | int | float | bool
    choices: tuple = ()  # allowed values (after conversion); empty: any value of the type
    default: Any = None  # what the backend does when the option is absent (documentation)
    help: str = ""
    flag: str | None = None  # e.g. "--group-size"
    commands: tuple[str, ...] = ("check", "export")  # the commands it applies to
    # it shapes the quantized weights `export` writes (group size, recipe): spent when the
    # harness builds the quantized directory, not passed on when the candidate loads it
    quantizes: bool = False

    def parse(self, value) -> Any:
        """The value converted to the option's type and checked against its choices."""
        if self.type is bool and isinstance(value, str):
            v = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False}.get(value.lower())
            if v is None:
                raise InputError(f"{self.spelling()}: expected true or false, got {value!r}")
        else:
            try:
                v = self.type(value)
            except (TypeError, ValueError):
                raise InputError(f"{self.spelling()}: expected {self.type.__name__}, got {value!r}") from None
            if self.type is int and v <= 0:
                raise InputError(f"{self.spelling()}: expected a positive integer, got {value!r}")
        if self.choices and v not in self.choices:
            given = f"{self.flag} {value}" if self.flag else f"--option {self.name}={value}"
            raise InputError(f"{given}: allowed values are {', '.join(map(str, self.choices))}")
        return v

    def spelling(self) -> str:
        return self.flag or f"--option {self.name}"

    def describe(self) -> str:
        values = "|".join(map(str, self.choices)) if self.choices else self.type.__name__.upper()
        if self.type is bool and self.flag:
            how = self.flag
        else:
            how = f"{self.flag} {values}" if self.flag else f"--option {self.name}={values}"
        default = "" if self.default is None else f" (default {self.default})"
        only = "" if set(self.commands) == {"check", "export"} else f" [{'/'.join(self.commands)} only]"
        return f"{how}{default}{only}: {self.help}"


# options the harness sets itself from its own flags (never a backend's): --sampling, --max-seq-len
HARNESS_OPTIONS = {"sampling": "check", "max_seq_len": "export"}


def validate_options(backend, options: dict, command: str = "check") -> dict:
    """`options` converted to each option's declared type; InputError for an option the
    backend does not declare, one that does not apply to `command`, or a bad value."""
    schema = {o.name: o for o in getattr(backend, "option_schema", ())}
    name = getattr(backend, "name", "?")
    out = {}
    for key, value in options.items():
        if key in HARNESS_OPTIONS:
            out[key] = value
            continue
        opt = schema.get(key)
        if opt is None:
            known = ", ".join(sorted(schema)) or "none (it takes no options)"
            flag = "--" + key.replace("_", "-")
            raise InputError(f"backend {name} has no option {key!r} ({flag} / --option {key}=...); known: {known}")
        if command not in opt.commands:
            raise InputError(f"backend {name}: {opt.spelling()} applies to `oracle {'/'.join(opt.commands)}`, "
                             f"not `oracle {command}`")
        try:
            out[key] = opt.parse(value)
        except InputError as e:
            raise InputError(f"backend {name}: {e}") from None
    return out


@dataclass(frozen=True)
class CheckSpec:
    family: str
    backend: str
    precision: str = "fp32"
    prompt_len: int = 8
    decode_tokens: int = 8
    seed: int = 0
    model_dir: str | None = None  # None: the family's tiny checkpoint for `seed` (or `config`'s)
    config: str | None = None  # a published config (models/configs/NAME.json): a seeded checkpoint of it
    layers: int | None = None  # with `config`: the depth cut to this many layers
    # the weight profile of the tiny / `config` checkpoint (models/trained.py): normal, or trained
    # (outlier dims, massive activations, spread norm gains, sharp routers and attention)
    weights: str = "normal"
    # a shipped (prequantized) artifact directory the backend loads as the candidate, instead of
    # building one from the checkpoint; the reference is then HF on its (dequantized) weights
    candidate_dir: str | None = None
    # q8/q4 on a backend that writes its quantized weights (`loads_directory` + `export`): the
    # candidate is judged against HF on those weights dequantized ("dequantized": the
    # implementation at fp32 limits, the quantization's own loss reported apart), or against HF on
    # the original weights by the quantized precision's fixed table ("original")
    quant_reference: str = "dequantized"
    reference: str | None = None  # a reference saved by `oracle reference save` (used for its checkpoint)
    # real text, tokenized with the checkpoint's own tokenizer (None: prompt_len random token ids)
    prompts: tuple[str, ...] | None = None
    artifact: str | None = None  # a program built elsewhere (--pte / --vmfb) for the backend to run, not build
    options: dict = field(default_factory=dict)  # backend-specific options


@dataclass
class ModelSource:
    """What a backend is given: the family, the checkpoint and the resolved production args."""

    family: Any  # models.Family
    model_dir: Path
    config: dict
    args: Any  # models.layers.ModelArgs (max_seq_len set for this check)
    checkpoint_sha256: str

    def weights(self) -> dict:
        from models.checkpoint import read_weights

        return read_weights(self.model_dir)

    def parameter_count(self) -> int:
        """Parameters in the checkpoint (from the safetensors headers)."""
        from models.checkpoint import parameter_count

        return parameter_count(self.model_dir)

    def build_production(self, dtype, mapped: Path | None = None):
        """The family's production torch model with the checkpoint's weights (`mapped`: a
        directory its weights are written to and mapped from: Family.build_from)."""
        return self.family.build_from(self.config, self.model_dir, dtype, self.args.max_seq_len, self.args, mapped)


class Candidate(Protocol):
    def prefill(self, tokens: list[int]): ...
    def decode(self, token: int, pos: int): ...
    def run_block(self, layer, kind: str, calls: list): ...


class Backend(Protocol):
    name: str

    def availability(self) -> tuple[bool, str]: ...
    def load(self, model: ModelSource, spec: CheckSpec) -> Candidate: ...


def builtin_names() -> list[str]:
    return list(BUILTIN)


def import_plugin(mod_name: str):
    """The module, found as `python -m` would find it: the installed packages, then the current
    directory (the `oracle` script does not put it on sys.path, so a plugin next to the user's
    checkout, e.g. examples.fp64_backend, would not import otherwise)."""
    import sys

    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        top = mod_name.split(".")[0]
        if e.name not in (top, mod_name) or "" in sys.path or str(Path.cwd()) in sys.path:
            raise
        sys.path.append(str(Path.cwd()))  # after the installed packages: never shadows them
        return importlib.import_module(mod_name)


def resolve(name: str) -> Backend:
    """A built-in backend by name, or `package.module:attr` for a plugin."""
    target = BUILTIN.get(name)
    if target is None:
        if ":" not in name:
            raise BackendError(
                f"unknown backend {name!r}; built-in: {', '.join(BUILTIN)}; "
                "or give a plugin as package.module:attr"
            )
        target = name
    mod_name, _, attr = target.partition(":")
    try:
        mod = import_plugin(mod_name)
    except Exception as e:  # ImportError, or the plugin module failing on import
        raise BackendError(f"backend {name!r}: cannot import module {mod_name!r}: {type(e).__name__}: {e}") from None
    obj = getattr(mod, attr, None)
    if obj is None:
        raise BackendError(f"backend {name!r}: module {mod_name!r} has no attribute {attr!r}")
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "load")):
        obj = obj()
    for member in ("name", "availability", "load"):
        if not hasattr(obj, member):
            raise BackendError(f"backend {name!r}: {target} has no {member!r} (see oracle/backend.py for the protocol)")
    return obj


GIB = 1 << 30
# what a check holds besides the backend's model: interpreter and imports (~0.6 GiB), the
# reference's captures, the runtime's own allocations (fits every measurement: docs/benchmarks.md)
BASE_MEMORY = 2 * GIB


def available_memory() -> int | None:
    """Bytes this process can still take: the kernel's MemAvailable, capped by a cgroup (v2 or
    v1) limit when there is one; None where neither can be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = int(Path(limit).read_text().strip()) - int(Path(usage).read_text().strip())
        except (OSError, ValueError):  # "max": no limit
            continue
        if cap < 1 << 60:
            avail = min(avail, max(cap, 0))
    return avail


def memory_refusal(backend, src: ModelSource, spec: CheckSpec) -> str | None:
    """Why this backend cannot hold this model here (its estimate of the peak bytes it needs,
    + BASE_MEMORY, above the available memory), or None. The estimate is the backend's
    `memory_estimate(src, spec)` -> (bytes, how it is made up) where it has one (a need that
    follows the largest layer, not the whole model), else its `memory_per_param` at this
    precision times the checkpoint's parameters. $MOE_ORACLE_MEMORY_CHECK=off skips it (e.g. with
    swap the kernel does not count)."""
    import os

    if os.environ.get("MOE_ORACLE_MEMORY_CHECK", "on") == "off":
        return None
    estimate = getattr(backend, "memory_estimate", None)
    if estimate is not None:
        need, how = estimate(src, spec)
        if need is None:
            return None
    else:
        per = (getattr(backend, "memory_per_param", None) or {}).get(spec.precision)
        if per is None:
            return None
        params = src.parameter_count()
        note = getattr(backend, "memory_note", "")
        need, how = int(params * per), f"{params / 1e9:.2f} B parameters x {per:g} bytes{f': {note}' if note else ''}"
    need += BASE_MEMORY
    avail = available_memory()
    if avail is None or need <= avail:
        return None
    return (f"{spec.backend} --precision {spec.precision} would need about {need / GIB:.1f} GiB for this "
            f"checkpoint ({how}, + {BASE_MEMORY / GIB:g} GiB) and {avail / GIB:.1f} GiB is available: use a machine "
            f"with more memory, a lower precision, or --layers N to check a cut of the model "
            f"(MOE_ORACLE_MEMORY_CHECK=off to try anyway)")
