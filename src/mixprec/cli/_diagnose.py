"""``mixprec diagnose``: which layers of the main job's model a low-precision dtype would hurt.

Builds the model ``mixprec train`` would train (``--model``, same seed, same data or
``--data FILE``), runs ``--batches`` training batches through it in float32 with
:func:`mixprec.diagnose`, and prints the report: per layer the fraction of values that
underflow or overflow ``--dtype`` (float16 by default: the dtype with the narrow
range), the recommended loss scale with its range and margin, and the layers to keep
in float32. Into ``--out`` it writes ``precision_report.txt`` (the table),
``precision_report.json`` and ``precision_report.png``.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from mixprec.cli._train import check_out_dir, load_data
from mixprec.diagnostics import PrecisionReport, diagnose
from mixprec.train._loop import resolve_device
from mixprec.train.models import build_model


def run_diagnose(args: argparse.Namespace) -> PrecisionReport:
    """Diagnose the configured model on its training data; print and save the report."""
    check_out_dir(args.out)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    # Every input error surfaces here, before anything is written.
    train, _, _, classes, shape = load_data(args)
    torch.manual_seed(args.seed)
    network = build_model(args.model, classes, shape).to(device)
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
