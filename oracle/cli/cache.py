"""`oracle cache list | prune`: the artifact cache."""

from __future__ import annotations

import sys

from oracle.cli.common import cache_limit_option, fail_input


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    ca = sub.add_parser("cache", help="list or prune the artifact cache ($MOE_ORACLE_CACHE, default "
                        "~/.cache/moe-oracle): programs, GGUFs, checkpoints, references, noise",
                        description="The artifact cache: entries built once and found again by content. It is kept "
                        "within a size limit (MOE_ORACLE_CACHE_LIMIT or --cache-limit on the commands that build; "
                        "default 32G): after each new entry the least recently used ones no running process holds "
                        "are removed, and an artifact that cannot fit is refused before it is built (exit 2). An "
                        "entry a running check holds is never removed.")
    csub = ca.add_subparsers(dest="cache_cmd", required=True)
    cl = csub.add_parser("list", help="every entry with its size, age (since last used) and whether a running "
                         "process holds it, least recently used first; the total against the limit")
    cl.add_argument("--json", action="store_true", help="the entries as JSON on standard output")
    cp = csub.add_parser("prune", help="remove entries (never one a running process holds). With no selector: "
                         "the least recently used until the cache is within its limit")
    cp.add_argument("--all", action="store_true", help="every entry")
    cp.add_argument("--backend", action="append", help="the artifacts this backend built (repeatable)")
    cp.add_argument("--older-than", type=float, metavar="DAYS", help="entries not used for more than DAYS days")
    cp.add_argument("--max-size", metavar="SIZE", help="the least recently used until the cache is at most SIZE "
                    "(e.g. 20G, 500M)")
    cp.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    cache_limit_option(ca)


def cmd_cache(a) -> int:
    import json
    import time

    from oracle.backend import BackendError, resolve
    from oracle.cache import store as cache
    from oracle.cache.store import cache_root

    try:
        cap = cache.limit()
    except ValueError as e:
        fail_input(str(e))
    freed = cache.remove_stale_temps()  # left by a killed build: no entry owns them
    if freed:
        print(f"removed stale build directories (their writer is gone): {cache.human(freed)}", file=sys.stderr)
    es = cache.entries()
    if a.cache_cmd == "list":
        if a.json:
            print(json.dumps({"root": str(cache_root()), "limit": cap, "bytes": sum(e.bytes for e in es),
                              "entries": [e.as_dict() for e in es]}, indent=1))
            return 0
        for e in es:
            print(f"{cache.human(e.bytes):>10s}  {cache.age_text(e.last_used):>8s} ago  "
                  f"{'held ' if e.held else '     '} {e.name}")
        print(f"{len(es)} entries, {cache.human(sum(e.bytes for e in es))} of a {cache.human(cap)} limit "
              f"in {cache_root()}")
        return 0
    chosen = list(es)
    if a.backend:
        spaces = set()
        for name in a.backend:
            try:
                b = resolve(name)
            except BackendError as e:
                fail_input(f"--backend: {e}")
            spaces.update(f"artifacts/{ns}" for ns in (b.cache_namespaces or (b.name,)))
        chosen = [e for e in chosen if e.kind in spaces]
    if a.older_than is not None:
        if a.older_than < 0:
            fail_input(f"--older-than: must be at least 0 days, got {a.older_than}")
        chosen = [e for e in chosen if time.time() - e.last_used > a.older_than * 86400]
    if a.max_size is not None or not (a.all or a.backend or a.older_than is not None):
        try:
            target = cap if a.max_size is None else cache.parse_size(a.max_size)
        except ValueError as e:
            fail_input(f"--max-size: {e}")
        chosen = cache.least_recently_used(chosen, sum(e.bytes for e in es), target)
    held = [e for e in chosen if e.held]
    chosen = [e for e in chosen if not e.held]
    removed = chosen if a.dry_run else cache.prune(chosen)
    kept = held + [e for e in chosen if e not in removed]
    verb = "would remove" if a.dry_run else "removed"
    for e in removed:
        print(f"{verb} {e.name} ({cache.human(e.bytes)})")
    for e in kept:
        print(f"kept {e.name} ({cache.human(e.bytes)}): a running process holds it")
    print(f"{verb} {len(removed)} entries, {cache.human(sum(e.bytes for e in removed))}; the cache holds "
          f"{cache.human(cache.total_bytes())} of a {cache.human(cap)} limit")
    return 0
