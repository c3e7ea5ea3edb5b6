"""`oracle reference save`: a captured HF reference as a portable directory."""

from __future__ import annotations

import sys

from oracle.cli.common import EXIT, check_outputs, fail_input, positive_int, progress_reporter, weights_option


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    rf = sub.add_parser("reference", help="save a captured HF reference as a portable directory")
    rfsub = rf.add_subparsers(dest="reference_cmd", required=True)
    rs = rfsub.add_parser("save", help="capture the HF fp32 reference of a checkpoint and write it to --out")
    rs.add_argument("--family", help="default: the family the --model-dir / --config config.json names")
    rsrc = rs.add_mutually_exclusive_group()
    rsrc.add_argument("--model-dir")
    rsrc.add_argument("--tiny", action="store_true", help="the family's tiny seeded checkpoint (default)")
    rsrc.add_argument("--config")
    rs.add_argument("--layers", type=positive_int)
    rs.add_argument("--prompt-len", type=positive_int, default=8)
    rs.add_argument("--decode-tokens", type=positive_int, default=8)
    rs.add_argument("--seed", type=int, default=0)
    weights_option(rs)
    rs.add_argument("--out", required=True, help="the directory to write (replaced if it is a saved reference)")


def cmd_reference(a) -> int:
    from pathlib import Path

    from oracle.backend import CheckSpec, InputError
    from oracle.reference.cached import save_reference
    from oracle.source.validation import family_of, validate

    out = Path(a.out)
    if out.exists() and not (out.is_dir() and ((out / "provenance.json").is_file() or not any(out.iterdir()))):
        fail_input(f"--out {out}: exists and is not a saved reference (not replaced)")
    check_outputs(dirs=[("--out", str(out.parent))])
    try:
        family = a.family or family_of(a.model_dir, a.config, a.layers)
        spec = CheckSpec(family=family, backend="hf", prompt_len=a.prompt_len, decode_tokens=a.decode_tokens,
                         seed=a.seed, model_dir=a.model_dir, config=a.config, layers=a.layers, weights=a.weights)
        validate(spec)
        prog, update = progress_reporter()
        if prog:
            with prog:
                files = save_reference(spec, a.out, update)
        else:
            files = save_reference(spec, a.out)
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    print(f"wrote {out} ({', '.join(f.name for f in files)})")
    return 0
