"""The backend contract: `Backend` and `Candidate` below, every member documented where it is
declared. The required ones (a backend's `name`, `availability` and `load`; a candidate's
`prefill`, `decode` and `run_block`) raise NotImplementedError; every optional one has its
default on the base class, so the harness reads `backend.member` and never probes.

Built-in backends are named (BUILTIN); a user's own is given as `package.module:attr` (a
`Backend`, or a class / factory making one). An object written against the older duck-typed
contract (the same member names, no base class) still works: `resolve` wraps it in an adapter
whose members are the object's where it has them and the defaults otherwise, and `as_candidate`
does the same for what its `load` returns. Arrays may be torch tensors or numpy arrays.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

BUILTIN = {
    "eager": "exporters.torch.eager:BACKEND",
    "hf": "exporters.torch.hf:BACKEND",
    "iree-llvm-cpu": "exporters.iree.backend:BACKEND",
    "mlx": "exporters.mlx.backend:BACKEND",
    "executorch": "exporters.executorch.backend:BACKEND",
    "executorch-cuda": "exporters.executorch.cuda:BACKEND",
    "cuda": "exporters.torch.cuda:BACKEND",
    "executorch-metal": "exporters.executorch.metal:BACKEND",
    "executorch-mlx": "exporters.executorch.mlx.backend:BACKEND",
    "llamacpp": "exporters.llamacpp.backend:BACKEND",
}


class InputError(ValueError):
    """Bad input (options, paths, checkpoint, lengths): the CLI prints the message and exits 2;
    nothing is written. Backends raise it for input they refuse."""


class MemoryRefusal(InputError):
    """A check refused because the memory it would need is not available here (memory_refusal)."""


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
    schema = {o.name: o for o in backend.option_schema}
    name = backend.name
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
    # the weight profile of the tiny / `config` checkpoint (oracle/source/trained.py): normal, or trained
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
    # the drill-down inside blocks (oracle/drill/points.py): "auto" the worst failing block of a failing
    # check, where the backend exposes its points; "all" every block; "off" none
    drill: str = "auto"
    # the invariance rows (oracle/verdict/invariance.py): "on" runs repeat, chunked and batched after e2e; "off" none
    invariance: str = "on"
    require_deterministic: bool = False  # the repeat row fails on any difference, not only beyond the limit


def hf_spec(spec: CheckSpec, precision: str | None = None) -> CheckSpec:
    """The spec of HF transformers on the same checkpoint and prompt (at `precision`, default the
    spec's): the reference's side of a measurement, without the candidate's options, shipped
    directory, given program, saved reference or prompt set."""
    return replace(spec, backend="hf", precision=precision or spec.precision, options={}, candidate_dir=None,
                   artifact=None, reference=None, prompts=None)


@dataclass
class ModelSource:
    """What a backend is given: the family, the checkpoint and the resolved production args."""

    family: Any  # models.Family
    model_dir: Path
    config: dict
    args: Any  # models.args.ModelArgs (max_seq_len set for this check)
    checkpoint_sha256: str
    parameters: int | None = None  # known without the checkpoint (a --config not built yet: --validate-only)

    def weights(self) -> dict:
        from models.checkpoint import read_weights

        return read_weights(self.model_dir)

    def parameter_count(self) -> int:
        """Parameters in the checkpoint (from the safetensors headers)."""
        from models.checkpoint import parameter_count

        return self.parameters if self.parameters is not None else parameter_count(self.model_dir)

    def layer_parameter_counts(self) -> tuple[int, int]:
        """(parameters of the largest decoder layer, parameters outside the layers), from the headers (or
        the config, for a checkpoint not built yet)."""
        from oracle.source.seeded import config_layer_parameter_counts
        from models.checkpoint import layer_parameter_counts

        if self.model_dir is None:
            return config_layer_parameter_counts(self.family, self.config)
        return layer_parameter_counts(self.model_dir)

    def build_production(self, dtype, mapped: Path | None = None):
        """The family's production torch model with the checkpoint's weights (`mapped`: a
        directory its weights are written to and mapped from: Family.build_from)."""
        return self.family.build_from(self.config, self.model_dir, dtype, self.args.max_seq_len, self.args, mapped)


class Candidate:
    """What `Backend.load` returns, run by the harness: override the three required methods and the optional ones that apply."""

    # provenance: the executor etc.; info["artifacts"]: a list of oracle.cache.artifacts.Artifact.as_dict()
    # (name, path, sha256, cached, build_s), info["host"]: host facts (e.g. the target CPU)
    info: dict = {}
    # how run_block's rows are fed: 'isolated' (the reference's inputs) or 'in-situ' (the candidate's
    # own upstream, oracle/verdict/insitu.py); block_modes: per kind, overriding block_mode
    block_mode: str = "isolated"
    block_modes: dict = {}
    # the on-device sampler (oracle/verdict/sampling.py, the `--sampling` rows); None: the candidate has none
    # and the sampling rows are skipped. sample_prefill(tokens, temperature, top_p, seed) -> token,
    # sample_decode(token, pos, temperature, top_p, seed) -> token; sample_logits(logits,
    # temperature, top_p, seed) -> token: the sampling head alone (None: the distribution is drawn
    # through sample_prefill)
    sample_prefill = None
    sample_decode = None
    sample_logits = None
    top_p_after_temperature: bool = True  # the sampler's order: top-p on the tempered distribution, or the untempered

    def prefill(self, tokens: list[int]):
        """Logits [T or 1, V] of a new sequence (state reset); the last row is the last token's."""
        raise NotImplementedError

    def decode(self, token: int, pos: int):
        """Logits [V] (or [1, V]) of one step, carrying the state of the previous calls."""
        raise NotImplementedError

    def ahead(self, ref, on_block=None, on_layer=None):
        """A generator computing its block rows and e2e steps one decoder layer at a time (yielding after each),
        which the harness runs in turn with HF's noise measurement before it asks for them (oracle/schedule.py:
        a streamed checkpoint's layer is then read once for all), calling on_block(key, outputs, routes per
        call) after each block and on_layer(layer, the steps' routes so far) after each layer's stage of the
        steps; None (the default): nothing ahead."""
        return None

    def teacher_forced(self, tokens: list[int], prompt_len: int, calls: int) -> tuple[list, list] | None:
        """Every e2e call at once where the tokens are known (the prefill of tokens[:prompt_len], then
        decode steps fed tokens[prompt_len:], `calls` in all): (each call's logits as prefill / decode
        return them, each call's routes as last_routes), for a candidate that runs another schedule than
        call by call (a streamed model layer by layer: each weight read once); None (the default): the
        harness calls prefill and decode."""
        return None

    def run_block(self, layer: int | None, kind: str, calls: list) -> list | None:
        """The block `kind` of `layer` on the reference's calls (oracle.reference.run.BlockCall: the
        input as numpy `x_array`, `pos_array`, and torch copies `x`, `pos`), one output per call,
        state carried from call to call and fresh at the first. Kinds: attention, router, moe, mlp
        (a dense layer's MLP), layer (per layer), final_norm, logits (layer None). router returns
        (weights [T, k], indices [T, k]); the others [1, T, H] (logits [1, T, V]). None: the kind
        cannot be isolated (its rows are 'n/a')."""
        raise NotImplementedError

    def block_input(self, layer: int, kind: str, calls: list) -> list | None:
        """An in-situ row's own input (block_mode 'in-situ'): what the candidate fed block `kind` of
        `layer` inside the layer (its norm's output) on the sequence's calls (those not `probe`),
        one [T, H] per call. With it, the row is judged against HF's block on that same input, and
        an error of the norm before the block stays in the layer's row; None: against HF's block
        on the candidate's layer input, through HF's own norm (oracle/verdict/insitu.py)."""
        return None

    def run_block_points(self, layer: int | None, kind: str, calls: list) -> dict | None:
        """The drill (oracle/drill/points.py): run_block on the same calls with the points inside the block
        recorded: point name (a submodule path as in HF's module, or one of oracle.drill.points.TAPS) ->
        its outputs, one per firing, in the order the points first fire. None: the backend exposes
        no points (the drill says so, with `no_points`)."""
        return None

    no_points = "the backend exposes no points inside its blocks"  # why run_block_points gives None (the drill's n/a)
    not_isolated: dict = {}  # (layer, kind) -> why run_block gives None for it (that row's n/a); else a generic reason
    # routing replay (oracle/verdict/replay.py, oracle/verdict/selection.py): what its routers and indexers chose
    no_routes = "the backend does not report which experts its routers selected"
    no_selections = "the backend does not report which keys its sparse attention's indexers selected"

    def last_routes(self) -> dict | None:
        """{layer: int indices [T, k]} its routers selected in its last prefill or decode call (T that call's
        tokens), or None where it does not report them (`no_routes` says why)."""
        return None

    def last_selections(self) -> dict | None:
        """{layer: key indices [T, k]} each sparse-attention indexer kept in its last prefill or decode call,
        or None where not reported (`no_selections` says why)."""
        return None

    def block_routes(self) -> list | None:
        """[{layer: indices [T, k]} per call] of its last run_block (a block with a router inside: the layer),
        or None where it does not report them."""
        return None

    # the invariance rows (oracle/verdict/invariance.py): what a serving engine runs other than one sequence
    # prefilled at once; without these, `chunked` runs the prompt token by token through decode alone
    # None where `extend` prefills a chunk after the first; else why not (the chunked row's n/a for that path)
    no_chunks: str | None = "the backend prefills a sequence from its start only (no chunk after a first)"
    no_batch = "the backend runs one sequence at a time"

    def extend(self, tokens: list[int], pos: int):
        """Logits [n or 1, V] of `tokens` appended to the current sequence at positions pos.. (its state
        carried): a prefill in chunks, after a prefill of the first. A backend that has it sets `no_chunks` to
        None; the default has none."""
        return None

    def batch(self, prompts: list[list[int]]):
        """The prefill of several new sequences in one batch, padded as the backend pads: ([logits [T_i or 1,
        V] per prompt], [{layer: indices [T_i, k]} per prompt] or None where routes are not reported). None
        (the default): the backend does not batch (`no_batch` says why)."""
        return None

    def gates(self) -> list:
        """The backend's own gate rows (oracle.reports.result.GateRow, e.g. cast counts); none by default."""
        return []

    def structures(self) -> dict[str, str]:
        """name -> canonical text of a lowered graph (an op or node histogram), compared byte-exact
        with goldens/<family>/<backend>/<name>.txt; none by default."""
        return {}

    def host_sampler(self, logits, temperature: float, top_p: float, seed: int) -> tuple:
        """The host implementation the sampler's seed schedule is judged against: (token, margin)."""
        from oracle.verdict.sampling import reference_sample  # oracle.verdict.sampling reads this module's types

        return reference_sample(logits, temperature, top_p, seed)


class Backend:
    """A backend: builds (or loads) a candidate for a checkpoint. Subclass it; set `name`, override
    `availability` and `load`, and whichever optional members apply. By convention torch-based
    backends take `transform` (a callable modifying the built production model: how seeded faults
    are injected) and `transform_id` (part of every artifact cache key); the harness never reads them."""

    name: str
    precisions: tuple[str, ...] | None = None  # the precisions it supports; None: every precision the harness knows
    option_schema: tuple = ()  # the only options it accepts (`Option`s): others are refused before any work
    runs_torch: bool = True  # False: it runs no torch (provenance records no torch thread count: never imported)
    # it loads a shipped directory as the candidate (--candidate-dir). With `export` writing one, its quantized
    # precisions (q8/q4) are checked on the directory it exports (built, cached), the candidate against HF on its
    # weights dequantized (CheckSpec.quant_reference)
    loads_directory: bool = False
    # the suffix of a program built elsewhere it runs (--pte .pte / --vmfb .vmfb / --gguf .gguf); None: refused
    artifact_suffix: str | None = None
    # artifact_weights(original: ModelSource, path: Path, progress) -> (dir, summary): a given artifact
    # that carries weights of its own (a GGUF, quantized or not): the HF checkpoint of those weights
    # dequantized (cached) and what its quantization is (summary: bits, types). The check then has the
    # two row sets of a shipped directory: the candidate against HF on those weights, and HF on them
    # against HF on the original. None: a given program carries the checkpoint's own weights
    artifact_weights = None
    # shipped_tensors(original: ModelSource, shipped: Path, progress) -> iterator of oracle.verdict.conversion.TensorSource:
    # the weight check of a shipped file (a --candidate-dir directory, a --gguf, a --pte's .ptd, a --vmfb's
    # .irpa): each of its tensors with the original brought into its layout by the format's own rules, to
    # be judged within the format's rounding (oracle/verdict/conversion.py). None: its files get no weight check
    shipped_tensors = None
    # `oracle selftest --conversion`: the shipped files it writes with `export` and checks, as
    # (label, precision, options) each; the conversion defects only a written file can have (name ->
    # what: a scale written for another group), injected by apply_file_fault
    shipped_formats: tuple = ()
    file_faults: dict = {}
    # the memory guard: peak bytes per checkpoint parameter its load/build needs, per precision (no
    # entry: no guard), and what is held then (see memory_estimate)
    memory_per_param: dict = {}
    memory_note: str = ""
    # the artifact cache's namespaces it builds into (artifacts/<ns>/: `oracle cache prune --backend`);
    # empty: its name
    cache_namespaces: tuple = ()
    # export(model: ModelSource, spec, output_dir: Path) -> list[Path]: write the artifacts for
    # `oracle export` (and the directory a q8/q4 check loads, with loads_directory); None: it cannot
    export = None
    # with_fault(fault) -> Backend | None: this backend with a seeded fault (models/faults/)
    # injected, None where the fault cannot be expressed on it; None here: `oracle selftest` refused
    with_fault = None
    # fault_catalogue(args) -> list of models.faults.fault.Fault: the backend's own faults for a model, in
    # place of models/faults/'s (a backend that runs no production model, e.g. llama.cpp's GGUF
    # faults); with args None, every fault it has (the names `--fault` may give); None: the catalogue's
    fault_catalogue = None
    # arithmetic(model, spec) -> str | None: the arithmetic it computes this checkpoint in where not the precision's
    # (an oracle/verdict/arithmetic.py name, e.g. a8), judged against HF computing so; None: the precision's own
    arithmetic = None

    def availability(self) -> tuple[bool, str]:
        """(True, "") or (False, "the exact reason, e.g. 'torch is a CPU build'"): the check is then skipped."""
        raise NotImplementedError

    def availability_for(self, spec: CheckSpec) -> tuple[bool, str]:
        """availability() for this check's options (e.g. `--option device=cuda` on a host without a GPU:
        skipped with the reason, as a backend this host lacks is). By default availability()."""
        return self.availability()

    def load(self, model: ModelSource, spec: CheckSpec) -> Candidate:
        """The candidate for this checkpoint and spec (export/lower/compile cached by content hash)."""
        raise NotImplementedError

    def check_options(self, spec: CheckSpec) -> str | None:
        """What is wrong with this combination of options on this host (`--device gpu` without one), or None."""
        return None

    def check_given(self, model: ModelSource, spec: CheckSpec) -> None:
        """Check the program given with --pte / --vmfb (its methods and signatures), raising
        InputError with the fix; nothing by default."""

    def memory_estimate(self, model: ModelSource, spec: CheckSpec) -> tuple[int | None, str]:
        """(peak bytes its load/build needs, how that is made up), or (None, "") for no guard. By
        default memory_per_param at this precision times the checkpoint's parameters; a backend
        whose peak follows the largest layer rather than the whole model overrides it."""
        per = (self.memory_per_param or {}).get(spec.precision)
        if per is None:
            return None, ""
        params = model.parameter_count()
        note = self.memory_note
        return int(params * per), f"{params / 1e9:.2f} B parameters x {per:g} bytes{f': {note}' if note else ''}"

    def fault_not_applicable(self, fault) -> str | None:
        """Why with_fault(fault) is None, for the selftest's list (None: 'not expressible on backend')."""
        return None

    def apply_file_fault(self, name: str, path: Path, original: ModelSource, args, progress) -> str | None:
        """Edit the shipped file at `path` (what `export` wrote for `original`) with the file fault `name`
        (file_faults); returns the format's name of the tensor edited, None where the fault has no form
        in this file (an F32 GGUF has no scales)."""
        return None

    def fault_point(self, fault) -> str | tuple | None:
        """The point inside its block that this backend's form of `fault` breaks, where it is not the
        catalogue's (models.faults.catalogue.POINTS): a fault whose form here edits a projection's weights breaks
        that projection. None: the catalogue's."""
        return None


# the members with a default: what an adapter takes from a duck-typed plugin where it has them
_OPTIONAL = {Backend: ("precisions", "option_schema", "runs_torch", "loads_directory", "artifact_suffix",
                       "memory_per_param", "memory_note", "export", "with_fault", "check_options", "artifact_weights",
                       "shipped_tensors", "shipped_formats", "file_faults", "apply_file_fault", "check_given", "memory_estimate", "fault_not_applicable", "fault_point",
                       "fault_catalogue", "availability_for", "cache_namespaces", "arithmetic"),
             Candidate: ("info", "block_mode", "block_modes", "sample_prefill", "sample_decode",
                         "sample_logits", "top_p_after_temperature", "gates", "structures", "host_sampler",
                         "block_input", "run_block_points", "no_points", "no_routes", "last_routes",
                         "no_selections", "last_selections", "block_routes", "ahead", "teacher_forced", "not_isolated",
                         "no_chunks", "no_batch", "extend", "batch")}


class _Duck:
    """An object written against the duck-typed contract, wrapped: the members declared with
    `_members` below are the object's where it has them and the base class's defaults otherwise;
    any other attribute is the object's."""

    def __init__(self, plugin):
        object.__setattr__(self, "plugin", plugin)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "plugin"), name)

    def __setattr__(self, name, value):
        setattr(self.plugin, name, value)

    def __repr__(self):
        return f"{type(self).__name__}({self.plugin!r})"


