"""``mixprec compare``: train the same model at several amp levels and print one table.

A level may carry options after ``+``: ``O2+compile`` trains O2 under ``torch.compile``
(``--compile`` compiles every entry) and ``O2+fp8`` with float8 linear layers (dynamic
scaling; ``--fp8`` for every entry), so ``--levels O2,O2+compile,O2+fp8`` puts them
side by side.

Each level trains in a fresh process, so its peak memory is its own and not whatever
the levels before it left behind. The table (accuracy, loss, median step time, peak
memory, skipped steps) is also written to ``compare.json`` and plotted to
``compare.png`` in ``--out``.

Every entry is checked before any trains (its level and options, ``+fp8`` on the
model's layers, ``+compile`` on this platform). Progress is one line per level with
the elapsed time and an estimate of the rest. A level that fails (diverges, skips every
step, raises, or its process dies: the parent watches it, never waits blindly) is a row
with its ``status``, ``reason`` and ``exit_code``; the other levels still run,
``compare.json`` is always written, and the command then exits non-zero (3 when every
failed level diverged).
"""

from __future__ import annotations

import argparse
import errno
import multiprocessing
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from mixprec.cli._args import UsageError, fill_defaults
from mixprec.cli._train import (
    DIVERGED,
    _to_float8,
    _write_json,
    build_run,
    check_out_dir,
    load_data,
)
from mixprec.tools._memory import peak_rss_mib, reset_peak_rss
from mixprec.train._divergence import check_skipped
from mixprec.train._loop import AMP_LEVELS
from mixprec.train._plots import plot_comparison
from mixprec.train.callbacks import History
from mixprec.train.data import DataError
from mixprec.train.models import build_model

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
    fraction = args.max_skipped_fraction or 1.0  # a level that learned nothing failed
    check_skipped(int(model.optimizer.skipped_steps), len(step_times), fraction)
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


def _entry_args(args: argparse.Namespace, entry: str) -> tuple[str, argparse.Namespace]:
    level, options = parse_entry(entry)
    return level, argparse.Namespace(**{**vars(args), **{o: ENTRY_OPTIONS[o] for o in options}})


def _validate(args: argparse.Namespace, entries: list[str]) -> None:
    """Every entry's level and options, checked before anything trains or is written."""
    for entry in entries:
        parse_entry(entry)
    check_out_dir(args.out)
    _, _, classes, shape = load_data(args)  # fail on bad data before spawning anything
    for entry in entries:
        _, entry_args = _entry_args(args, entry)
        if entry_args.fp8:  # the model must have a layer that can run in float8
            try:
                _to_float8(build_model(args.model, classes, shape), entry_args)
            except UsageError as err:
                raise UsageError(f"--levels {entry}: {err}") from None
        if entry_args.compile:
            import torch._dynamo

            if not torch._dynamo.is_dynamo_supported():
                raise UsageError(
                    f"--levels {entry}: torch.compile is not supported with this Python and "
                    f"torch {torch.__version__}; leave +compile out"
                )


def _child(conn: Any, target: Callable[..., dict[str, Any]], args: Any, entry: str) -> None:
    """In the level's process: run it, send ``("ok", row)`` or ``(status, reason, code)``."""
    from mixprec.cli import _one_line

    try:
        outcome: tuple = ("ok", target(args, entry))
    except DIVERGED as err:
        outcome = ("diverged", _one_line(err), 3)
    except (UsageError, DataError, ValueError, TypeError) as err:
        outcome = ("failed", _one_line(err), 2)
    except OSError as err:
        code = 1 if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else 2
        outcome = ("failed", _one_line(err), code)
    except BaseException as err:  # noqa: BLE001 - reported as the level's failure
        outcome = ("failed", f"{type(err).__name__}: {_one_line(err)}"[:300], 1)
    conn.send(outcome)
    conn.close()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_level(
    args: argparse.Namespace,
    entry: str,
    target: Callable[..., dict[str, Any]] = _compare_one,
    poll_s: float = 0.2,
) -> tuple[str, Any, int]:
    """Run ``target(args, entry)`` in a fresh process; ``("ok", row, 0)`` or
    ``(status, reason, exit_code)``. A process that dies without answering (a crash in
    torch, the out-of-memory killer) is seen within ``poll_s``: nothing waits forever."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(send, target, args, entry), daemon=True)
    process.start()
    send.close()  # ours: the child's end stays open only in the child
    outcome: tuple | None = None
    try:
        while outcome is None:
            if receive.poll(poll_s):
                try:
                    outcome = receive.recv()
                except EOFError:  # the child died (its end closed) without a word
                    break
            elif not process.is_alive():
                if not receive.poll(0):
                    break
        process.join(timeout=30)
    finally:
        if process.is_alive():  # interrupted, or the child hangs after answering
            process.kill()
            process.join()
        receive.close()
    if outcome is None:
        return "failed", f"its process died ({_exit_text(process.exitcode)})", 1
    if outcome[0] == "ok":
        return "ok", outcome[1], 0
    return outcome[0], outcome[1], outcome[2]


def run_compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train each of ``--levels`` in its own process; print, save and plot the table."""
    from mixprec.cli import CompareFailed

    fill_defaults(args)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    if not levels:
        raise UsageError(f"--levels: no level in {args.levels!r}; e.g. O0,O2,O2+compile")
    _validate(args, levels)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t_start, took = time.perf_counter(), []
    for i, entry in enumerate(levels, 1):
        if not args.quiet:
            print(f"  [{i}/{len(levels)}] {entry}: training...", file=sys.stderr)
        t0 = time.perf_counter()
        status, found, code = run_level(args, entry)
        took.append(time.perf_counter() - t0)
        if status == "ok":
            rows.append({**found, "entry": entry, "status": "ok"})
        else:
            rows.append({"config": entry, "entry": entry, "status": status, "reason": found,
                         "exit_code": code})  # fmt: skip
        if not args.quiet:
            elapsed = time.perf_counter() - t_start
            eta = statistics.mean(took) * (len(levels) - i)
            what = rows[-1]["config"] if status == "ok" else f"{status}: {found}"
            print(
                f"  [{i}/{len(levels)}] {entry}: {what} in {took[-1]:.1f} s "
                f"(elapsed {elapsed:.0f} s, ETA {eta:.0f} s)",
                file=sys.stderr,
            )
    header = f"{'config':<25}{'accuracy':>9}{'loss':>8}{'ms/step':>9}{'peak MB':>9}{'skipped':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['config']:<25}  {r['status']} (exit {r['exit_code']}): {r['reason']}")
            continue
        print(
            f"{r['config']:<25}{r['accuracy']:>9.4f}{r['loss']:>8.4f}{r['step_ms']:>9.2f}"
            f"{r['peak_mb']:>9.0f}{r['skipped_steps']:>9d}"
        )
    _write_json(args.out / "compare.json", _finite(rows))
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        plot_comparison(ok, args.out / "compare.png")
    print(f"wrote compare.json{' and compare.png' if ok else ''} to {args.out}")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        code = (
            3
            if all(r["exit_code"] == 3 for r in failed)
            else max(r["exit_code"] for r in failed if r["exit_code"] != 3)
        )
        first = failed[0]
        raise CompareFailed(
            f"compare: {len(failed)} of {len(rows)} levels failed, first {first['entry']}: "
            f"{first['status']}: {first['reason']} (see {args.out / 'compare.json'})",
            code,
        )
    return rows


def _finite(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for strict JSON: a non-finite number becomes ``None`` (its row says why)."""
    import math

    return [
        {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
        for r in rows
    ]
