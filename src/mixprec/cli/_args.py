"""The ``mixprec`` command line: its parser, option types and defaults.

:func:`build_parser` builds the ``train`` and ``compare`` sub-commands, which share
the training options. A bad option is a :class:`UsageError`: one line on stderr and
exit code 2, never a usage dump.

Options left out parse to ``None``; :func:`fill_defaults` fills in :data:`DEFAULTS` and
says which options were given (a resumed run refuses given options that contradict it).

This module does not import torch: ``mixprec --help`` and ``mixprec --version`` print
without it (the choices come from :mod:`mixprec.train._names`).

>>> args = build_parser().parse_args(["train", "--epochs", "3"])
>>> sorted(fill_defaults(args))
['epochs']
>>> args.command, args.level, args.epochs, args.loss_scale
('train', 'auto', 3, None)
>>> build_parser().parse_args(["train", "--epochs", "0"])
Traceback (most recent call last):
...
mixprec.cli._args.UsageError: argument --epochs: expected a positive int, got '0'
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import typing
from pathlib import Path
from typing import Any

from mixprec.train._names import AMP_LEVELS, MODEL_NAMES
from mixprec.typing import Float8RecipeName, MasterWeightsMode

#: The largest ``--lr``: AdamW's first step is up to 10 x the learning rate (its bias
#: correction), and that must stay a float32 number (3.4e38) for the update to be made;
#: a larger one is refused instead of failing inside the optimizer.
LR_MAX = 3.4e37

#: CPU threads for PyTorch when ``--threads`` is left out. The built-in models are small
#: (LeNet-5 on 8x8 digits: 44k parameters), too small to share between threads: on a
#: 2-core CPU one thread trains them about as fast as two on a quiet machine, and many
#: times faster as soon as another process uses a core (the threads then wait for each
#: other at every operation). BENCHMARKS.md and docs/guides/cli.md give the figures.
DEFAULT_CPU_THREADS = 1

#: ``mixprec compare --level-timeout``: seconds a level may run before it counts as stuck.
COMPARE_LEVEL_TIMEOUT = 3600.0

#: ``--master-weights`` choices: the library's modes (``master_weights=``) as the command
#: line spells them, ``none`` for ``False``. Read from :data:`mixprec.typing.MasterWeightsMode`,
#: which loads without torch, as this module does (a test checks they match
#: :data:`mixprec.optim.masters.MASTER_WEIGHT_MODES`).
MASTER_WEIGHTS = (*typing.get_args(MasterWeightsMode), "none")

#: ``--fp8`` choices: the float8 recipes (:data:`mixprec.typing.Float8RecipeName`).
FP8_RECIPES: tuple[str, ...] = typing.get_args(Float8RecipeName)

#: ``--optimizer`` choices: torch's AdamW, or mixprec's 8-bit-state AdamW
#: (:class:`mixprec.optim.AdamW8bit`; 2 bytes of state per parameter, not 8).
OPTIMIZERS = ("adamw", "adamw8bit")

#: ``--level`` left out when one of :data:`HAND_PICKED` is given (:func:`fill_defaults`).
HAND_PICKED_LEVEL = "O2"
#: Options that choose the precision by hand (``--dtype``, ``--loss-scale``,
#: ``--master-weights``): given without ``--level``, the level is :data:`HAND_PICKED_LEVEL`.
HAND_PICKED = frozenset({"dtype", "loss_scale", "master_weights"})

#: Defaults of the training options, filled in after parsing (:func:`fill_defaults`), so
#: that a resumed run can tell a given option from a default. ``--level`` is ``auto``: the
#: level and dtype the hardware runs fast (mixed precision where it has the units for
#: it, float32 where low precision would be emulated), or :data:`HAND_PICKED_LEVEL`.
#: ``--loss-scale`` and ``--threads`` have no entry: left out, they are the level's own
#: loss scale (dynamic for float16, none for bfloat16, as in the library) and, on a CPU,
#: :data:`DEFAULT_CPU_THREADS`.
DEFAULTS = {
    "level": "auto",
    "model": "lenet5",
    "epochs": 15,
    "batch_size": 32,
    "lr": 1e-2,
    "seed": 0,
    "optimizer": "adamw",
}


def fill_defaults(args: argparse.Namespace) -> set[str]:
    """Put :data:`DEFAULTS` into the options left out; return the names of those given.

    ``--level`` left out is ``auto``, unless :data:`HAND_PICKED` options are given: a
    run whose precision is chosen by hand is O2, the level with float32 master weights
    (``auto`` picks its own dtype and loss scale by the hardware).

    >>> args = build_parser().parse_args(["train", "--dtype", "float16"])
    >>> sorted(fill_defaults(args)), args.level
    (['dtype'], 'O2')
    """
    given = {k for k, v in vars(args).items() if v is not None and v is not False}
    given.discard("command")
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None and hasattr(args, key):
            setattr(args, key, value)
    if hasattr(args, "level") and "level" not in given and given & HAND_PICKED:
        args.level = HAND_PICKED_LEVEL
    return given


class UsageError(Exception):
    """A problem with the command line or its inputs: one line, exit code 2."""


def version_text() -> str:
    """``mixprec X (torch Y)``, without importing torch where it is not imported yet.

    >>> version_text().startswith("mixprec ")
    True
    """
    import mixprec  # cheap: the package's names load on first use

    torch = sys.modules.get("torch")
    if torch is not None:
        torch_version = str(torch.__version__)
    else:
        try:  # the installed distribution's version, which torch.__version__ repeats
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            import torch

            torch_version = str(torch.__version__)
    return f"mixprec {mixprec.__version__} (torch {torch_version})"


class _VersionAction(argparse.Action):
    """``--version``: like argparse's own, with the text made when asked for."""

    def __init__(
        self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None
    ) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_text())  # standard output, as argparse's own version action
        parser.exit()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(message)


