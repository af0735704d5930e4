"""The ``mixprec`` command: train a model in mixed precision and see whether it is healthy.

``mixprec train`` with no arguments trains LeNet-5 on the embedded 8x8 digits at amp
level O2 (float16 on CUDA, bfloat16 on a CPU) with dynamic loss scaling, shows
progress, and ends with the test accuracy. Into ``--out`` it writes ``config.json``,
``metrics.json``, ``metrics.csv``, plots (``loss.png``, ``accuracy.png``,
``loss_scale.png`` with skipped steps marked) and per-epoch checkpoints, from which
``--resume`` continues exactly.

``mixprec compare`` trains the same model at several levels, each in a fresh process
(so peak memory is that configuration's own), and prints one table.

Bad input (a missing data file, an unknown level, an output folder that is a file...)
is reported in one line on stderr with exit code 2, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.callbacks import CSVLogger, History, LRScheduler, ModelCheckpoint, ProgressBar
from mixprec.data import DataError, infer_num_classes, load_csv, load_npz, train_test_loaders
from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.memory import peak_rss_mib, reset_peak_rss
from mixprec.models import MODEL_NAMES, build_model
from mixprec.plots import plot_accuracy, plot_comparison, plot_loss, plot_loss_scale
from mixprec.train import AMP_LEVELS, Model, resolve_device

__all__ = ["main", "build_parser", "run_train", "run_compare"]

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


# -- inputs ------------------------------------------------------------------------------


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; choose another path")


def _load_data(args: argparse.Namespace):
    """Train and test loaders, the number of classes and one sample's shape."""
    if args.data is None:
        train, test = train_test_loaders(batch_size=args.batch_size, seed=args.seed)
    else:
        suffix = args.data.suffix.lower()
        if suffix not in (".npz", ".csv"):
            raise UsageError(
                f"--data {args.data}: expected a .npz or .csv file, got {suffix or 'no suffix'!r}"
            )
        x, y = (load_npz if suffix == ".npz" else load_csv)(args.data)
        train, test = train_test_loaders(x, y, batch_size=args.batch_size, seed=args.seed)
    x_all = train.dataset.tensors[0]
    classes = infer_num_classes(torch.cat([train.dataset.tensors[1], test.dataset.tensors[1]]))
    return train, test, classes, tuple(x_all.shape[1:])


def _loss_scale(text: str):
    if text == "dynamic":
        return DynamicLossScale()
    if text == "none":
        return NoOpLossScale()
    return StaticLossScale(float(text))


