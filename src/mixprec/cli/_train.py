"""``mixprec train``: train one configuration and write its metrics, plots and checkpoints.

:func:`build_run` turns parsed arguments into seeded loaders, a :class:`~mixprec.Model`
and its learning-rate schedule (``mixprec compare`` builds each level the same way).
:func:`run_train` trains, then writes into ``--out``: ``config.json``, ``metrics.json``,
``metrics.csv``, ``loss.png``, ``accuracy.png``, ``loss_scale.png`` and per-epoch
checkpoints, from which ``--resume`` continues exactly (the folder rules are in
:mod:`mixprec.cli._run_folder`). Every input error surfaces before anything is written.

A run that diverges (the loss scale collapses, the loss stays NaN, a weight becomes
non-finite, or every step was skipped: ``--max-skipped-fraction``) still writes its
metrics and plots up to that point, keeps the checkpoints of the epochs it finished,
and then raises; the command exits with code 3. The run folder is locked
(:class:`~mixprec.cli._run_folder.RunLock`) from before the first check to the end; an
interrupted run (Ctrl-C) raises :class:`Interrupted` (exit 130) and is resumable from
its last finished epoch. ``metrics.json`` is strict JSON: a NaN or infinite value is
written as ``null`` and ``non_finite`` says which were.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from mixprec.amp._auto import choose_auto, cpu_has_fast
from mixprec.amp._level_specs import check_master_weights, float16_optimizer_state, spec_of
from mixprec.cli._args import DEFAULT_CPU_THREADS, HAND_PICKED_LEVEL, UsageError, fill_defaults
from mixprec.cli._run_folder import (
    KEEP_LAST,
    RUN_FORMAT,
    RunLock,
    check_new_out,
    pick_checkpoint,
    prepare_out,
    resume_settings,
)
from mixprec.cli._torchrun import failing
from mixprec.diagnostics import DEFAULT_EVERY
from mixprec.loss_scale import LossScale, ScaleCollapseError, loss_scale_from_spec
from mixprec.optim import AdamW8bit
from mixprec.train._atomic import atomic_write
from mixprec.train._distributed import (
    DistributedModel,
    for_this_rank,
    is_distributed,
    is_main_process,
    process_group_from_env,
    run_on_main,
    shard_loader,
)
from mixprec.train._divergence import DivergenceError, check_skipped
from mixprec.train._loop import (
    Model,
    check_master_weights_option,
    resolve_device,
    resolve_dtype,
)
from mixprec.train._plots import plot_accuracy, plot_loss, plot_loss_scale
from mixprec.train.callbacks import (
    Callback,
    CSVLogger,
    Float8Monitor,
    History,
    LRScheduler,
    ModelCheckpoint,
    PrecisionMonitor,
    ProgressBar,
)
from mixprec.train.data import (
    DataError,
    infer_num_classes,
    load_csv,
    load_npz,
    train_val_test_loaders,
)
from mixprec.train.models import build_model

if TYPE_CHECKING:
    from mixprec.float8 import Float8Report
    from mixprec.typing import Level, MasterWeights


#: What ``Model.train`` raises when a run diverges; the command exits with code 3.
DIVERGED = (ScaleCollapseError, DivergenceError)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run; the message says how to continue. Exit code 130."""


# -- inputs ------------------------------------------------------------------------------