def _members(cls: type, base: type, names: tuple[str, ...]) -> type:
    def member(name):
        default = vars(base).get(name)  # (`name` has none: resolve requires it)

        def get(self):
            try:
                return getattr(self.plugin, name)
            except AttributeError:  # absent: the default (a method bound to the adapter)
                return default.__get__(self) if hasattr(default, "__get__") else default
        return property(get)

    for name in names:
        setattr(cls, name, member(name))
    return cls


class _DuckCandidate(_Duck, Candidate):
    pass


class _DuckBackend(_Duck, Backend):
    def load(self, model, spec):
        return as_candidate(self.plugin.load(model, spec))

    @property
    def with_fault(self):  # the faulted backend wrapped too
        with_fault = getattr(self.plugin, "with_fault", None)
        return None if with_fault is None else lambda fault: _optional_backend(with_fault(fault))


_members(_DuckCandidate, Candidate, ("prefill", "decode", "run_block") + _OPTIONAL[Candidate])
_members(_DuckBackend, Backend, ("name", "availability") + tuple(m for m in _OPTIONAL[Backend] if m != "with_fault"))


def as_candidate(obj) -> Candidate:
    """`obj` as a Candidate: itself, or a duck-typed candidate wrapped with the defaults."""
    return obj if isinstance(obj, Candidate) else _DuckCandidate(obj)


def as_backend(obj) -> Backend:
    """`obj` as a Backend: itself, or a duck-typed backend wrapped with the defaults."""
    return obj if isinstance(obj, Backend) else _DuckBackend(obj)


def implementation(backend: Backend) -> type:
    """The class whose source is the backend's code (part of a cache key): a duck-typed plugin's own."""
    return type(backend.plugin) if isinstance(backend, _DuckBackend) else type(backend)


def _optional_backend(obj):
    return None if obj is None else as_backend(obj)


def builtin_names() -> list[str]:
    return list(BUILTIN)


def builtin_source(name: str) -> Path:
    """The file of a built-in backend's module, found without importing it (its code is part of a cache
    key where what it computes is cached: HF's own error at a precision, oracle/verdict/noise.py)."""
    import importlib.util

    return Path(importlib.util.find_spec(BUILTIN[name].partition(":")[0]).origin)


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
    """A built-in backend by name, or `package.module:attr` for a plugin (a duck-typed one wrapped
    with the defaults: as_backend)."""
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
    return as_backend(obj)


# the memory a check needs and what the host has (oracle/memory.py), where callers have read them
from oracle.memory import BASE_MEMORY, GIB, available_memory, memory_plan, memory_refusal  # noqa: E402,F401