def _loss_scale_arg(text: str) -> str:
    if text in ("dynamic", "none"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--loss-scale must be 'dynamic', 'none' or a positive number, got {text!r}"
        ) from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--loss-scale must be positive and finite, got {text!r}")
    return text


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive {kind.__name__}, got {text!r}"
            ) from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite {kind.__name__}, got {text!r}")
        return value

    return parse


def _at_most(top: float, why: str) -> Any:
    positive = _positive(float)

    def parse(text: str) -> float:
        value = positive(text)
        if value > top:
            raise argparse.ArgumentTypeError(f"expected at most {top:g} ({why}), got {text!r}")
        return value

    return parse


def _path(text: str) -> Path:
    """A path that names something: ``--out ""`` would be the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected a path, got {text!r} (an empty path would mean the current folder; "
            "pass . to mean it)"
        )
    return Path(text)


def _add_training_options(p: argparse.ArgumentParser, command: str) -> None:
    """The options ``train`` and ``compare`` share; ``command`` words their help (compare
    has no ``--level``, ``--resume`` or ``--level auto`` of its own)."""
    train = command == "train"
    if train:
        p.add_argument(
            "--level",
            choices=AMP_LEVELS,
            default=None,
            help="amp level: O0 float32; O1 allow-list ops low; O2 all low but "
            "normalisation, fp32 master weights; O3 all low; lean = O3 with Kahan-compensated "
            "updates (bfloat16 accuracy near O2's at 8 bytes/param with AdamW); auto = by the hardware "
            "(O1 bfloat16 on a CPU with bfloat16 units, O2 bfloat16 on newer GPUs, O2 float16 "
            "+ loss scaling on older ones, else float32; the header says what it picked and "
            f"why); rewrite = graph rewrite (default: {DEFAULTS['level']}, or "
            f"{HAND_PICKED_LEVEL} when --dtype, --loss-scale or --master-weights is given)",
        )
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16"),
        default=None,
        help="low-precision dtype (default: float16 on CUDA, bfloat16 on CPU"
        + ("; --level auto picks its own)" if train else ", for every level but O0 and auto)"),
    )
    p.add_argument(
        "--loss-scale",
        type=_loss_scale_arg,
        default=None,
        help="'dynamic', 'none' or a fixed number (default: the level's own, as in the "
        "library: dynamic for float16, none for bfloat16 and float32)",
    )
    p.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default=None,
        help=f"network to train (default: {DEFAULTS['model']})",
    )
    p.add_argument(
        "--data",
        type=_path,
        default=None,
        help=".npz (arrays x, y) or .csv (last column = label) file, labels 0..C-1; "
        "default: the embedded 8x8 digits",
    )
    p.add_argument(
        "--epochs",
        type=_positive(int),
        default=None,
        help=f"epochs in total (default: {DEFAULTS['epochs']}"
        + (
            "; with --resume, the run's own, and a larger N extends the run to N epochs)"
            if train
            else ", for each level)"
        ),
    )
    p.add_argument(
        "--batch-size",
        type=_positive(int),
        default=None,
        help=f"batch size (default: {DEFAULTS['batch_size']})",
    )
    p.add_argument(
        "--lr",
        type=_at_most(LR_MAX, "larger steps overflow float32 weights"),
        default=None,
        help="peak AdamW learning rate of the one-cycle schedule, positive, at most "
        f"{LR_MAX:g} (default: {DEFAULTS['lr']})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"seed for initialisation, data split and shuffling (default: {DEFAULTS['seed']})",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if available"
        + ("; with --resume, the run's own)" if train else ")"),
    )
    p.add_argument(
        "--threads",
        type=_positive(int),
        default=None,
        help=f"CPU threads for PyTorch (default on a CPU: {DEFAULT_CPU_THREADS}, fastest for "
        "these small models, most of all when another process uses a core"
        + ("; with --resume, the run's own)" if train else ")"),
    )
    p.add_argument(
        "--fp8",
        nargs="?",
        const="dynamic",
        default=None,
        choices=FP8_RECIPES,
        help="run the linear layers whose sizes are multiples of 16 in float8 (forward and "
        "backward): per-tensor scales, dynamic (default) or delayed (amax history), or "
        "per-row scales, rowwise or rowwise_with_gw_hp (weight gradient in high precision)"
        + ("" if train else "; for every level (a single level: +fp8 in --levels)"),
    )
    p.add_argument(
        "--master-weights",
        choices=MASTER_WEIGHTS,
        default=None,
        metavar="MODE",
        help="what the optimizer steps for the low-precision parameters (bytes per "
        "parameter with AdamW): fp32 (14) float32 copies; split (12) the bfloat16 weight "
        "plus the copy's low 16 bits, the same steps as fp32; split8 (11) the weight plus an "
        "8-bit correction; kahan (8) compensated updates; stochastic (6) stochastic "
        "rounding; none: the parameters stepped as they are. split, split8 and stochastic "
        "need bfloat16; O0, O1 and rewrite keep float32 parameters (none only). Default: "
        "the level's own (O2 fp32, lean kahan, O3 none"
        + (
            "; with --resume, the run's own)"
            if train
            else "), for every entry (a single entry: +split8 in --levels, which wins over this)"
        ),
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="adamw (torch's) or adamw8bit (mixprec.optim.AdamW8bit: both moments in 8 "
        "bits, 2 bytes of state per parameter instead of 8; with --master-weights split8, "
        "7 bytes per parameter with bfloat16 gradients)"
        + (
            " (default: adamw; with --resume, the run's own)"
            if train
            else " (default: adamw), for every entry (a single entry: +adamw8bit in --levels)"
        ),
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run the network through torch.compile (every level; the first steps compile)"
        + ("" if train else "; a single level: +compile in --levels"),
    )
    p.add_argument(
        "--max-skipped-fraction",
        type=_at_most(1.0, "a fraction of the steps"),
        default=None,
        help="a run that skipped at least this fraction of its steps (inf/NaN gradients) "
        "fails with exit code 3 after saving (default: 1: a run that skipped every step)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help=(
            "no progress (otherwise a live bar on a terminal, one line per epoch elsewhere)"
            if train
            else "no progress lines (otherwise one line as each level starts and ends, with "
            "the elapsed time and an estimate of the rest, on stderr)"
        ),
    )


def _add_diagnose_command(sub: Any) -> None:
    diagnose = sub.add_parser(
        "diagnose",
        help="report which layers underflow or overflow a dtype, and the loss scale to use",
        description="Run a few batches through the model in float32 and report what a "
        "low-precision dtype would do to each layer.",
    )
    diagnose.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default=DEFAULTS["model"],
        help="network to diagnose (default: %(default)s)",
    )
    diagnose.add_argument(
        "--data",
        type=_path,
        default=None,
        help=".npz or .csv file as for train; default: the embedded digits",
    )
    diagnose.add_argument(
        "--dtype",
        choices=("float16", "bfloat16"),
        default="float16",
        help="the dtype to assess (default: %(default)s)",
    )
    diagnose.add_argument(
        "--batches",
        type=_positive(int),
        default=8,
        help="training batches to run (default: %(default)s)",
    )
    diagnose.add_argument(
        "--batch-size",
        type=_positive(int),
        default=DEFAULTS["batch_size"],
        help="batch size (default: %(default)s)",
    )
    diagnose.add_argument(
        "--tolerance",
        type=_positive(float),
        default=0.01,
        help="fraction of a tensor allowed to underflow (default: %(default)s)",
    )
    diagnose.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS["seed"],
        help="seed for initialisation and data split (default: %(default)s)",
    )
    diagnose.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    diagnose.add_argument("--threads", type=_positive(int), default=None, help="CPU threads")
    diagnose.add_argument(
        "--out",
        type=_path,
        default=Path("runs/diagnose"),
        help="output folder (default: %(default)s); a folder that already holds a report is "
        "refused unless --overwrite",
    )
    diagnose.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the report in --out: its files are deleted before the new one is written",
    )


def precheck(args: argparse.Namespace) -> None:
    """The checks that need no torch, made before a sub-command loads it (seconds): a
    ``--data`` file that is missing or of an unknown kind (but with ``--resume``, where the
    run's own data is used and a ``--data`` that differs is refused as such), an
    ``--out`` that is a file.

    >>> precheck(build_parser().parse_args(["train", "--data", "no-such-file.npz"]))
    Traceback (most recent call last):
    ...
    mixprec.cli._args.UsageError: --data no-such-file.npz: no such file; check the path
    """
    data = getattr(args, "data", None)
    if data is not None and getattr(args, "resume", None) is None:  # resumed: its own data
        suffix = data.suffix.lower()
        if suffix not in (".npz", ".csv"):
            raise UsageError(
                f"--data {data}: expected a .npz or .csv file, got {suffix or 'no suffix'!r}"
            )
        if not data.is_file():
            what = "a folder, not a file" if data.is_dir() else "no such file"
            raise UsageError(f"--data {data}: {what}; check the path")
    out = getattr(args, "out", None)
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; choose another path")


def build_parser() -> argparse.ArgumentParser:
    """The ``mixprec`` parser, with its ``train`` and ``compare`` sub-commands."""
    parser = _Parser(prog="mixprec", description="Mixed-precision training for PyTorch.")
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print mixprec's version and exit",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="{train,compare,diagnose}"
    )
    train = sub.add_parser(
        "train",
        help="train a model and write metrics, plots and checkpoints",
        description="Train a model in mixed precision. The training data is split into a "
        "training part and a validation part (val_accuracy, each epoch); the test set is "
        "evaluated once, at the end (test accuracy). Exit codes: 0 done, 2 bad input (one "
        "line, nothing written), 3 diverged (after saving), 1 the machine failed (e.g. disk "
        "full), 130 interrupted (resumable). Data parallel under torchrun (e.g. torchrun "
        "--nproc-per-node 2 -m mixprec train): --batch-size is the global batch; on bad "
        "input every process prints the same one error line and exits 2, and torchrun then "
        "adds its own failure summary (ChildFailedError, naming each rank's exit code 2) "
        "and exits 1.",
    )
    _add_training_options(train, "train")
    train.add_argument(
        "--out",
        type=_path,
        default=None,
        help="output folder (default: runs/train); a folder that already holds a run is "
        "refused unless --overwrite",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in --out: its files are deleted before the new run writes",
    )
    train.add_argument(
        "--resume",
        type=_path,
        default=None,
        help="a previous run's folder: continue it there, with its settings, from its "
        "newest readable checkpoint (--epochs N extends it to N epochs in total)",
    )
    compare = sub.add_parser(
        "compare",
        help="train at several levels and print one table",
        description="Train the same model, data and seed at several amp levels, each level "
        "in a fresh process (so its peak memory is its own), and print one table of test "
        "accuracy, loss, step time, peak memory and skipped steps; it is also written to "
        "compare.json and plotted to compare.png in --out. A level that fails or passes "
        "--level-timeout is a row with its reason; the others still run, and the command "
        "then exits non-zero. Nothing is resumed: a compare starts afresh each time.",
    )
    compare.add_argument(
        "--levels",
        default="O0,O1,O2,O3,rewrite",
        help="comma-separated amp levels, each optionally with +compile, +fp8, +adamw8bit "
        "and/or a master-weight mode (+fp32, +split, +split8, +kahan, +stochastic, +none; "
        "see --master-weights) (e.g. O2,O2+compile,O2+fp8,O2+split8+adamw8bit; default: "
        "%(default)s)",
    )
    _add_training_options(compare, "compare")
    compare.add_argument(
        "--level-timeout",
        type=_positive(float),
        default=COMPARE_LEVEL_TIMEOUT,
        metavar="SECONDS",
        help="a level still running after this long (stuck, or far slower than expected) "
        "is stopped and reported as timed out; the next level runs (default: %(default)g)",
    )
    compare.add_argument(
        "--out",
        type=_path,
        default=Path("runs/compare"),
        help="output folder for compare.json and compare.png (default: %(default)s)",
    )
    _add_diagnose_command(sub)
    return parser
