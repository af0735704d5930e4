"""The ``mixprec`` command: train a model in mixed precision and see whether it is healthy.

``mixprec train`` with no arguments trains LeNet-5 on the embedded 8x8 digits at the
level and dtype the hardware runs fast (``--level auto``: O1 bfloat16 on a CPU with
bfloat16 units, O0 float32 on one without, O2 on CUDA), with the level's own loss scale
(none for bfloat16, as in the library) and, on a CPU, one thread; its header says what
it chose and why. It shows progress and ends with the test accuracy. The data is split
three ways: the test set, evaluated once, at the end; a validation part carved from the
rest (``val_accuracy``, each epoch); and the training part. Into ``--out`` it writes ``config.json``,
``metrics.json``, ``metrics.csv`` (one row per epoch, a stable header, ``nan`` for a
value an epoch did not measure), plots (``loss.png``, ``accuracy.png``,
``loss_scale.png``: the scale the run used, skipped steps marked, the sampled gradient
underflow beside it, titled with what the run did) and per-epoch checkpoints, from
which ``--resume`` continues exactly.

``mixprec compare`` trains the same model at several levels, each in a fresh process
(so peak memory is that configuration's own, and a level stuck past
``--level-timeout`` is stopped), shows a progress line as each level starts and ends
and one per epoch as it trains, and prints one table with the step times' spread.

``mixprec diagnose`` runs a few batches through the same model in float32 and reports
(:mod:`mixprec.cli._diagnose`) which layers a low-precision dtype would underflow or
overflow, and the loss scale to use; like ``train`` it refuses an ``--out`` that already
holds a report unless ``--overwrite``.

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
``mixprec`` alone prints the usage on stderr and exits 2.

Under ``torchrun`` (data parallel ``mixprec train``) every rank prints the same one line
and exits with the same code; ``torchrun`` then adds its own failure summary (its
``ChildFailedError``, listing each rank's exit code) and exits 1
(:mod:`mixprec.cli._torchrun`).

The parts: :mod:`mixprec.cli._args` (the parser), :mod:`mixprec.cli._run_folder` (what a
run folder holds and its rules), :mod:`mixprec.cli._train` and :mod:`mixprec.cli._compare`
(the two commands).
"""

from __future__ import annotations

import errno
import importlib
import sys
from typing import Any

from mixprec.cli._args import UsageError, build_parser, precheck
from mixprec.cli._torchrun import failing, finish

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
    """Entry point of the ``mixprec`` command; returns the exit code.

    With no arguments it prints the usage and the sub-commands on stderr and returns 2,
    argparse's code for a missing sub-command.
    """
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
        precheck(args)  # before torch loads: a mistyped path fails at once
    except UsageError as err:
        failing()
        return finish(f"mixprec: error: {err}", 2)
    module, function = _COMMANDS[args.command]
    run = getattr(importlib.import_module(module), function)
    # Loaded with the sub-command's module (mixprec.cli._train, which each of them imports).
    from mixprec.cli._train import DIVERGED
    from mixprec.train.data import DataError

    try:
        run(args)
    except BaseException as err:  # noqa: BLE001 - each kind is one line and an exit code
        found = _outcome(err, DIVERGED, DataError)
        if found is None:
            raise
        failing()  # under torchrun: this rank finishes its line, whatever the others do
        return finish(*found)
    return 0


def _outcome(err: BaseException, diverged: tuple, data_error: type) -> tuple[str, int] | None:
    """The one line and exit code for ``err``; ``None`` for an error that is a bug (its
    traceback is the report)."""
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C: one line, the conventional 128 + SIGINT
        return f"mixprec: {_one_line(err) or 'interrupted'}", 130
    if isinstance(err, (UsageError, data_error)):
        return f"mixprec: error: {err}", 2
    if isinstance(err, (ValueError, TypeError, FileNotFoundError)):
        # Input the library rejected (it names the argument): still one line.
        return f"mixprec: error: {_one_line(err)}", 2
    if isinstance(err, OSError):  # a folder or file that cannot be written (or read)
        where = f" {err.filename}" if err.filename else ""
        if err.errno in _ENVIRONMENT:  # not the user's input: the machine's state
            return f"mixprec: error: {_ENVIRONMENT[err.errno]} writing{where}", 1
        return f"mixprec: error: cannot write{where}: {err.strerror or err}", 2
    if isinstance(err, diverged):
        return f"mixprec: diverged: {_one_line(err)}", 3
    if isinstance(err, CompareFailed):
        return f"mixprec: error: {_one_line(err)}", err.code
    return None


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
