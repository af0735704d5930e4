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
(:mod:`mixprec.cli._diagnose`) which layers a low-precision dtype would underflow or
overflow, and the loss scale to use.

Exit codes: 0 success; 2 bad input (a missing data file, an unknown level, an output
folder that holds a run, is held by another mixprec process or cannot be written, an
unsafe or unfitting checkpoint, a damaged metrics.csv or config.json...), reported in one
line on stderr before anything is written; 3 the run diverged (the loss scale collapsed,
the loss stayed NaN, a weight became non-finite, every step was skipped), reported in one
line on stderr after the metrics, plots and finished epochs' checkpoints were saved;
1 the environment failed (no space left on device writing a file: the finished epochs'
checkpoints are intact and ``--resume`` continues once there is space); 130 interrupted
(Ctrl-C), resumable from the last finished epoch. ``mixprec compare`` exits non-zero
when any level failed (3 when each failed level diverged), after writing its table.

The parts: :mod:`mixprec.cli._args` (the parser), :mod:`mixprec.cli._run_folder` (what a
run folder holds and its rules), :mod:`mixprec.cli._train` and :mod:`mixprec.cli._compare`
(the two commands).
"""

from __future__ import annotations

import errno
import importlib
import sys
from typing import Any

from mixprec.cli._args import UsageError, build_parser

__all__ = ["main", "build_parser", "run_train", "run_compare", "run_diagnose"]

#: Sub-command -> the module and function that run it. A sub-command's module (and torch
#: with it) is imported only when that sub-command runs: ``--help`` and ``--version``
#: need the parser alone.
_COMMANDS = {
    "train": ("mixprec.cli._train", "run_train"),
    "compare": ("mixprec.cli._compare", "run_compare"),
    "diagnose": ("mixprec.cli._diagnose", "run_diagnose"),
}


def __getattr__(name: str) -> Any:  # PEP 562: run_train & co. load on first use
    for module, function in _COMMANDS.values():
        if name == function:
            return getattr(importlib.import_module(module), function)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mixprec`` command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        print(f"mixprec: error: {err}", file=sys.stderr)
        return 2
    module, function = _COMMANDS[args.command]
    run = getattr(importlib.import_module(module), function)
    # Loaded with the sub-command's module (mixprec.cli._train, which each of them imports).
    from mixprec.cli._train import DIVERGED
    from mixprec.train.data import DataError

    try:
        run(args)
    except KeyboardInterrupt as err:  # Ctrl-C: one line, the conventional 128 + SIGINT
        print(f"mixprec: {_one_line(err) or 'interrupted'}", file=sys.stderr)
        return 130
    except (UsageError, DataError) as err:
        print(f"mixprec: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as err:
        # Input the library rejected (it names the argument): still one line.
        print(f"mixprec: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # a folder or file that cannot be written (or read)
        where = f" {err.filename}" if err.filename else ""
        if err.errno in _ENVIRONMENT:  # not the user's input: the machine's state
            print(f"mixprec: error: {_ENVIRONMENT[err.errno]} writing{where}", file=sys.stderr)
            return 1
        print(f"mixprec: error: cannot write{where}: {err.strerror or err}", file=sys.stderr)
        return 2
    except DIVERGED as err:
        print(f"mixprec: diverged: {_one_line(err)}", file=sys.stderr)
        return 3
    except CompareFailed as err:
        print(f"mixprec: error: {_one_line(err)}", file=sys.stderr)
        return err.code
    return 0


#: Errors of the machine rather than of the input: exit code 1.
_ENVIRONMENT = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "input/output error",
}


class CompareFailed(Exception):
    """``mixprec compare``: some levels failed (the table says which and why)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
