"""Programs brought with --pte / --vmfb: checked before a runtime of this process sees them.

A native runtime trusts the file it reads. ExecuTorch 1.5.1 aborts the whole process on 4 KiB
of random bytes (its log line of the bad file identifier is not UTF-8, and the C++ exception
pybind11 raises for it ends in std::terminate); IREE's verifier refuses such bytes with an
error, but a program compiled for another CPU loads and runs until it meets an instruction this
one lacks (SIGILL). So a given program is:

1. read as bytes: the container's identifier and the sizes its header declares (a truncated
   file says so), and for IREE the llvm-cpu target it was compiled for, against this host's;
2. loaded once by its runtime in a child process (`python -m exporters.shared.given KIND FILE...`),
   where an abort is an exit status: it prints what it found (methods and constants, or
   functions) as one JSON line, or the runtime's own error;
3. compared, by the backend, with what the check needs (exporters/executorch/, iree.py).

Every refusal is an InputError naming the file: exit 2, never the end of the run. And since a
program that passes all of that can still crash its runtime when it runs, `oracle check` of a
given program runs in a child process itself (oracle/source/given.py): a crash there is exit 2 too.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from oracle.backend import InputError
from oracle.source.given import runtime_log

ROOT = Path(__file__).resolve().parents[2]
LOAD_TIMEOUT_S = 900  # the child's load of the program (a large one maps and plans gigabytes)

# ExecuTorch: a flatbuffer whose identifier is at bytes 4..8, then (optionally) an extended header
# that declares the sizes: (magic, its length, then little-endian u64 fields)
PTE_ID, PTE_HEADER = b"ET12", b"eh00"  # program.fbs file_identifier; exir/_serialize/_program.py
PTD_ID, PTD_HEADER = b"FT01", b"FH01"  # flat_tensor.fbs; extension/flat_tensor/serialize/serialize.py


def _u64(data: bytes, at: int) -> int:
    return int.from_bytes(data[at:at + 8], "little")


def pte_problem(pte: Path) -> str | None:
    """What is wrong with the bytes of an ExecuTorch program (.pte), or None."""
    head, size = _head(pte), pte.stat().st_size
    if len(head) < 8 or head[4:8] != PTE_ID:
        return f"not an ExecuTorch program (file identifier {head[4:8]!r}, expected {PTE_ID!r})"
    if head[8:12] == PTE_HEADER and len(head) >= 32:
        program, base, segments = _u64(head, 16), _u64(head, 24), _u64(head, 32) if len(head) >= 40 else 0
        need = max(program, base + segments if base else 0)
        if size < need:
            return f"truncated or corrupt: its header declares {need} bytes, the file has {size}"
    return None


def ptd_problem(ptd: Path) -> str | None:
    """What is wrong with the bytes of an ExecuTorch weights file (.ptd), or None."""
    head, size = _head(ptd), ptd.stat().st_size
    if len(head) < 48 or head[4:8] != PTD_ID or head[8:12] != PTD_HEADER:
        return f"not an ExecuTorch tensor data file (identifier {head[4:12]!r}, expected {PTD_ID + PTD_HEADER!r})"
    flatbuffer, base = _u64(head, 16) + _u64(head, 24), _u64(head, 32)
    need = max(flatbuffer, base + _u64(head, 40))
    if size < need:
        return f"truncated or corrupt: its header declares {need} bytes, the file has {size}"
    return None


# IREE: model.vmfb is a zip archive whose first entry, module.fb, is the bytecode module (a
# size-prefixed flatbuffer, identifier "IREE"), or that flatbuffer alone
VMFB_ID = b"IREE"


def vmfb_problem(vmfb: Path) -> str | None:
    """What is wrong with the first bytes of an IREE module (.vmfb), or None (the runtime's
    verifier checks the rest, in the child)."""
    head = _head(vmfb)
    if head[:4] == b"PK\x03\x04" and len(head) >= 30:  # the zip's local header: name, extra field, data
        start = 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
        if head[start + 8:start + 12] == VMFB_ID:
            return None
    elif VMFB_ID in (head[4:8], head[8:12]):
        return None
    return "not an IREE module (no IREE bytecode module at its start)"


# `#hal.executable.target<"llvm-cpu", "embedded-elf-x86_64", {cpu = "znver4", cpu_features = "+avx,..."`:
# how iree-compile records an llvm-cpu target in the module (in the text of the message it gives
# when no device matches), the same text for the host's own target
LLVM_TARGET = re.compile(rb'"llvm-cpu", "([\w-]+)", \{cpu = "([^"]*)", cpu_features = "([^"]*)"')
FEATURE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # an LLVM CPU or feature name (avx512vnni, x86-64-v3)


def llvm_cpu_targets(data, signs: str = "+") -> list[tuple[str, str, frozenset]]:
    """(format, cpu, the features it enables) of each llvm-cpu target named in a module's bytes (signs "+-":
    every feature it names, enabled or disabled: LLVM's host record names each feature it knows)."""
    found = set()
    for m in LLVM_TARGET.finditer(data):
        fmt, cpu, features = (g.decode("utf-8", "replace") for g in m.groups())  # (a damaged file: any bytes)
        found.add((fmt, cpu, frozenset(f[1:] for f in features.split(",") if f[:1] and f[0] in signs)))
        del m  # no view of the caller's mmap left behind
    return sorted(found, key=str)


_TRIVIAL = """func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.addf %a, %a : tensor<4xf32>
  return %0 : tensor<4xf32>
}"""