def check_out_dir(out: Path) -> None:
    """Refuse an ``--out`` that exists and is not a folder."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; choose another path")


def load_data(args: argparse.Namespace):
    """Train, validation and test loaders, the number of classes and one sample's shape.

    The validation part is carved from the training part
    (:func:`~mixprec.train.data.train_val_test_loaders`): ``val_accuracy`` each epoch
    never looks at the test set, which is evaluated once, at the end.
    """
    if args.data is None:
        train, val, test = train_val_test_loaders(batch_size=args.batch_size, seed=args.seed)
    else:
        suffix = args.data.suffix.lower()
        if suffix not in (".npz", ".csv"):
            raise UsageError(
                f"--data {args.data}: expected a .npz or .csv file, got {suffix or 'no suffix'!r}"
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x, y = (load_npz if suffix == ".npz" else load_csv)(args.data)
        for warning in caught:  # e.g. a header row of column numbers: one line each
            print(f"mixprec: warning: {' '.join(str(warning.message).split())}", file=sys.stderr)
        try:
            train, val, test = train_val_test_loaders(
                x, y, batch_size=args.batch_size, seed=args.seed
            )
        except DataError as err:
            raise DataError(f"--data {args.data}: {err}") from None
    labels = [loader.dataset.tensors[1] for loader in (train, val, test)]
    classes = infer_num_classes(torch.cat(labels))
    return train, val, test, classes, tuple(train.dataset.tensors[0].shape[1:])


def _loss_scale(text: str) -> LossScale:
    # --loss-scale is checked by the parser: 'dynamic', 'none' or a positive number.
    return loss_scale_from_spec(text if text in ("dynamic", "none") else float(text))


def _to_float8(network: torch.nn.Module, args: argparse.Namespace) -> Float8Report:
    """``--fp8``: the network's eligible linear layers in float8 (before the amp level)."""
    # Imported here: mixprec.float8 loads for --fp8 runs only.
    from mixprec.float8 import convert_to_float8

    report = convert_to_float8(network, args.fp8)
    if not report.converted:
        reasons = "; ".join(f"{name}: {why}" for name, why in report.skipped.items())
        raise UsageError(
            f"--fp8: no linear layer of --model {args.model} can run in float8 ({reasons})"
        )
    return report


def master_weights_value(args: argparse.Namespace) -> MasterWeights | None:
    """``--master-weights`` as ``Model(master_weights=)`` takes it: ``None`` (left out)
    for the level's own, ``False`` for ``none``, else the mode's name."""
    text = getattr(args, "master_weights", None)
    if text is None:
        return None
    return False if text == "none" else text


def check_master_weights_arg(args: argparse.Namespace, level: str, where: str) -> None:
    """Refuse a ``--master-weights`` mode that ``level`` (and the dtype it would train
    in) cannot take, as a :class:`UsageError` starting with ``where`` (the option and
    its value as given).

    The rules are the library's (:func:`~mixprec.amp._level_specs.check_master_weights`, and
    ``Model``'s own for the rewrite level), asked here before anything is built or
    written, so a bad pair is one line and an empty folder rather than a refusal once
    the model is built. ``auto`` is resolved first, as ``build_run`` will resolve it.
    """
    value = master_weights_value(args)
    if value is None:  # the level's own mode: always fits
        return
    device = resolve_device(args.device)  # a bad --device is its own error, not ours
    if spec_of(level).by_hardware:
        level, dtype = _concrete(args, level, device)
        where += f" with --level auto ({level}, {_name(dtype)} on this machine)"
    else:
        dtype = _concrete(args, level, device)[1]
    try:
        check_master_weights_option(value, level)  # the rewrite keeps float32 parameters
        check_master_weights(value, cast("Level", level), dtype)
    except ValueError as err:  # the library's reason and fix, after the option
        raise UsageError(f"{where}: {err}") from None


#: AdamW's ``eps`` where a level keeps its state in float16: the default, 1e-8, is below
#: float16's smallest normal number (6.1e-5), and ``amp.initialize`` refuses it there.
FLOAT16_STATE_EPS = 1e-4


def _concrete(
    args: argparse.Namespace, level: str, device: torch.device
) -> tuple[str, torch.dtype]:
    """The level and dtype a run trains in: ``auto`` resolved as ``Model`` resolves it."""
    if spec_of(level).by_hardware:
        level, dtype, _ = choose_auto(device)
        return level, dtype
    return level, resolve_dtype(args.dtype, device)


def _adam_eps(args: argparse.Namespace, level: str, device: torch.device) -> float:
    """AdamW's default ``eps``, or :data:`FLOAT16_STATE_EPS` where ``level`` steps
    float16 parameters without float32 masters (O3 and lean in float16, O2 with
    ``--master-weights none``): the command has no ``eps`` option to pass."""
    level, dtype = _concrete(args, level, device)
    if spec_of(level).storage == "float32":  # float32 parameters: float32 state
        return 1e-8
    masters = check_master_weights(master_weights_value(args), cast("Level", level), dtype)
    return FLOAT16_STATE_EPS if float16_optimizer_state(level, dtype, masters) else 1e-8


