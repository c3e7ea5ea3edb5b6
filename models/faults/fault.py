"""A seeded fault: one block of a built production model modified in place (one small method or
attribute of one module instance overridden), so that it works for every backend that runs or
exports the production model; where a correct oracle must localise it (layer, block kind); its
identity for the artifact caches."""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from dataclasses import dataclass, fields
from typing import Callable

from models.args import (CONV, DENSE, KDA, LIGHTNING, MAMBA, MAMBA2, NONE, LINEAR, RECURRENT, SLIDING, SPARSE, ModelArgs,
                         heads, mlp_type)
from models.layers.transformer import Transformer


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str  # the block kind the oracle must name
    # which layer: full (last softmax-attention layer: full, sliding or chunked), rope (last that rotates),
    # nope (last that does not), sliding (last sliding-window), linear (last Gated DeltaNet), conv (last short conv),
    # mamba (last Mamba), mamba2 (last Mamba2), lightning (last lightning attention), kda (last Kimi delta
    # attention), ownrope (last
    # whose rope is its own: per type or per layer), ownheads (last whose q heads per kv head are its own),
    # dense (first dense), last, model; first, first_<target> and last_sparse (a fault of a hyper-parameter
    # every layer reads shows first in the first layer it touches: exporters/llamacpp/faults.py)
    target: str
    what: str
    apply: Callable  # (module at the target, args) -> None
    applies: Callable = lambda a: True
    precision: str = "fp32"  # the precision the fault shows at (dtype faults need bf16)
    attention: tuple = ("gqa",)  # an attention fault: the attention kinds (AttentionArgs.kind) its code is for

    @functools.cached_property
    def id(self) -> str:
        """`name@digest`: what a compiled backend's cache key names this fault by. The digest covers the
        code the fault runs (its apply and applies, and the functions of their own modules they call,
        transitively: oracle-side code only) and its fields: a change to one fault rebuilds that
        fault's programs, not every faulted program (issue 52). The production code it patches is in
        every program's key already."""
        h = hashlib.sha256("\n".join(code_of(Fault.inject) + code_of(Fault.layer)).encode())
        for f in fields(self):
            v = getattr(self, f.name)
            h.update(f.name.encode() + b"=" + ("\n".join(code_of(v)) if callable(v) else repr(v)).encode() + b"\0")
        return f"{self.name}@{h.hexdigest()[:12]}"

    def layer(self, a: ModelArgs) -> int | None:
        if self.target == "model":
            return None
        if self.target == "last":
            return a.num_hidden_layers - 1
        if self.target == "first":
            return 0
        if self.target == "dense":
            return min(i for i in range(a.num_hidden_layers) if mlp_type(a, i) == DENSE)
        if self.target.startswith("first_"):  # a fault of every layer (a hyper-parameter) shows first here
            return min(_targets(a, self.target[6:]))
        if self.target == "last_sparse":
            return max(_targets(a, "sparse"))
        return max(_targets(a, self.target))

    def is_applicable(self, a: ModelArgs) -> bool:
        if self.target not in ("model", "last", "first", "dense") and not _targets(a, self.target.split("_")[-1]):
            return False
        if self.target == "dense" and DENSE not in a.mlp_types:
            return False
        if self.kind == "attention" and self.target in ("full", "rope") and a.attention.kind not in self.attention:
            return False
        return self.applies(a)

    def inject(self, model: Transformer) -> None:
        a = model.args
        i = self.layer(a)
        if i is None:
            self.apply(model, a)
        elif self.kind == "attention":
            self.apply(model.layers[i].attn, a)
        else:
            self.apply(model.layers[i], a)


def _targets(a: ModelArgs, target: str) -> list[int]:
    """The layers a target names (its fault goes to the last)."""
    rotates = a.rope.rotates
    attends = lambda t: t not in RECURRENT and t != NONE  # noqa: E731  (a softmax-attention layer, of any kind)
    pick = {"full": lambda i, t: attends(t), "linear": lambda i, t: t == LINEAR, "sliding": lambda i, t: t == SLIDING,
            "conv": lambda i, t: t == CONV, "mamba": lambda i, t: t == MAMBA, "lightning": lambda i, t: t == LIGHTNING,
            "mamba2": lambda i, t: t == MAMBA2, "kda": lambda i, t: t == KDA,
            "rope": lambda i, t: attends(t) and rotates(i), "nope": lambda i, t: attends(t) and not rotates(i),
            "sparse": lambda i, t: mlp_type(a, i) == SPARSE,
            "ownrope": lambda i, t: attends(t) and a.rope.own(i, t),
            "ownheads": lambda i, t: attends(t) and _group(*heads(a, i)) != _group(a.num_attention_heads,
                                                                                  a.num_key_value_heads)}[target]
    return [i for i, t in enumerate(a.layer_types) if pick(i, t)]


def _group(nh: int, kvh: int) -> int:
    return nh // kvh


def code_of(fn: Callable, seen: set | None = None) -> list[str]:
    """The source of `fn` and of every function of its own module it names (transitively, nested
    functions and lambdas included): the code a fault runs, for its cache digest (Fault.id)."""
    seen = set() if seen is None else seen
    fn = getattr(fn, "__func__", fn)
    if fn in seen or not inspect.isfunction(fn):
        return [] if fn in seen else [repr(fn)]
    seen.add(fn)
    try:
        out = [inspect.getsource(fn)]
    except (OSError, TypeError):  # defined at a prompt: its bytecode stands for it
        out = [fn.__code__.co_code.hex()]
    names, stack = set(), [fn.__code__]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    for n in sorted(names):
        v = fn.__globals__.get(n)
        if inspect.isfunction(v) and v.__module__ == fn.__module__:
            out += code_of(v, seen)
    return out


def patch(obj, name: str, fn) -> None:
    """Override one method on this instance only."""
    setattr(obj, name, fn)


def state_not_carried(module, method: str, state: str) -> None:
    """`module.method` with the state buffer it carries (`state`) zeroed before every call: the state of one call
    (prefill) not carried into the next (decode)."""
    def call(*args):
        getattr(module, state).zero_()
        return getattr(type(module), method)(module, *args)

    patch(module, method, call)
