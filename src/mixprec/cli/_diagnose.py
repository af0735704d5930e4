"""``mixprec diagnose``: which layers of the main job's model a low-precision dtype would hurt.

Builds the model ``mixprec train`` would train (``--model``, same seed, same data or
``--data FILE``), runs ``--batches`` training batches through it in float32 with
:func:`mixprec.diagnose`, and prints the report: per layer the fraction of values that
underflow or overflow ``--dtype`` (float16 by default: the dtype with the narrow
range), the recommended loss scale with its range and margin, and the layers to keep
in float32. Into ``--out`` it writes ``precision_report.txt`` (the table),
``precision_report.json`` and ``precision_report.png``.

The folder follows ``mixprec train``'s rules: one that already holds a report is
refused (one line, exit code 2) unless ``--overwrite``, which deletes the old report's
files first; one process at a time writes into it (:class:`~mixprec.cli._run_folder.RunLock`);
and every input is checked before the folder is looked at.
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import torch

from mixprec.cli._args import UsageError
from mixprec.cli._run_folder import RunLock, present_files
from mixprec.cli._train import check_out_dir, load_data, settle_threads
from mixprec.diagnostics import PrecisionReport, diagnose
from mixprec.diagnostics._report import REPORT_JSON, REPORT_PNG
from mixprec.train._loop import resolve_device
from mixprec.train.models import build_model

#: The files ``mixprec diagnose`` writes into ``--out``.
REPORT_FILES = ("precision_report.txt", REPORT_JSON, REPORT_PNG)


def run_diagnose(args: argparse.Namespace) -> PrecisionReport:
    """Diagnose the configured model on its training data; print and save the report."""
    check_out_dir(args.out)
    device = resolve_device(args.device)
    settle_threads(args, device)
    # Every input error surfaces here, before anything is written.
    train, _, _, classes, shape = load_data(args)
    if not 0 <= args.tolerance <= 1:  # the library's check, before the folder is looked at
        raise UsageError(f"tolerance must be a number in [0, 1], got {args.tolerance!r}")
    torch.manual_seed(args.seed)
    network = build_model(args.model, classes, shape).to(device)
    lock = RunLock(args.out, "--overwrite" if args.overwrite else "--out").acquire()
    try:
        present = present_files(args.out, REPORT_FILES)
        if present and not args.overwrite:
            raise UsageError(
                f"--out {args.out} already holds a report ({', '.join(present)}): choose "
                "another --out, or pass --overwrite to replace it"
            )
        for name in present:  # --overwrite: no file of the old report stays beside the new
            (args.out / name).unlink()
        return _diagnose(args, network, train, device)
    except BaseException:
        lock.release(remove_created=True)  # folders it made, if still empty
        raise
    finally:
        lock.release()


def _diagnose(
    args: argparse.Namespace, network: torch.nn.Module, train: Any, device: torch.device
) -> PrecisionReport:
    t0 = time.perf_counter()
    report = diagnose(
        network,
        torch.nn.CrossEntropyLoss(),
        itertools.islice(train, args.batches),
        dtype=args.dtype,
        tolerance=args.tolerance,
    )
    seconds = time.perf_counter() - t0
    print(
        f"mixprec diagnose: {args.model} on {'digits' if args.data is None else args.data}, "
        f"{report.batches} batch(es) of {args.batch_size}, {device} ({seconds:.1f} s)"
    )
    print(report)
    print()
    print(report.suggest())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "precision_report.txt").write_text(str(report) + "\n")
    report.save(args.out)
    print(f"wrote precision_report.txt, precision_report.json, precision_report.png to {args.out}")
    return report
