"""The command line: ``python -m fvx.run EXPERIMENT.py [a.b=value ...] [--out DIR] [--steps N]``.

``--help`` after an experiment lists its config fields with their current values. Bad input (an unknown field, a
wrong type, a missing file, data that does not fit the model) ends with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from fvx import config as fconfig
from fvx import loop

USAGE = "python -m fvx.run EXPERIMENT.py [a.b.c=value ...] [--out DIR] [--steps N] [--help]"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fvx.run", usage=USAGE, add_help=False,
                                     description="Train with an fvx experiment file.")
    parser.add_argument("experiment", nargs="?", help="a Python file that assigns `config`")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. method.optim.lr=1e-5")
    parser.add_argument("--out", help="the run folder (shortcut for run.output_dir=DIR)")
    parser.add_argument("--steps", type=int, help="the number of steps (shortcut for run.steps=N)")
    parser.add_argument("-h", "--help", action="store_true", help="list the experiment's config fields and exit")
    args = parser.parse_intermixed_args(argv)
    args.print_usage = parser.print_help
    return args


def resolve_config(args: argparse.Namespace) -> fconfig.Config:
    """The experiment's config with the overrides, then ``--out`` and ``--steps``, applied and validated."""
    overrides = list(args.overrides)
    for item in overrides:
        if "=" not in item:
            raise fconfig.ConfigError(f"argument {item!r} is not an override of the form dotted.field=value")
    if args.out is not None:
        overrides.append(f"run.output_dir={args.out}")
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    config = fconfig.load_experiment(args.experiment)
    if not isinstance(config, loop.Experiment):
        raise fconfig.ConfigError(
            f"experiment file {args.experiment!r}: `config` is a {type(config).__qualname__}, "
            "expected a subclass of fvx.loop.Experiment"
        )
    return fconfig.apply_overrides(config, overrides)


def print_fields(config: fconfig.Config, experiment: str) -> None:
    rows = fconfig.describe(config)
    width = max(len(path) for path, _, _ in rows)
    print(f"usage: {USAGE}\n\nfields of {experiment} (override any with field=value):")
    for path, type_name, value in rows:
        print(f"  {path:<{width}}  {value!r}  ({type_name})")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.experiment is None:
        args.print_usage()
        return 0 if args.help else 2
    try:
        config = resolve_config(args)
        if args.help:
            print_fields(config, args.experiment)
            return 0
        prepared = loop.prepare(config)
    except (fconfig.ConfigError, ValueError, FileNotFoundError) as error:
        print(f"fvx.run: error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    loop.train(config, prepared=prepared)
    print(f"done: {config.run.steps} steps in {time.perf_counter() - start:.1f} s; run folder {config.run.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