def settle_threads(args: argparse.Namespace, device: torch.device) -> None:
    """Set PyTorch's CPU threads: ``--threads``, or on a CPU :data:`DEFAULT_CPU_THREADS`
    (``args.threads`` then holds it, and ``args.chosen["threads"]`` says why)."""
    if args.threads is None and device.type == "cpu":
        args.threads = DEFAULT_CPU_THREADS
        _chosen(args)["threads"] = (
            f"threads {DEFAULT_CPU_THREADS}: fastest for these small models, most of all on a "
            "busy CPU (--threads N to change)"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def _chosen(args: argparse.Namespace) -> dict[str, str]:
    """What the command chose for options left out, and why (printed in the header)."""
    if getattr(args, "chosen", None) is None:
        args.chosen = {}
    return args.chosen


def settle_loss_scale(args: argparse.Namespace, level: str, dtype: torch.dtype) -> None:
    """``--loss-scale`` left out: the level's own in ``dtype`` (the library's rule,
    :meth:`~mixprec.amp.LevelSpec.default_loss_scale`): ``dynamic`` for float16, ``none``
    for bfloat16 and float32. ``args.loss_scale`` then holds it, as ``config.json`` does."""
    if args.loss_scale is not None:
        return
    spec = spec_of(level)
    args.loss_scale = spec.default_loss_scale(dtype).kind if spec.low_precision else "none"
    if not spec.low_precision:
        return
    why = {
        "none": "float32's exponent range needs none; an overflowing step is still skipped",
        "dynamic": "its gradients underflow without one",
    }
    _chosen(args)["loss_scale"] = (
        f"loss scale {args.loss_scale}: level {level}'s own for {_name(dtype)} "
        f"({why[args.loss_scale]}; --loss-scale to choose)"
    )


def build_run(args: argparse.Namespace, level: str):
    """Seeded data, model, Model wrapper and LR schedule for one configuration.

    Options left out that depend on the hardware or the level (``--threads``,
    ``--loss-scale``) are settled here, into ``args``. Returns ``(model, train_loader,
    val_loader, test_loader, schedule)``.
    """
    device = resolve_device(args.device)
    settle_threads(args, device)
    settle_loss_scale(args, *_concrete(args, level, device))
    train, val, test, classes, shape = load_data(args)
    train = shard_loader(train, args.seed)  # under torchrun: this rank's share
    torch.manual_seed(args.seed)
    network = build_model(args.model, classes, shape)
    if getattr(args, "fp8", None):
        args.float8_report = _to_float8(network, args)
    eps = args.adam_eps = _adam_eps(args, level, device)  # (the header notes it)
    optimizer: torch.optim.Optimizer = (
        AdamW8bit(network.parameters(), lr=args.lr, eps=eps)
        if args.optimizer == "adamw8bit"
        else torch.optim.AdamW(network.parameters(), lr=args.lr, eps=eps)
    )
    steps = args.epochs * len(train)
    schedule = LRScheduler(
        torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=steps)
    )
    concrete = _concrete(args, level, device)[0]
    model = (DistributedModel if is_distributed() else Model)(
        network,
        torch.nn.CrossEntropyLoss(),
        optimizer,
        metrics=["accuracy", "loss"],
        amp_level=level,
        loss_scale=_loss_scale(args.loss_scale) if spec_of(concrete).low_precision else None,
        dtype=args.dtype,
        device=device,
        compile=bool(getattr(args, "compile", False)),
        master_weights=master_weights_value(args),
    )
    _check_range(args, model, train, val, test)
    return model, train, val, test, schedule


