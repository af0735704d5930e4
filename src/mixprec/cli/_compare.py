"""``mixprec compare``: train the same model at several amp levels and print one table.

A level may carry options after ``+``: ``O2+compile`` trains O2 under ``torch.compile``
(``--compile`` compiles every entry) and ``O2+fp8`` with float8 linear layers (dynamic
scaling; ``--fp8`` for every entry), so ``--levels O2,O2+compile,O2+fp8`` puts them
side by side. A master-weight mode after ``+`` (``O2+split8``, ``lean+stochastic``: one
of :data:`~mixprec.cli._args.MASTER_WEIGHTS`) is ``--master-weights`` for that entry,
and wins over a ``--master-weights`` given for every entry.

Each level trains in a fresh process, so its peak memory is its own and not whatever
the levels before it left behind. The table (accuracy, loss, median step time, peak
memory, skipped steps) is also written to ``compare.json`` and plotted to
``compare.png`` in ``--out``.

Every entry is checked before any trains (its level and options, ``+fp8`` on the
model's layers, ``+compile`` on this platform, its master-weight mode on its level and
dtype). Progress goes to stderr (``--quiet`` drops it): a note first where this CPU
emulates an entry's dtype, then a line as each level starts, one per epoch as it
trains (sent by the level's process through its pipe) and one as it ends, with the
level's number, the elapsed time and an estimate of the rest from the levels done so
far::

      [2/3] O2: started (elapsed 9 s, ETA 18 s)
      [2/3] O2: epoch 1/15, loss 2.3021, 11.20 ms/step (0.5 s)
      ...
      [2/3] O2: O2 bfloat16 in 8.7 s (elapsed 18 s, ETA 9 s)

The table gives each level's median step time and the range of its epochs' medians
(:func:`table_lines`), and below it each level against the first, with a word where
the difference lies within that spread. Each level runs on one CPU thread unless
``--threads`` says otherwise, as ``mixprec train`` does.

A level that fails (diverges, skips every step, raises, its process dies, or it is
still running after ``--level-timeout`` seconds: stuck; the parent watches it, never
waits blindly, and stops it) is a row with its ``status`` (``diverged``, ``failed`` or
``timeout``), ``reason`` and ``exit_code``; the other levels still run, ``compare.json``
is always written, and the command then exits non-zero (3 when every failed level
diverged, else the largest other code: 1 for a timeout or a dead process).

Ctrl-C (SIGINT) stops the level running (its process ignores the signal and is
stopped by the parent, so nothing is left behind), writes ``compare.json`` with the
finished levels and the interrupted one (``status`` ``interrupted``), and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import multiprocessing
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec.amp._level_specs import LEVEL_SPECS, spec_of
from mixprec.cli._args import MASTER_WEIGHTS, UsageError, fill_defaults
from mixprec.cli._train import (
    DIVERGED,
    FLOAT16_STATE_EPS,
    _concrete,
    _to_float8,
    _write_json,
    build_run,
    check_master_weights_arg,
    check_out_dir,
    emulation_note,
    load_data,
)
from mixprec.tools._memory import peak_rss_mib, reset_peak_rss
from mixprec.train._divergence import check_skipped
from mixprec.train._loop import resolve_device
from mixprec.train._plots import plot_comparison
from mixprec.train.callbacks import History
from mixprec.train.data import DataError
from mixprec.train.models import build_model

#: What may follow a level after ``+`` in ``--levels``: the ``mixprec train`` option
#: it sets, and the value. A master-weight mode (one of
#: :data:`~mixprec.cli._args.MASTER_WEIGHTS`) may follow too: it sets ``--master-weights``.
ENTRY_OPTIONS = {
    "compile": ("compile", True),
    "fp8": ("fp8", "dynamic"),
    "adamw8bit": ("optimizer", "adamw8bit"),
}


def parse_entry(text: str) -> tuple[str, tuple[str, ...]]:
    """``"O2+compile"`` -> ``("O2", ("compile",))``; a ``UsageError`` names what is wrong.

    >>> parse_entry("O2+compile")
    ('O2', ('compile',))
    >>> parse_entry("O2+split8+compile")  # a master-weight mode, at most one per entry
    ('O2', ('split8', 'compile'))
    """
    level, *options = (part.strip() for part in text.split("+"))
    bad = [o for o in options if o not in ENTRY_OPTIONS and o not in MASTER_WEIGHTS]
    if level not in LEVEL_SPECS or bad:
        raise UsageError(
            f"--levels: unknown {'option ' + repr(bad[0]) if bad else 'level ' + repr(level)} "
            f"in {text!r}; levels: {', '.join(LEVEL_SPECS)}; options after '+': "
            f"{', '.join(ENTRY_OPTIONS)} or a master-weight mode ({', '.join(MASTER_WEIGHTS)}) "
            "(e.g. O2+compile, O2+split8, O2+split8+adamw8bit)"
        )
    modes = [o for o in options if o in MASTER_WEIGHTS]
    if len(modes) > 1:  # one optimizer steps one way
        raise UsageError(
            f"--levels: {text!r} names {len(modes)} master-weight modes ({', '.join(modes)}); "
            f"give one per entry, e.g. {level}+{modes[0]}"
        )
    return level, tuple(options)


def _entry_args(args: argparse.Namespace, entry: str) -> tuple[str, argparse.Namespace]:
    """The entry's level, and ``args`` with the options it carries after ``+`` set."""
    level, options = parse_entry(entry)
    chosen: dict[str, Any] = dict(ENTRY_OPTIONS[o] for o in options if o in ENTRY_OPTIONS)
    for mode in (o for o in options if o in MASTER_WEIGHTS):  # at most one: parse_entry
        chosen["master_weights"] = mode
    return level, argparse.Namespace(**{**vars(args), **chosen})


