"""`oracle families` and `oracle backends`: what this install knows and can run here."""

from __future__ import annotations


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    sub.add_parser("families", help="list model families")
    sub.add_parser("backends", help="list backends and whether they are available here")


def cmd_families() -> int:
    from models import FAMILY_NAMES, UNSUPPORTED, get_family

    width = max(map(len, (*FAMILY_NAMES, *UNSUPPORTED)))
    for name in FAMILY_NAMES:
        f = get_family(name)
        print(f"{name:{width}s} supported    HF {f.hf_class_name} (model_type {', '.join(f.model_types)})")
    for name, why in UNSUPPORTED.items():
        print(f"{name:{width}s} unsupported  missing: {why}")
    from oracle.source.published import known_configs

    print(f"published configs (--config NAME [--layers N]): {known_configs()}")
    return 0


def cmd_backends() -> int:
    from oracle.backend import BackendError, builtin_names, resolve

    for name in builtin_names():
        try:
            b = resolve(name)
            ok, reason = b.availability()
        except BackendError as e:
            b, ok, reason = None, False, str(e)
        print(f"{name:18s} {'available' if ok else 'unavailable'}{'' if ok else ': ' + reason}")
        if b is not None:
            if b.precisions:
                print(f"    precisions: {', '.join(b.precisions)}")
            schema = b.option_schema
            for o in schema:
                print(f"    {o.describe()}")
            if not schema:
                print("    options: none")
    return 0
