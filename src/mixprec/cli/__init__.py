"""The ``mixprec`` command: train a model in mixed precision and see whether it is healthy.

``mixprec train`` with no arguments trains LeNet-5 on the embedded 8x8 digits at amp
level O2 (float16 on CUDA, bfloat16 on a CPU) with dynamic loss scaling, shows
progress, and ends with the test accuracy. Into ``--out`` it writes ``config.json``,
``metrics.json``, ``metrics.csv``, plots (``loss.png``, ``accuracy.png``,
``loss_scale.png`` with skipped steps marked) and per-epoch checkpoints, from which
``--resume`` continues exactly.

``mixprec compare`` trains the same model at several levels, each in a fresh process
(so peak memory is that configuration's own), and prints one table.

Bad input (a missing data file, an unknown level, an output folder that is a file...)
is reported in one line on stderr with exit code 2, before anything is written.

The parts: :mod:`mixprec.cli.args` (the parser), :mod:`mixprec.cli.train` and
:mod:`mixprec.cli.compare` (the two commands).
"""

from __future__ import annotations

import sys

from mixprec.cli.args import UsageError, build_parser
from mixprec.cli.compare import run_compare
from mixprec.cli.train import run_train
from mixprec.train.data import DataError

__all__ = ["main", "build_parser", "run_train", "run_compare"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mixprec`` command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            run_train(args)
        else:
            run_compare(args)
    except (UsageError, DataError) as err:
        print(f"mixprec: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as err:
        # Input the library rejected (it names the argument): still one line.
        print(f"mixprec: error: {err}", file=sys.stderr)
        return 2
    return 0