#: In a level's process: the pipe to the parent, for the epoch lines (set by :func:`_child`).
_to_parent: Any = None


def _tell_parent(message: dict[str, Any]) -> None:
    """Send ``("epoch", message)`` to the parent, which prints it (nothing if none)."""
    if _to_parent is not None:
        _to_parent.send(("epoch", message))


def epoch_step_ms(times: list[list[float]]) -> list[float]:
    """Each epoch's median step time in ms, the first epoch left out when there are more
    (it pays for warm-up: allocations, caches, compilation).

    >>> epoch_step_ms([[0.010, 0.002], [0.002, 0.0022, 0.0021], [0.0019, 0.002]])
    [2.1, 1.95]
    """
    kept = times[1:] if len(times) > 1 else times
    return [round(1000 * statistics.median(t), 6) for t in kept if t]


def _compare_one(args: argparse.Namespace, entry: str) -> dict[str, Any]:
    """Train one ``--levels`` entry in this (fresh) process and measure it."""
    level, args = _entry_args(args, entry)
    model, train, _, test, schedule = build_run(args, level)  # no validation: one test
    reset_peak_rss()  # count this level's training, not the imports before it
    step_times: list[list[float]] = []  # per epoch, seconds per step

    class _Timer(History):
        def on_epoch_begin(self, state):  # noqa: ANN001
            step_times.append([])
            self.t_epoch = time.perf_counter()

        def on_step_end(self, state):  # noqa: ANN001
            super().on_step_end(state)
            step_times[-1].append(1.0 / max(state.samples_per_s, 1e-9) * args.batch_size)

        def on_epoch_end(self, state):  # noqa: ANN001
            super().on_epoch_end(state)
            _tell_parent({
                "epoch": state.epoch, "epochs": args.epochs, "loss": state.metrics.get("loss"),
                "step_ms": 1000 * statistics.median(step_times[-1] or [math.nan]),
                "seconds": time.perf_counter() - self.t_epoch,
            })  # fmt: skip

    if torch.cuda.is_available() and model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train(args.epochs, train, callbacks=[schedule, _Timer()])
    steps = [t for epoch in step_times for t in epoch]
    per_epoch = epoch_step_ms(step_times)
    fraction = args.max_skipped_fraction or 1.0  # a level that learned nothing failed
    check_skipped(int(model.optimizer.skipped_steps), len(steps), fraction)
    final = model.eval(test)
    if model.device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = peak_rss_mib()
    config = model.amp_level
    if spec_of(model.amp_level).low_precision:
        config += f" {str(model.dtype).replace('torch.', '')}"
    if args.fp8:
        config += f" fp8-{args.fp8}"
    if args.master_weights:  # given, for this entry or every one: else the level's own
        config += f" masters-{args.master_weights}"
    if args.optimizer != "adamw":
        config += f" {args.optimizer}"
    if args.adam_eps == FLOAT16_STATE_EPS:  # the level keeps AdamW's state in float16
        config += f" eps-{FLOAT16_STATE_EPS:g}"
    if args.compile:
        config += " compiled"
    return {
        "config": config,
        "accuracy": final["accuracy"],
        "loss": final["loss"],
        "step_ms": 1000 * statistics.median(steps[len(steps) // 5 :] or steps),
        # The spread: the epochs' median step times (the first epoch's warm-up left out).
        "step_ms_epochs": per_epoch,
        "step_ms_range": [min(per_epoch), max(per_epoch)] if per_epoch else None,
        "peak_mb": peak_mb,
        "skipped_steps": int(model.optimizer.skipped_steps),
    }


def _validate(args: argparse.Namespace, entries: list[str]) -> None:
    """Every entry's level and options, checked before anything trains or is written."""
    for entry in entries:
        parse_entry(entry)
    check_out_dir(args.out)
    _, _, _, classes, shape = load_data(args)  # fail on bad data before spawning anything
    for entry in entries:
        level, entry_args = _entry_args(args, entry)
        mode = entry_args.master_weights
        # Name where the mode came from: the entry, or --master-weights for every entry.
        given = "" if mode in parse_entry(entry)[1] else f" with --master-weights {mode}"
        check_master_weights_arg(entry_args, level, f"--levels {entry}{given}")
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
    """In the level's process: run it, send ``("ok", row)`` or ``(status, reason, code)``.

    SIGINT is ignored here (the process started with it blocked and ignored, see
    :func:`_children_ignore_sigint`): Ctrl-C is the parent's to handle, which stops this
    process itself, so no level prints a traceback or half-answers.
    """
    from mixprec.cli import _one_line

    global _to_parent
    _to_parent = conn  # the epoch lines go the same way as the outcome
    if hasattr(signal, "pthread_sigmask"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

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


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Start processes inside this block with SIGINT blocked and ignored.

    A process inherits both across ``exec``, so a level's process never turns Ctrl-C
    into a ``KeyboardInterrupt`` (not even while it imports torch, before any code of
    ours runs). In this process the signal is only blocked meanwhile, never lost: one
    that arrives is delivered once the block ends.
    """
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not (
        threading.main_thread()
    ):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)  # before unblocking: a pending one is ours
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def run_level(
    args: argparse.Namespace,
    entry: str,
    target: Callable[..., dict[str, Any]] = _compare_one,
    poll_s: float = 0.2,
    timeout_s: float | None = None,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[str, Any, int]:
    """Run ``target(args, entry)`` in a fresh process; ``("ok", row, 0)`` or
    ``(status, reason, exit_code)``. A process that dies without answering (a crash in
    torch, the out-of-memory killer) is seen within ``poll_s``, and one still running
    after ``timeout_s`` seconds (alive but stuck) is stopped: ``("timeout", reason, 1)``.
    Nothing waits forever, and no process outlives the call (Ctrl-C here included).
    What the level tells as each epoch ends goes to ``on_epoch`` as it arrives."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(send, target, args, entry), daemon=True)
    with _children_ignore_sigint():
        process.start()
    send.close()  # ours: the child's end stays open only in the child
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    outcome: tuple | None = None
    timed_out = False
    try:
        while outcome is None:
            if receive.poll(poll_s):
                try:
                    outcome = receive.recv()
                except EOFError:  # the child died (its end closed) without a word
                    break
                if outcome[0] == "epoch":  # a line of progress, not the answer
                    if on_epoch is not None:
                        on_epoch(outcome[1])
                    outcome = None
            elif not process.is_alive():
                if not receive.poll(0):
                    break
            elif deadline is not None and time.monotonic() > deadline:
                timed_out = True
                break
        if not timed_out:
            process.join(timeout=30)
    finally:
        if process.is_alive():  # stuck, interrupted, or it hangs after answering
            process.kill()
            process.join()
        receive.close()
    if timed_out:
        return (
            "timeout",
            f"still running after {timeout_s:g} s (--level-timeout): stopped",
            1,
        )
    if outcome is None:
        return "failed", f"its process died ({_exit_text(process.exitcode)})", 1
    if outcome[0] == "ok":
        return "ok", outcome[1], 0
    return outcome[0], outcome[1], outcome[2]


#: The function each level's process runs, ``target(args, entry) -> row`` (a picklable
#: module-level function: the process is spawned). A wrapper may replace it, e.g. to
#: measure more, or a test, to make a level hang.
level_target: Callable[..., dict[str, Any]] = _compare_one


def run_compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train each of ``--levels`` in its own process; print, save and plot the table."""
    from mixprec.cli import CompareFailed

    fill_defaults(args)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    if not levels:
        raise UsageError(f"--levels: no level in {args.levels!r}; e.g. O0,O2,O2+compile")
    _validate(args, levels)
    device = resolve_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    progress = _Progress(len(levels), quiet=args.quiet)
    if not args.quiet:
        for note in _emulation_notes(args, levels, device):
            print(note, file=sys.stderr, flush=True)
    for i, entry in enumerate(levels, 1):
        progress.start(i, entry)
        try:
            status, found, code = run_level(
                args, entry, target=level_target, timeout_s=getattr(args, "level_timeout", None),
                on_epoch=functools.partial(progress.epoch, i, entry),
            )  # fmt: skip
        except KeyboardInterrupt:
            rows.append({"config": entry, "entry": entry, "status": "interrupted",
                         "reason": "Ctrl-C (SIGINT)", "exit_code": 130})  # fmt: skip
            _save(args, rows, device)
            done = sum(r["status"] != "interrupted" for r in rows)
            raise KeyboardInterrupt(
                f"interrupted during level {entry} ({i}/{len(levels)}); "
                f"{args.out / 'compare.json'} holds the {done} level(s) done before it"
            ) from None
        if status == "ok":
            rows.append({**found, "entry": entry, "status": "ok"})
        else:
            rows.append({"config": entry, "entry": entry, "status": status, "reason": found,
                         "exit_code": code})  # fmt: skip
        progress.end(i, entry, rows[-1]["config"] if status == "ok" else f"{status}: {found}")
    for line in table_lines(rows):
        print(line)
    plotted = _save(args, rows, device)
    print(f"wrote compare.json{' and compare.png' if plotted else ''} to {args.out}")
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


def _emulation_notes(args: argparse.Namespace, entries: list[str], device: Any) -> list[str]:
    """The note for each low-precision dtype that this CPU emulates, naming the entries
    that train in it (their step times then say little about a CPU with the units)."""
    emulated: dict[str, list[str]] = {}
    for entry in entries:
        level, entry_args = _entry_args(args, entry)
        concrete, dtype = _concrete(entry_args, level, device)
        if spec_of(concrete).low_precision and emulation_note(device, dtype):
            emulated.setdefault(str(dtype), []).append(entry)
    notes = []
    for dtype_name, names in emulated.items():
        note = emulation_note(device, getattr(torch, dtype_name.removeprefix("torch.")))
        notes.append(f"{note}: {', '.join(names)} train in it")
    return notes


def _range_text(r: dict[str, Any]) -> str:
    low_high = r.get("step_ms_range")
    return "-" if not low_high else f"{low_high[0]:.2f}-{low_high[1]:.2f}"


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table ``mixprec compare`` prints, and below it the step times against the
    first level's, each with a word when it lies within the epochs' spread.

    ``ms/step`` is the median step time after the first fifth of the steps; ``epochs``
    the range of the epochs' median step times (the first epoch, warm-up, left out): on
    a busy machine the range is wide, and a difference inside it is no difference.

    >>> rows = [{"config": "O0", "status": "ok", "accuracy": 0.95, "loss": 0.2,
    ...          "step_ms": 2.0, "step_ms_range": [1.9, 2.3], "peak_mb": 300.0,
    ...          "skipped_steps": 0},
    ...         {"config": "O1 bfloat16", "status": "ok", "accuracy": 0.95, "loss": 0.2,
    ...          "step_ms": 2.1, "step_ms_range": [2.0, 2.2], "peak_mb": 310.0,
    ...          "skipped_steps": 0}]
    >>> print(*table_lines(rows), sep=chr(10))
    config                    accuracy    loss  ms/step        epochs  peak MB  skipped
    -----------------------------------------------------------------------------------
    O0                          0.9500  0.2000     2.00     1.90-2.30      300        0
    O1 bfloat16                 0.9500  0.2000     2.10     2.00-2.20      310        0
    step time against O0: O1 bfloat16 1.05x (within the epochs' spread: no measured difference)
    """
    # 25 wide, or wider for a long config ("lean bfloat16 masters-stochastic"), so the
    # numbers stay in their columns.
    width = max(25, 1 + max(len(r["config"]) for r in rows))
    header = (
        f"{'config':<{width}}{'accuracy':>9}{'loss':>8}{'ms/step':>9}{'epochs':>14}"
        f"{'peak MB':>9}{'skipped':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(
                f"{r['config']:<{width}}  {r['status']} (exit {r['exit_code']}): {r['reason']}"
            )
            continue
        lines.append(
            f"{r['config']:<{width}}{r['accuracy']:>9.4f}{r['loss']:>8.4f}{r['step_ms']:>9.2f}"
            f"{_range_text(r):>14}{r['peak_mb']:>9.0f}{r['skipped_steps']:>9d}"
        )
    ok = [r for r in rows if r["status"] == "ok"]
    if len(ok) > 1:
        first = ok[0]
        lines.append(
            f"step time against {first['config']}: " + "; ".join(_against(r, first) for r in ok[1:])
        )
    return lines


def _against(row: dict[str, Any], first: dict[str, Any]) -> str:
    """``row``'s step time as a ratio to ``first``'s, and whether the ranges overlap."""
    ratio = row["step_ms"] / first["step_ms"] if first["step_ms"] > 0 else math.nan
    text = f"{row['config']} {ratio:.2f}x"
    a, b = row.get("step_ms_range"), first.get("step_ms_range")
    if a and b and a[0] <= b[1] and b[0] <= a[1]:
        return f"{text} (within the epochs' spread: no measured difference)"
    return text


class _Progress:
    """``mixprec compare``'s progress lines on stderr: level i/N, elapsed, ETA."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.t_start = time.perf_counter()
        self.t_level = self.t_start
        self.took: list[float] = []

    def _times(self, left: int) -> str:
        elapsed = time.perf_counter() - self.t_start
        if not self.took:  # nothing to estimate from before the first level ends
            return f"elapsed {elapsed:.0f} s, ETA unknown"
        return f"elapsed {elapsed:.0f} s, ETA {statistics.mean(self.took) * left:.0f} s"

    def start(self, i: int, entry: str) -> None:
        self.t_level = time.perf_counter()
        if not self.quiet:
            print(f"  [{i}/{self.total}] {entry}: started ({self._times(self.total - i + 1)})",
                  file=sys.stderr, flush=True)  # fmt: skip

    def epoch(self, i: int, entry: str, info: dict[str, Any]) -> None:
        """A level's epoch has ended: its loss and median step time."""
        if self.quiet:
            return
        loss = info.get("loss")
        loss_text = f"loss {loss:.4f}, " if isinstance(loss, (int, float)) else ""
        print(f"  [{i}/{self.total}] {entry}: epoch {info['epoch']}/{info['epochs']}, {loss_text}"
              f"{info['step_ms']:.2f} ms/step ({info['seconds']:.1f} s)",
              file=sys.stderr, flush=True)  # fmt: skip

    def end(self, i: int, entry: str, what: str) -> None:
        self.took.append(time.perf_counter() - self.t_level)
        if not self.quiet:
            print(f"  [{i}/{self.total}] {entry}: {what} in {self.took[-1]:.1f} s "
                  f"({self._times(self.total - i)})", file=sys.stderr, flush=True)  # fmt: skip


def _save(args: argparse.Namespace, rows: list[dict[str, Any]], device: Any) -> bool:
    """Write ``compare.json`` (every row) and ``compare.png`` (the levels that finished);
    whether there was anything to plot."""
    _write_json(args.out / "compare.json", _finite(rows))
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        epochs = f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}"
        data = "digits" if args.data is None else args.data.name
        title = f"mixprec compare: {args.model} on {data}, {epochs}, {device}"
        plot_comparison(ok, args.out / "compare.png", title=title)
    return bool(ok)


def _finite(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for strict JSON: a non-finite number becomes ``None`` (its row says why)."""
    import math

    return [
        {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
        for r in rows
    ]
