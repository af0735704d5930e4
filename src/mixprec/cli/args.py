"""The ``mixprec`` command line: its parser, option types and defaults.

:func:`build_parser` builds the ``train`` and ``compare`` sub-commands, which share
the training options. A bad option is a :class:`UsageError`: one line on stderr and
exit code 2, never a usage dump.

>>> args = build_parser().parse_args(["train", "--epochs", "3", "--loss-scale", "1024"])
>>> args.command, args.level, args.epochs, args.loss_scale
('train', 'O2', 3, '1024')
>>> build_parser().parse_args(["train", "--epochs", "0"])
Traceback (most recent call last):
...
mixprec.cli.args.UsageError: argument --epochs: expected a positive int, got '0'
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mixprec.train.loop import AMP_LEVELS
from mixprec.train.models import MODEL_NAMES

__all__ = ["DEFAULTS", "UsageError", "build_parser"]

#: Defaults of the training options (``--epochs`` is resolved late: ``--resume`` keeps its own).
DEFAULTS = {"level": "O2", "model": "lenet5", "epochs": 15, "batch_size": 32, "lr": 1e-2, "seed": 0}


class UsageError(Exception):
    """A problem with the command line or its inputs: one line, exit code 2."""


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
        return value

    return parse


def _add_training_options(p: argparse.ArgumentParser, level_default: bool = True) -> None:
    if level_default:
        p.add_argument(
            "--level",
            choices=AMP_LEVELS,
            default=DEFAULTS["level"],
            help="amp level: O0 float32; O1 allow-list ops low; O2 all low but "
            "normalisation, fp32 master weights; O3 all low; auto; rewrite = graph "
            "rewrite (default: %(default)s)",
        )
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16"),
        default=None,
        help="low-precision dtype (default: float16 on CUDA, bfloat16 on CPU)",
    )
    p.add_argument(
        "--loss-scale",
        type=_loss_scale_arg,
        default="dynamic",
        help="'dynamic', 'none' or a fixed number (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default=DEFAULTS["model"],
        help="network to train (default: %(default)s)",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help=".npz (arrays x, y) or .csv (last column = label) file; "
        "default: the embedded 8x8 digits",
    )
    p.add_argument(
        "--epochs",
        type=_positive(int),
        default=None,
        help=f"epochs in total (default: {DEFAULTS['epochs']}; with --resume, the run's own)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive(int),
        default=DEFAULTS["batch_size"],
        help="batch size (default: %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=_positive(float),
        default=DEFAULTS["lr"],
        help="peak AdamW learning rate of the one-cycle schedule (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS["seed"],
        help="seed for initialisation, data split and shuffling (default: %(default)s)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    p.add_argument(
        "--threads",
        type=_positive(int),
        default=None,
        help="CPU threads for PyTorch (default: PyTorch's choice); 1 is fastest for "
        "small models on a busy machine",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    """The ``mixprec`` parser, with its ``train`` and ``compare`` sub-commands."""
    parser = _Parser(prog="mixprec", description="Mixed-precision training for PyTorch.")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="{train,compare}"
    )
    train = sub.add_parser(
        "train",
        help="train a model and write metrics, plots and checkpoints",
        description="Train a model in mixed precision.",
    )
    _add_training_options(train)
    train.add_argument(
        "--out", type=Path, default=Path("runs/train"), help="output folder (default: %(default)s)"
    )
    train.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a previous run's output folder: continue from its last checkpoint "
        "with its settings (up to --epochs in total)",
    )
    compare = sub.add_parser(
        "compare",
        help="train at several levels and print one table",
        description="Train the same model at several amp levels.",
    )
    compare.add_argument(
        "--levels",
        default="O0,O1,O2,O3,rewrite",
        help="comma-separated amp levels (default: %(default)s)",
    )
    _add_training_options(compare, level_default=False)
    compare.add_argument(
        "--out",
        type=Path,
        default=Path("runs/compare"),
        help="output folder (default: %(default)s)",
    )
    return parser