def _check_range(args: argparse.Namespace, model: Model, *loaders: Any) -> None:
    """Refuse features beyond the range of the dtype the level computes them in (float16
    tops out at 65504): every batch holding one would overflow and be skipped."""
    if not spec_of(model.amp_level).low_precision or model.dtype != torch.float16:
        return  # float32 and bfloat16 share float32's range, checked when the data loaded
    top = torch.finfo(model.dtype).max
    for loader in loaders:
        x = loader.dataset.tensors[0]
        big = x.abs() > top
        if bool(big.any()):
            i = int(big.flatten(1).any(1).nonzero()[0])
            value = float(x[i].flatten()[big[i].flatten()][0])
            source = "the digits" if args.data is None else str(args.data)
            raise DataError(
                f"{source}: feature value {value:g} (sample {i}) is beyond float16's range "
                f"({top:g}), which level {model.amp_level} computes in; rescale the features "
                "(e.g. standardise them) or use --dtype bfloat16"
            )


# -- mixprec train -----------------------------------------------------------------------


def _interrupted_text(out: Path) -> str:
    """The one line of an interrupted run: where it stopped and how to go on."""
    saved = ModelCheckpoint(out / "checkpoints").existing()
    how = (
        f"resume it from {saved[-1].name} with: mixprec train --resume {out}"
        if saved
        else f"no epoch had finished; start again with: mixprec train --out {out} --overwrite"
    )
    return f"interrupted in {out}; {how}"


def _relayout(schedule: LRScheduler, optimizer: Any, lr: float, total_steps: int) -> None:
    """Lay the one-cycle schedule out over ``total_steps`` and go on from the step the
    loaded state reached (a run extended with ``--resume --epochs N``)."""
    saved = schedule.scheduler.state_dict()
    if saved["total_steps"] == total_steps:
        return
    fresh = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=total_steps)
    layout = fresh.state_dict()
    fresh.load_state_dict(
        {**saved, "total_steps": total_steps, "_schedule_phases": layout["_schedule_phases"]}
    )
    fresh.last_epoch -= 1
    fresh.step()  # the learning rate and momentum of this step on the new layout
    schedule.scheduler = fresh


class _RunStart(Callback):
    """Writes ``config.json`` once training begins: after a resumed checkpoint loaded."""

    def __init__(self, out: Path, config: dict[str, Any], relayout: Any) -> None:
        self.out, self.config, self.relayout = out, config, relayout

    def on_train_begin(self, state: Any) -> None:
        self.relayout()
        if is_main_process():  # under torchrun, rank 0 alone writes
            (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
            _write_json(self.out / "config.json", self.config)


def _write_json(path: Path, value: Any) -> None:
    text = json.dumps(value, indent=2, allow_nan=False)
    atomic_write(path, lambda f: f.write(text.encode()), fsync=False)


def _strict(value: Any, where: str, notes: dict[str, str]) -> Any:
    """``value`` with NaN and infinities as ``None``; ``notes[where]`` counts them."""
    if isinstance(value, float) and not math.isfinite(value):
        kind = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        counts = notes.setdefault(where, {})
        counts[kind] = counts.get(kind, 0) + 1
        return None
    if isinstance(value, dict):
        return {k: _strict(v, f"{where}.{k}" if where else str(k), notes) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v, where, notes) for v in value]
    return value


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # as --dtype spells it


def run_dtype(model: Model) -> str:
    """The dtype a run computes in, as ``--dtype`` spells it: ``float32`` at O0."""
    return _name(model.dtype) if spec_of(model.amp_level).low_precision else "float32"


def emulation_note(device: torch.device, dtype: torch.dtype) -> str | None:
    """The note for low precision that this CPU emulates (no units for it), or ``None``."""
    if device.type != "cpu" or cpu_has_fast(dtype):
        return None
    name = _name(dtype)
    return (
        f"note: this CPU has no {name} units, so {name} is emulated here and runs far slower "
        "than float32 (leave --level and --dtype out: auto picks float32 on such a CPU)"
    )


def _hardware_notes(model: Model, args: argparse.Namespace) -> list[str]:
    """Why the run trains as it does: what ``auto`` picked, the threads and the loss scale
    the command chose for options left out, and a warning for emulated low precision."""
    notes = []
    if model.auto_reason is not None:
        notes.append(f"auto: level {model.amp_level}, {run_dtype(model)}: {model.auto_reason}")
    notes += list(_chosen(args).values())
    if spec_of(model.amp_level).low_precision:
        emulated = emulation_note(model.device, model.dtype)
        notes += [emulated] if emulated else []
    return notes


