"""The ``mixprec`` command: train a model in mixed precision and see whether it is healthy.

``mixprec train`` with no arguments trains LeNet-5 on the embedded 8x8 digits at amp
level O2 (float16 on CUDA, bfloat16 on a CPU) with dynamic loss scaling, shows
progress, and ends with the test accuracy. Into ``--out`` it writes ``config.json``,
``metrics.json``, ``metrics.csv``, plots (``loss.png``, ``accuracy.png``,
``loss_scale.png`` with skipped steps marked) and per-epoch checkpoints, from which
``--resume`` continues exactly.

``mixprec compare`` trains the same model at several levels, each in a fresh process
(so peak memory is that configuration's own), and prints one table.

``mixprec diagnose`` runs a few batches through the same model in float32 and reports
(:mod:`mixprec.cli.diagnose`) which layers a low-precision dtype would underflow or
overflow, and the loss scale to use.

Exit codes: 0 success; 2 bad input (a missing data file, an unknown level, an output
folder that holds a run or cannot be written, an unsafe checkpoint...), reported in one
line on stderr before anything is written; 3 the run diverged (the loss scale collapsed,
the loss stayed NaN, a weight became non-finite), reported in one line on stderr after
the metrics, plots and finished epochs' checkpoints were saved.

The parts: :mod:`mixprec.cli.args` (the parser), :mod:`mixprec.cli.run_folder` (what a
run folder holds and its rules), :mod:`mixprec.cli.train` and :mod:`mixprec.cli.compare`
(the two commands).
"""

from __future__ import annotations

import sys

from mixprec.cli.args import UsageError, build_parser
from mixprec.cli.compare import run_compare
from mixprec.cli.diagnose import run_diagnose
from mixprec.cli.train import DIVERGED, run_train
from mixprec.train.data import DataError

__all__ = ["main", "build_parser", "run_train", "run_compare", "run_diagnose"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mixprec`` command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            run_train(args)
        elif args.command == "diagnose":
            run_diagnose(args)
        else:
            run_compare(args)
    except (UsageError, DataError) as err:
        print(f"mixprec: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as err:
        # Input the library rejected (it names the argument): still one line.
        print(f"mixprec: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # a folder or file that cannot be written (or read)
        where = f" {err.filename}" if err.filename else ""
        print(f"mixprec: error: cannot write{where}: {err.strerror or err}", file=sys.stderr)
        return 2
    except DIVERGED as err:
        print(f"mixprec: diverged: {_one_line(err)}", file=sys.stderr)
        return 3
    return 0


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
