"""``mixprec train``: train one configuration and write its metrics, plots and checkpoints.

:func:`build_run` turns parsed arguments into seeded loaders, a :class:`~mixprec.Model`
and its learning-rate schedule (``mixprec compare`` builds each level the same way).
:func:`run_train` trains, then writes into ``--out``: ``config.json``, ``metrics.json``,
``metrics.csv``, ``loss.png``, ``accuracy.png``, ``loss_scale.png`` and per-epoch
checkpoints, from which ``--resume`` continues exactly. Every input error surfaces
before anything is written.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.cli.args import DEFAULTS, UsageError
from mixprec.loss_scale import LossScale, loss_scale_from_spec
from mixprec.train.callbacks import CSVLogger, History, LRScheduler, ModelCheckpoint, ProgressBar
from mixprec.train.data import infer_num_classes, load_csv, load_npz, train_test_loaders
from mixprec.train.loop import Model, resolve_device
from mixprec.train.models import build_model
from mixprec.train.plots import plot_accuracy, plot_loss, plot_loss_scale

__all__ = ["run_train", "build_run", "check_out_dir", "load_data"]


# -- inputs ------------------------------------------------------------------------------


def check_out_dir(out: Path) -> None:
    """Refuse an ``--out`` that exists and is not a folder."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; choose another path")


def load_data(args: argparse.Namespace):
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


def _loss_scale(text: str) -> LossScale:
    # --loss-scale is checked by the parser: 'dynamic', 'none' or a positive number.
    return loss_scale_from_spec(text if text in ("dynamic", "none") else float(text))


def build_run(args: argparse.Namespace, level: str):
    """Seeded data, model, Model wrapper and LR schedule for one configuration.

    Returns ``(model, train_loader, test_loader, schedule)``.
    """
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    train, test, classes, shape = load_data(args)
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
        loss_scale=None if level == "O0" else _loss_scale(args.loss_scale),
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
    check_out_dir(args.out)
    # Every input error surfaces here, before anything is written.
    model, train, test, schedule = build_run(args, args.level)
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
