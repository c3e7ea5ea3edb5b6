"""What a check needs in memory and what this host has: a backend's estimate plus what the harness holds beside
it, against the kernel's (and a cgroup's) available memory; the refusal that names both."""

from __future__ import annotations

from pathlib import Path

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


def memory_plan(backend, src, spec, beside: tuple[int, str] = (0, "")) -> tuple[int | None, str]:
    """(peak bytes, how they are made up) of a check of this model on this backend: its estimate
    (`memory_estimate(src, spec)`: by default its `memory_per_param` at this precision times the checkpoint's
    parameters) + what the harness holds `beside` it ((bytes, how): oracle.verdict.noise.shared_models_memory) +
    BASE_MEMORY; (None, "") where the backend makes no estimate."""
    need, how = backend.memory_estimate(src, spec)
    if need is None:
        return None, ""
    extra, what = beside
    return (need + extra + BASE_MEMORY,
            f"{how}{f', + {what}' if extra else ''}, + {BASE_MEMORY / GIB:g} GiB")


def memory_refusal(backend, src, spec, beside: tuple[int, str] = (0, "")) -> str | None:
    """Why this check cannot hold this model here (memory_plan above the available memory), or None.
    $MOE_ORACLE_MEMORY_CHECK=off skips it (e.g. with swap the kernel does not count)."""
    import os

    if os.environ.get("MOE_ORACLE_MEMORY_CHECK", "on") == "off":
        return None
    need, how = memory_plan(backend, src, spec, beside)
    if need is None:
        return None
    avail = available_memory()
    if avail is None or need <= avail:
        return None
    return (f"{spec.backend} --precision {spec.precision} would need about {need / GIB:.1f} GiB for this "
            f"checkpoint ({how}) and {avail / GIB:.1f} GiB is available: use a machine "
            f"with more memory, a lower precision, or --layers N to check a cut of the model "
            f"(MOE_ORACLE_MEMORY_CHECK=off to try anyway)")