def _setup(args: argparse.Namespace, level: str):
    """Seeded data, model, Model wrapper and LR schedule for one configuration."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    train, test, classes, shape = _load_data(args)
    torch.manual_seed(args.seed)
    network = build_model(args.model, classes, shape)
    optimizer = torch.optim.AdamW(network.parameters(), lr=args.lr)
    steps = args.epochs * len(train)
    schedule = LRScheduler(
        torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=steps)
    )
    model = Model(
        network,
        torch.nn.CrossEntropyLoss(),
        optimizer,
        metrics=["accuracy", "loss"],
        amp_level=level,
        loss_scale_manager=None if level == "O0" else _loss_scale(args.loss_scale),
        dtype=args.dtype,
        device=device,
    )
    return model, train, test, schedule


# -- mixprec train -----------------------------------------------------------------------


def _resume_args(args: argparse.Namespace) -> tuple[argparse.Namespace, Path]:
    run = args.resume
    config_path = run / "config.json"
    checkpoints = sorted((run / "checkpoints").glob("epoch*.pt")) if run.is_dir() else []
    if not config_path.is_file() or not checkpoints:
        raise UsageError(f"--resume {run}: not a mixprec run folder with checkpoints")
    saved = json.loads(config_path.read_text())
    if args.epochs is not None and args.epochs != saved["epochs"]:
        raise UsageError(
            f"--epochs {args.epochs} differs from the resumed run's {saved['epochs']}: its "
            "learning-rate schedule is laid out over those epochs; leave --epochs out"
        )
    for key in ("level", "dtype", "loss_scale", "model", "batch_size", "lr", "seed", "epochs"):
        setattr(args, key, saved[key])
    args.data = None if saved["data"] is None else Path(saved["data"])
    return args, checkpoints[-1]


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """Train one configuration; write metrics, plots and checkpoints; return the summary."""
    checkpoint = None
    if args.resume is not None:
        args, checkpoint = _resume_args(args)
    elif args.epochs is None:
        args.epochs = DEFAULTS["epochs"]
    _check_out(args.out)
    model, train, test, schedule = _setup(args, args.level)  # input errors surface before writing
    out = args.out
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    config = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("command", "out", "resume", "quiet", "levels")
    }
    config["dtype"] = args.dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(
        f"mixprec train: {args.model} on {'digits' if args.data is None else args.data}, "
        f"level {args.level}, {model.dtype if args.level != 'O0' else torch.float32}, "
        f"loss scale {args.loss_scale}, {model.device}"
    )
    history = History()
    callbacks = [
        history,
        schedule,
        ProgressBar(disable=args.quiet),
        CSVLogger(out / "metrics.csv", append=checkpoint is not None),
        ModelCheckpoint(out / "checkpoints", keep_last=2),
    ]
    t0 = time.perf_counter()
    model.train(args.epochs, train, callbacks=callbacks, resume=checkpoint, eval_dataset=test)
    seconds = time.perf_counter() - t0
    final = model.eval(test)
    opt = model.optimizer
    summary = {
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "epochs": history.epochs[-1] if history.epochs else args.epochs,
        "steps": len(history.losses),
        "skipped_steps": int(opt.skipped_steps),
        "final_loss_scale": float(opt.loss_scale),
        "train_seconds": seconds,
        "history": {
            "loss": history.losses,
            "loss_scale": history.loss_scales,
            "skipped": history.skipped,
            "epochs": history.metrics,
        },
    }
    (out / "metrics.json").write_text(json.dumps({"config": config, **summary}, indent=2))
    epoch_loss = history.metrics.get("loss", [])
    plot_loss(history.losses, out / "loss.png", epoch_losses=epoch_loss)
    plot_accuracy(
        {
            "train": history.metrics.get("accuracy", []),
            "test": history.metrics.get("val_accuracy", []),
        },
        out / "accuracy.png",
    )
    plot_loss_scale(history.loss_scales, history.skipped, out / "loss_scale.png")
    print(
        f"test accuracy: {final['accuracy']:.4f}  test loss: {final['loss']:.4f}  "
        f"skipped steps: {summary['skipped_steps']}/{summary['steps']}  "
        f"loss scale: {summary['final_loss_scale']:g}  ({seconds:.1f} s)"
    )
    print(f"wrote metrics.json, metrics.csv, loss.png, accuracy.png, loss_scale.png to {out}")
    return summary


# -- mixprec compare ---------------------------------------------------------------------


def _compare_one(args: argparse.Namespace, level: str) -> dict[str, Any]:
    """Train one level in this (fresh) process and measure it."""
    model, train, test, schedule = _setup(args, level)
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
    return {
        "config": level if level == "O0" else f"{level} {str(model.dtype).replace('torch.', '')}",
        "accuracy": final["accuracy"],
        "loss": final["loss"],
        "step_ms": 1000 * statistics.median(step_times[len(step_times) // 5 :] or step_times),
        "peak_mb": peak_mb,
        "skipped_steps": int(model.optimizer.skipped_steps),
    }


def run_compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    args.epochs = DEFAULTS["epochs"] if args.epochs is None else args.epochs
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    bad = [lv for lv in levels if lv not in AMP_LEVELS]
    if bad or not levels:
        raise UsageError(
            f"--levels: unknown level(s) {bad or levels}; choose from {', '.join(AMP_LEVELS)}"
        )
    _check_out(args.out)
    _load_data(args)  # fail on bad data before spawning anything
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for level in levels:
        with ctx.Pool(1) as pool:  # a fresh process: its peak RSS is this level's own
            rows.append(pool.apply(_compare_one, (args, level)))
        if not args.quiet:
            print(f"  done: {rows[-1]['config']}", file=sys.stderr)
    header = f"{'config':<16}{'accuracy':>9}{'loss':>8}{'ms/step':>9}{'peak MB':>9}{'skipped':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['config']:<16}{r['accuracy']:>9.4f}{r['loss']:>8.4f}{r['step_ms']:>9.2f}"
            f"{r['peak_mb']:>9.0f}{r['skipped_steps']:>9d}"
        )
    (args.out / "compare.json").write_text(json.dumps(rows, indent=2))
    plot_comparison(rows, args.out / "compare.png")
    print(f"wrote compare.json and compare.png to {args.out}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mixprec`` command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            run_train(args)
        else:
            run_compare(args)
    except (UsageError, DataError) as err:
        print(f"mixprec: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as err:
        # Input the library rejected (it names the argument): still one line.
        print(f"mixprec: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