def host_llvm_target(known: bool = False) -> tuple:
    """The llvm-cpu target iree-compile chooses for this host (`--iree-llvmcpu-target-cpu=host`,
    the flag exporters/iree/ compiles with): (format, cpu, the features it enables), read from a trivial
    module compiled once per host CPU and compiler (cached); `known`: and every feature name LLVM knows
    for the host's architecture (its record names the features it disables too)."""
    from exporters.iree.program import FLAGS, host_cpu
    from oracle.cache.artifacts import cached_json, versions

    def compile_trivial():
        from iree.compiler import compile_str

        try:
            module = compile_str(_TRIVIAL, extra_args=list(FLAGS))
        except Exception:  # noqa: BLE001 (no compiler here: the target cannot be compared, the load still is)
            return None
        found, named = llvm_cpu_targets(module), llvm_cpu_targets(module, "+-")
        return [found[0][0], found[0][1], sorted(found[0][2]), sorted(named[0][2])] if found else None

    got = cached_json("iree-host-target", {"host_cpu": host_cpu(), "flags": FLAGS, "record": 2,
                                           **versions("iree-base-compiler")}, compile_trivial)
    if not got:
        return None
    return (got[0], got[1], frozenset(got[2])) + ((frozenset(got[3]),) if known else ())


def cpu_problem(vmfb: Path) -> str | None:
    """Whether this host can run the llvm-cpu code of a module: its targets' format (the
    architecture) is the host's, and every CPU feature they were compiled for is one the host
    has (a program compiled for another CPU loads, then dies on the first instruction it lacks)."""
    with open(vmfb, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        targets = llvm_cpu_targets(data)
    if not targets:
        return None
    host = host_llvm_target(known=True)
    if host is None:
        return None
    for fmt, cpu, features in targets:
        # bytes of a damaged file inside the record, not another CPU: a name no feature can have, or (on the
        # host's architecture) one LLVM does not know there (a flipped letter: wbnoinvd read as wbnoinv5)
        unreadable = sorted(f for f in features | ({cpu} if cpu else set()) if not FEATURE_NAME.fullmatch(f))
        unknown = sorted(features - host[3]) if fmt == host[0] and host[3] else []
        if unreadable or unknown:
            return (f"damaged: its llvm-cpu target record names no CPU feature that exists "
                    f"({(unreadable or unknown)[0]!r}): the file is corrupt")
        if fmt != host[0]:
            return f"compiled for {fmt} ({cpu}), this host runs {host[0]}: compile it here"
        missing = sorted(features - host[2])
        if missing:
            return (f"compiled for CPU {cpu}, with features this host's CPU ({host[1]}) lacks: "
                    f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; an llvm-cpu program for the "
                    "host is specific to the CPU it was compiled on: export it on this machine "
                    "(oracle export --backend iree-llvm-cpu)")
    return None


def _head(path: Path, n: int = 4096) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


# ------------------------------------------------------------------ the load, in a child process
_FOUND: dict = {}  # (kind, files and their sizes and mtimes) -> what the child found (one probe per file)


def probe(kind: str, flag: str, files: list[Path], runtime: str) -> dict:
    """What the child found loading `files` (`kind`: "pte" or "vmfb"); InputError naming
    `flag` and the program when it raised, aborted, was killed or did not finish."""
    key = (kind, *((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key in _FOUND:
        return _FOUND[key]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    what = f"{flag} {files[0]}"
    try:
        r = subprocess.run([sys.executable, "-m", "exporters.shared.given", kind, *map(str, files)], env=env,
                           capture_output=True, text=True, errors="replace", timeout=LOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise InputError(f"{what}: {runtime} did not finish loading it in {LOAD_TIMEOUT_S} s") from None
    log = runtime_log(r.stderr)
    if r.returncode != 0:
        how = (f"killed by {signal.Signals(-r.returncode).name}" if r.returncode < 0 and
               -r.returncode in signal.valid_signals() else f"exit status {r.returncode}")
        raise InputError(f"{what}: {runtime} crashed loading it ({how}{': ' + log if log else ''}); "
                         "not a program it can run")
    try:
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise InputError(f"{what}: {runtime} gave no answer loading it ({log or 'no output'})") from None
    if "error" in found:
        raise InputError(f"{what}: {runtime} cannot load it ({'; '.join(filter(None, [log, found['error']]))})")
    _FOUND[key] = found
    return found


def _load_pte(pte: str, ptd: str | None = None) -> dict:
    """(child) Every method of the program loaded; the constant methods' values."""
    from exporters.executorch.runtime import runtime

    program = runtime().load_program(pte, data_path=ptd)
    methods = sorted(program.method_names)
    constants = {}
    for name in methods:
        m = program.load_method(name)
        if name.startswith(("get_", "use_", "enable_")):
            out = m.execute([])
            if len(out) == 1 and isinstance(out[0], (bool, int, float)):
                constants[name] = out[0]
    return {"methods": methods, "constants": constants}


def _load_vmfb(vmfb: str, irpa: str | None = None) -> dict:
    """(child) The module with its parameters in a context (its initializers run): its functions."""
    import iree.runtime as rt

    from exporters.iree.program import PARAM_SCOPE

    config = rt.Config("local-task")
    modules = []
    if irpa:
        index = rt.ParameterIndex()
        index.load(irpa, mmap=True)
        for _, entry in index.items():  # every entry's metadata (the block programs read them as arrays)
            rt.parameter_index_entry_as_numpy_ndarray(entry)
        modules.append(rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=PARAM_SCOPE)))
    module = rt.VmModule.copy_buffer(config.vm_instance, Path(vmfb).read_bytes())
    rt.SystemContext(vm_modules=[*modules, module], config=config)
    return {"name": module.name, "functions": sorted(module.function_names)}


def main(argv: list[str]) -> int:
    kind, files = argv[0], argv[1:]
    try:
        found = {"pte": _load_pte, "vmfb": _load_vmfb}[kind](*files)
    except Exception as e:  # the runtime's error, reported by the parent
        found = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
