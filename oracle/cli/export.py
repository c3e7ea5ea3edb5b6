"""`oracle export`: a backend's compiled artifacts and a manifest."""

from __future__ import annotations

import sys

from oracle.cli.common import (EXIT, backend_options, cache_limit_option, check_outputs, default_family, options_of,
                                positive_int, weights_option)


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    e = sub.add_parser("export", help="write a backend's compiled artifacts and a manifest")
    e.add_argument("--family", help="default: the family the --model-dir / --config config.json names")
    e.add_argument("--backend", required=True)
    esrc = e.add_mutually_exclusive_group()
    esrc.add_argument("--model-dir")
    esrc.add_argument("--tiny-test", action="store_true", help="the family's tiny seeded checkpoint (default)")
    esrc.add_argument("--config", help="a seeded checkpoint of a published config (see `oracle check --config`)")
    e.add_argument("--layers", type=positive_int, help="with --config: cut the depth to N layers")
    e.add_argument("--output-dir", required=True)
    e.add_argument("--precision", default="fp32")
    e.add_argument("--seed", type=int, default=0)
    weights_option(e)
    e.add_argument("--max-seq-len", type=positive_int, default=128, help="static cache length (default 128)")
    e.add_argument("--prompt-len", type=positive_int, default=8, help="prefill length where it is static")
    e.add_argument("--qlinear", choices=["4w", "8w", "8da4w"], help="weight quantization (ExecuTorch exporters)")
    e.add_argument("--qlinear-group-size", type=positive_int, help="quantization group size")
    e.add_argument("--sample", action="store_true", help="fuse the on-device sampler (where supported)")
    backend_options(e)
    cache_limit_option(e)


def cmd_export(a) -> int:
    from oracle.backend import CheckSpec, InputError
    from oracle.export import run_export

    check_outputs(dirs=[("--output-dir", a.output_dir)])
    if a.family is None and not default_family(a):
        return EXIT["bad_input"]
    spec = CheckSpec(family=a.family, backend=a.backend, precision=a.precision, seed=a.seed,
                     prompt_len=a.prompt_len, decode_tokens=max(1, a.max_seq_len - a.prompt_len),
                     model_dir=a.model_dir, config=a.config, layers=a.layers, weights=a.weights,
                     options=options_of(a))
    try:
        manifest = run_export(spec, a.output_dir)
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    except Exception as e:  # the exporter itself failed
        print(f"oracle: export failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT["error"]
    print(f"wrote {manifest}")
    return 0
