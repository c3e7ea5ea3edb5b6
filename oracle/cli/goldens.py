"""`oracle goldens check | freeze`: golden tokens and structural goldens."""

from __future__ import annotations

import sys

from oracle.cli.common import EXIT, known_family
from oracle.reports.result import Status


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    g = sub.add_parser("goldens", help="check or freeze golden tokens and structural goldens")
    gsub = g.add_subparsers(dest="goldens_cmd", required=True)
    for name, hlp in (("check", "run the checks that have goldens and compare"),
                      ("freeze", "write goldens for family/backend after its numeric check passes")):
        gp = gsub.add_parser(name, help=hlp)
        gp.add_argument("--family", action="append", help="limit to this family (repeatable)")
        gp.add_argument("--backend", action="append", help="limit to this backend (repeatable)")
        if name == "freeze":
            gp.add_argument("--precision", help="freeze at this precision (default: the goldens' own, fp32): "
                            "another precision writes only its structural goldens, <name>.<precision>.txt")


def cmd_goldens(a) -> int:
    from dataclasses import replace

    from oracle.backend import BackendError, InputError, resolve
    from oracle.check import run_check
    from oracle.verdict import goldens

    if a.goldens_cmd == "freeze":
        backends = a.backend or ["eager"]
        from models import FAMILY_NAMES

        families = a.family or list(FAMILY_NAMES)
        rc = 0
        for b in backends:
            for f in families:
                try:
                    spec = goldens.default_spec(f, b)
                    if a.precision:
                        spec = replace(spec, precision=a.precision)
                except InputError as e:
                    print(f"oracle: error: {e}", file=sys.stderr)
                    return EXIT["bad_input"]
                try:
                    ok, msg, _ = goldens.freeze(spec, run_check(spec, goldens=False))
                except InputError as e:  # the backend refuses this family (e.g. mlx-lm's model computes another one)
                    ok, msg = False, f"{f}/{b}: refused, not freezing: {e}"
                print(msg)
                rc = rc or (0 if ok else EXIT["fail"])
        return rc
    for f in a.family or []:
        known_family("--family", f)
    pairs = [(f, b) for f, b in goldens.present()
             if (not a.family or f in a.family) and (not a.backend or b in a.backend)]
    if not pairs:
        have = sorted({b for f, b in goldens.present() if not a.family or f in a.family})
        print(f"oracle: no goldens for {', '.join(a.family or ['any family'])} on {', '.join(a.backend or ['any backend'])}"
              f" (backends with goldens for them: {', '.join(have) or 'none'}; `oracle goldens freeze` writes them)",
              file=sys.stderr)
        return EXIT["bad_input"]
    rc = 0
    for f, b in pairs:
        try:
            ok, reason = resolve(b).availability()
        except BackendError as e:
            ok, reason = False, str(e)
        if not ok:
            print(f"{f}/{b}: skipped ({reason})")
            continue
        try:
            r = run_check(goldens.default_spec(f, b))
        except InputError as e:
            print(f"oracle: error: {e}", file=sys.stderr)
            return EXIT["bad_input"]
        gates = [g for g in r.gates if g.name == "golden_tokens" or g.name.startswith("structure:")]
        bad = [g for g in gates if g.status != Status.PASS]
        print(f"{f}/{b}: {r.status}; goldens " + (", ".join(f"{g.name} {g.status}" for g in gates) or "none applied"))
        for g in bad:
            print(f"  {g.message}")
        if bad or r.status != Status.PASS:
            rc = EXIT["fail"]
    return rc
