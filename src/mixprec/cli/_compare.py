"""``mixprec compare``: train the same model at several amp levels and print one table.

A level may carry options after ``+``: ``O2+compile`` trains O2 under ``torch.compile``
(``--compile`` compiles every entry) and ``O2+fp8`` with float8 linear layers (dynamic
scaling; ``--fp8`` for every entry), so ``--levels O2,O2+compile,O2+fp8`` puts them
side by side.

Each level trains in a fresh process, so its peak memory is its own and not whatever
the levels before it left behind. The table (accuracy, loss, median step time, peak
memory, skipped steps) is also written to ``compare.json`` and plotted to
``compare.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
from typing import Any

import torch

from mixprec.cli._args import UsageError, fill_defaults
from mixprec.cli._train import build_run, check_out_dir, load_data
from mixprec.tools._memory import peak_rss_mib, reset_peak_rss
from mixprec.train._loop import AMP_LEVELS
from mixprec.train._plots import plot_comparison
from mixprec.train.callbacks import History

__all__ = ["ENTRY_OPTIONS", "parse_entry", "run_compare"]


#: What may follow a level after ``+`` in ``--levels``: the ``mixprec train`` option
#: it sets, and the value.
ENTRY_OPTIONS = {"compile": True, "fp8": "dynamic"}


def parse_entry(text: str) -> tuple[str, tuple[str, ...]]:
    """``"O2+compile"`` -> ``("O2", ("compile",))``; a ``UsageError`` names what is wrong.

    >>> parse_entry("O2+compile")
    ('O2', ('compile',))
    """
    level, *options = (part.strip() for part in text.split("+"))
    bad = [o for o in options if o not in ENTRY_OPTIONS]
    if level not in AMP_LEVELS or bad:
        raise UsageError(
            f"--levels: unknown {'option ' + repr(bad[0]) if bad else 'level ' + repr(level)} "
            f"in {text!r}; levels: {', '.join(AMP_LEVELS)}; options after '+': "
            f"{', '.join(ENTRY_OPTIONS)} (e.g. O2+compile)"
        )
    return level, tuple(options)


def _compare_one(args: argparse.Namespace, entry: str) -> dict[str, Any]:
    """Train one ``--levels`` entry in this (fresh) process and measure it."""
    level, options = parse_entry(entry)
    args = argparse.Namespace(**{**vars(args), **{o: ENTRY_OPTIONS[o] for o in options}})
    model, train, test, schedule = build_run(args, level)
    reset_peak_rss()  # count this level's training, not the imports before it
    step_times: list[float] = []

    class _Timer(History):
        def on_step_end(self, state):  # noqa: ANN001
            step_times.append(1.0 / max(state.samples_per_s, 1e-9) * args.batch_size)

    if torch.cuda.is_available() and model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train(args.epochs, train, callbacks=[schedule, _Timer()])
    final = model.eval(test)
    if model.device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = peak_rss_mib()
    config = model.amp_level
    if model.amp_level != "O0":
        config += f" {str(model.dtype).replace('torch.', '')}"
    if args.fp8:
        config += f" fp8-{args.fp8}"
    if args.compile:
        config += " compiled"
    return {
        "config": config,
        "accuracy": final["accuracy"],
        "loss": final["loss"],
        "step_ms": 1000 * statistics.median(step_times[len(step_times) // 5 :] or step_times),
        "peak_mb": peak_mb,
        "skipped_steps": int(model.optimizer.skipped_steps),
    }


def run_compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train each of ``--levels`` in its own process; print, save and plot the table."""
    fill_defaults(args)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    if not levels:
        raise UsageError(f"--levels: no level in {args.levels!r}; e.g. O0,O2,O2+compile")
    for entry in levels:
        parse_entry(entry)
    check_out_dir(args.out)
    load_data(args)  # fail on bad data before spawning anything
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for level in levels:
        with ctx.Pool(1) as pool:  # a fresh process: its peak RSS is this level's own
            rows.append(pool.apply(_compare_one, (args, level)))
        if not args.quiet:
            print(f"  done: {rows[-1]['config']}", file=sys.stderr)
    header = f"{'config':<25}{'accuracy':>9}{'loss':>8}{'ms/step':>9}{'peak MB':>9}{'skipped':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['config']:<25}{r['accuracy']:>9.4f}{r['loss']:>8.4f}{r['step_ms']:>9.2f}"
            f"{r['peak_mb']:>9.0f}{r['skipped_steps']:>9d}"
        )
    (args.out / "compare.json").write_text(json.dumps(rows, indent=2))
    plot_comparison(rows, args.out / "compare.png")
    print(f"wrote compare.json and compare.png to {args.out}")
    return rows