def _config(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    return {
        "format": RUN_FORMAT,
        "level": getattr(args, "requested_level", args.level),
        "amp_level": model.amp_level,
        "dtype": run_dtype(model),  # float32 at O0 (auto on a CPU without bfloat16 units)
        "loss_scale": args.loss_scale,
        "model": args.model,
        "data": None if args.data is None else str(args.data),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "device": args.device,
        "threads": args.threads,
        "compile": bool(getattr(args, "compile", False)),
        "fp8": getattr(args, "fp8", None),
        # As given (``none`` included); null: the level's own mode.
        "master_weights": getattr(args, "master_weights", None),
        "optimizer": args.optimizer,
        "max_skipped_fraction": getattr(args, "max_skipped_fraction", None),
    }


def _write_results(
    out: Path, config, model, history, seconds, final, diverged=None, precision=None, float8=None,
    sizes=None,
) -> dict:  # fmt: skip
    opt = model.optimizer
    val = history.metrics
    summary = {
        "test_accuracy": None if final is None else final["accuracy"],
        "test_loss": None if final is None else final["loss"],
        # The last epoch's validation numbers (the part carved from the training data).
        "val_accuracy": val["val_accuracy"][-1] if val.get("val_accuracy") else None,
        "val_loss": val["val_loss"][-1] if val.get("val_loss") else None,
        "samples": sizes,
        "epochs": history.epochs[-1] if history.epochs else 0,
        "steps": len(history.losses),
        "skipped_steps": int(opt.skipped_steps),
        "final_loss_scale": float(opt.loss_scale),
        "train_seconds": seconds,
        "diverged": diverged,
        "history": {
            "loss": history.losses,
            "loss_scale": history.loss_scales,
            "skipped": history.skipped,
            "epochs": history.metrics,
        },
    }
    if precision is not None:  # gradient underflow/overflow samples (mixprec.diagnostics)
        summary["precision"] = precision.summary()
    if float8 is not None:  # per-layer float8 amax, saturation and overflows, per epoch
        summary["float8"] = float8.summary()
    if not is_main_process():  # under torchrun, rank 0 alone writes
        return summary
    counts: dict[str, dict[str, int]] = {}
    strict = _strict({"config": config, **summary}, "", counts)
    if counts:  # strict JSON: say what the nulls stand for
        strict["non_finite"] = {
            where: "written as null: " + ", ".join(f"{n} {kind}" for kind, n in found.items())
            for where, found in counts.items()
        }
    _write_json(out / "metrics.json", strict)
    plot_loss(history.losses, out / "loss.png", epoch_losses=history.metrics.get("loss", []))
    plot_accuracy(
        {
            "train": history.metrics.get("accuracy", []),
            "validation": history.metrics.get("val_accuracy", []),
        },
        out / "accuracy.png",
        test=summary["test_accuracy"],
    )
    underflow = None if precision is None else precision.underflow_series()
    plot_loss_scale(
        history.loss_scales, history.skipped, out / "loss_scale.png", underflow=underflow,
        dtype=config["dtype"], loss_scale=config["loss_scale"],
    )  # fmt: skip
    return summary


@process_group_from_env  # data parallel under torchrun (mixprec.train._distributed)
def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """Train one configuration; write metrics, plots and checkpoints; return the summary.

    Raises :class:`UsageError` (and writes nothing) for bad input, and one of
    :data:`DIVERGED` after writing what it has when the run diverges.
    """
    given = fill_defaults(args)
    checkpoint, done, warning, built = None, 0, None, None
    held: list[RunLock] = []  # the run folder's lock, once rank 0 has taken it
    try:
        try:
            checkpoint, done, warning, built = _check_inputs(args, given, held)
        except Exception as err:  # noqa: BLE001 - every rank hears of it, then it is raised
            _agree(err)
        _agree(None)
        # Every input error surfaces here, before anything is written.
        model, train, val, test, schedule = built or build_run(args, args.level)
        out = args.out
        if checkpoint is None:
            run_on_main(prepare_out, out, args.overwrite)
    except BaseException:
        for lock in held:
            lock.release(remove_created=checkpoint is None)
        raise
    try:
        return _train(args, model, train, val, test, schedule, checkpoint, done, warning)
    finally:
        for lock in held:
            lock.release()


def _check_inputs(args: argparse.Namespace, given: set[str], held: list[RunLock]) -> tuple:
    """Check ``--resume`` or ``--out`` and settle ``args`` (in place), taking the run
    folder's lock on rank 0 into ``held``; ``(checkpoint, epochs done, warning, run)``.

    A new run is built (``run``, :func:`build_run`'s tuple) before its folder is looked
    at, so that bad options or data are reported as such, not hidden behind a folder
    that already holds a run; nothing is written before every check has passed.
    """
    checkpoint, done, warning, run = None, 0, None, None
    if args.resume is not None:
        if args.resume.is_dir() and is_main_process():  # before the folder is read
            held.append(RunLock(args.resume, "--resume").acquire())
        resume_settings(args, given)  # settles args in place
        checkpoint, done, warning = pick_checkpoint(args.resume, resolve_device(args.device))
        if args.epochs < done:
            raise UsageError(
                f"--epochs {args.epochs}: the run in {args.resume} has already done {done} "
                f"epochs; pass --epochs {done} or more"
            )
        if (args.resume / "metrics.csv").is_file():
            CSVLogger.read(args.resume / "metrics.csv")  # damaged: refused, by name
    else:
        # Before the folder is created or locked: a bad option writes nothing at all.
        if spec_of(args.level).by_hardware and "dtype" in given:
            raise UsageError(
                f"--dtype {args.dtype} contradicts --level auto, which picks the dtype by "
                "the hardware; leave --level out (--dtype alone trains at "
                f"{HAND_PICKED_LEVEL}), or name a level"
            )
        check_master_weights_arg(args, args.level, f"--master-weights {args.master_weights}")
        args.out = Path("runs/train") if args.out is None else args.out
        check_out_dir(args.out)
        run = build_run(args, args.level)  # the data, the device, the model: all checked
        args.data = None if args.data is None else args.data.resolve()  # resumable anywhere
        if is_main_process():  # before the folder is looked at: one run at a time
            flag = "--overwrite" if args.overwrite else "--out"
            held.append(RunLock(args.out, flag).acquire())
        check_new_out(args.out, args.overwrite)
    return checkpoint, done, warning, run


def _agree(error: Exception | None) -> None:
    """Raise ``error``; under torchrun, first tell every rank whether any rank failed.

    Only rank 0 takes the run folder's lock, so a held folder fails there alone: without
    this, the other ranks would go on into the first collective of training and be
    killed by torchrun, silent. With it every rank raises (its own error, or the first
    failing rank's), prints the same one line and exits with the same code.
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    import pickle

    import torch.distributed as dist

    mine: Exception | None = error
    if error is not None:
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - sent as its one line instead
            mine = UsageError(" ".join(str(error).split()))
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    first = next((e for e in found if e is not None), None)
    if first is not None:
        failing()  # every rank is on its way out now: torchrun's SIGTERM must not cut it
        raise error if error is not None else first


def _train(args, model, train, val, test, schedule, checkpoint, done, warning) -> dict[str, Any]:  # noqa: ANN001
    out = args.out
    if checkpoint is not None:
        # Half-written checkpoints of a process that died mid-save (the folder is ours:
        # locked, and its checkpoints/ is no link).
        for stale in (out / "checkpoints").glob(".*.tmp"):
            stale.unlink(missing_ok=True)
        print(f"mixprec train: resuming {out} from {checkpoint.name} (epoch {done})")
        if warning is not None:
            print(f"mixprec: warning: {warning}", file=sys.stderr)
    config = _config(args, model)
    threads = f", {args.threads} thread{'s' if args.threads != 1 else ''}" if args.threads else ""
    print(
        f"mixprec train: {args.model} on {'digits' if args.data is None else args.data}, "
        f"level {model.amp_level}, {run_dtype(model)}, loss scale {args.loss_scale}, "
        f"{model.device}{threads}"
        + (f", master weights {args.master_weights}" if args.master_weights else "")
        + (f", optimizer {args.optimizer}" if args.optimizer != "adamw" else "")
    )
    for note in _hardware_notes(model, args):
        print(note)
    if args.adam_eps == FLOAT16_STATE_EPS:
        print(f"note: AdamW eps {FLOAT16_STATE_EPS:g}, not 1e-08: level {model.amp_level} keeps "
              "AdamW's state in float16, where 1e-08 rounds to 0")  # fmt: skip
    float8 = None
    if args.fp8:
        report = args.float8_report
        print(f"float8 ({report.recipe}): {', '.join(report.converted)} of the linear layers "
              f"({len(report.converted)} of {len(report.decisions)}); the others: "
              + "; ".join(f"{n} ({why})" for n, why in report.skipped.items()))  # fmt: skip
        float8 = Float8Monitor()
    history = History()
    sizes = {name: len(loader.dataset) for name, loader in
             (("train", train), ("validation", val), ("test", test))}  # fmt: skip
    # Gradient underflow beside the loss scale: sampled every 100 steps (no syncs between),
    # or once an epoch where epochs are shorter, so that every epoch line has its number.
    low = spec_of(model.amp_level).low_precision and model.dtype in (torch.float16, torch.bfloat16)
    every = min(DEFAULT_EVERY, len(train))
    precision = (
        PrecisionMonitor(every=every, dtype=model.dtype, verbose=not args.quiet) if low else None
    )
    total_steps = args.epochs * len(train)
    callbacks = [
        _RunStart(out, config, lambda: _relayout(schedule, model.optimizer, args.lr, total_steps)),
        *([precision] if precision is not None else []),
        *([float8] if float8 is not None else []),
        history,
        schedule,
        ProgressBar(disable=args.quiet),
        CSVLogger(out / "metrics.csv", append=checkpoint is not None),
        ModelCheckpoint(out / "checkpoints", keep_last=KEEP_LAST),
    ]
    callbacks = for_this_rank(callbacks, args.seed)  # under torchrun: rank 0 alone writes
    t0 = time.perf_counter()
    try:
        try:
            model.train(
                args.epochs, train, callbacks=callbacks, resume=checkpoint, eval_dataset=val
            )
        except DIVERGED as err:
            seconds = time.perf_counter() - t0
            _write_results(
                out, config, model, history, seconds, None, str(err), precision, float8, sizes
            )
            print(f"wrote metrics.json, loss.png, accuracy.png, loss_scale.png to {out} (diverged)")
            raise
        seconds = time.perf_counter() - t0
        final = model.eval(test)  # the test set's one evaluation
        failed = None
        steps, skipped = len(history.losses), int(model.optimizer.skipped_steps)
        try:  # a run that skipped (nearly) every step learned nothing: a failed run
            scale = f" (loss scale {args.loss_scale}, {_name(model.dtype)})"
            check_skipped(skipped, steps, args.max_skipped_fraction or 1.0, scale)
        except DIVERGED as err:
            failed = err
        summary = _write_results(
            out, config, model, history, seconds, final, None if failed is None else str(failed),
            precision, float8, sizes,
        )  # fmt: skip
    except KeyboardInterrupt:
        # Every file is written whole or not at all (atomic_write), so what is on disk is
        # the finished epochs' checkpoints and rows: resuming redoes the rest, the final
        # test evaluation and results included.
        raise Interrupted(_interrupted_text(out)) from None
    print(
        f"test accuracy: {final['accuracy']:.4f}  test loss: {final['loss']:.4f}  "
        f"({sizes['test']} test samples, evaluated once)  "
        f"skipped steps: {summary['skipped_steps']}/{summary['steps']}  "
        f"loss scale: {summary['final_loss_scale']:g}  ({seconds:.1f} s)"
    )
    print(f"wrote metrics.json, metrics.csv, loss.png, accuracy.png, loss_scale.png to {out}")
    if failed is not None:
        raise failed
    return summary
