"""Tests for mixprec.train.callbacks, driven by a small scripted trainer loop."""

from __future__ import annotations

import csv
import io
import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.train.callbacks import (
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    History,
    LossMonitor,
    LossScaleMonitor,
    ModelCheckpoint,
    ProgressBar,
    RunState,
    format_loss,
)


def drive(callbacks, losses, scales=None, skips=None, epoch_metrics=None, state=None):
    """Run the hook protocol over ``losses[epoch][step]`` like a trainer would."""
    cbs = CallbackList(callbacks)
    state = state or RunState()
    state.epochs = state.epoch + len(losses)
    state.steps_per_epoch = len(losses[0])
    cbs.on_train_begin(state)
    for e, epoch_losses in enumerate(losses):
        state.epoch += 1
        state.step_in_epoch = 0
        cbs.on_epoch_begin(state)
        for s, loss in enumerate(epoch_losses):
            state.step += 1
            state.step_in_epoch += 1
            state.loss = loss
            state.loss_scale = scales[e][s] if scales else 1.0
            state.skipped = bool(skips[e][s]) if skips else False
            state.skipped_steps += state.skipped
            state.samples_per_s = 1000.0
            cbs.on_step_end(state)
        state.metrics = (
            dict(epoch_metrics[e])
            if epoch_metrics
            else {"loss": sum(epoch_losses) / len(epoch_losses)}
        )
        cbs.on_epoch_end(state)
        if state.stop_training:
            break
    cbs.on_train_end(state)
    return state


# --- LossMonitor -------------------------------------------------------------------


def test_loss_monitor_prints_the_mindspore_line(capsys):
    mon = LossMonitor()
    mon.on_step_end(RunState(epoch=1, step=32, step_in_epoch=32, loss=2.301896572113037))
    assert capsys.readouterr().out == "epoch: 1 step: 32, loss is 2.3018966\n"


def test_loss_monitor_every_step_and_every_nth_global_step(capsys):
    drive([LossMonitor()], [[0.5, 0.25], [0.125, 2.0]])
    assert capsys.readouterr().out.splitlines() == [
        "epoch: 1 step: 1, loss is 0.5",
        "epoch: 1 step: 2, loss is 0.25",
        "epoch: 2 step: 1, loss is 0.125",
        "epoch: 2 step: 2, loss is 2.0",
    ]
    drive([LossMonitor(per_print_times=3)], [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert capsys.readouterr().out.splitlines() == [
        "epoch: 2 step: 1, loss is 1.0",
        "epoch: 3 step: 2, loss is 1.0",
    ]
    drive([LossMonitor(per_print_times=0)], [[1.0]])
    assert capsys.readouterr().out == ""


def test_loss_monitor_formats_like_float32_and_rejects_negative_period():
    assert format_loss(2.311748) == "2.311748"
    assert format_loss(float("nan")) == "nan"
    out = io.StringIO()
    LossMonitor(file=out).on_step_end(RunState(epoch=3, step=1, step_in_epoch=1, loss=float("inf")))
    assert out.getvalue() == "epoch: 3 step: 1, loss is inf\n"
    with pytest.raises(ValueError, match="per_print_times must be an integer >= 0, got -1"):
        LossMonitor(per_print_times=-1)


# --- LossScaleMonitor ----------------------------------------------------------------


def test_loss_scale_monitor_records_changes_and_prints_per_epoch():
    out = io.StringIO()
    mon = LossScaleMonitor(on_change=True, file=out)
    scales = [[65536.0, 32768.0, 32768.0], [32768.0, 65536.0, 65536.0]]
    skips = [[False, True, False], [False, False, False]]
    drive([mon], [[1.0] * 3, [1.0] * 3], scales=scales, skips=skips)
    assert mon.scales == [65536.0, 32768.0, 32768.0, 32768.0, 65536.0, 65536.0]
    assert mon.skipped == [False, True, False, False, False, False]
    assert mon.changes == [(2, 65536.0, 32768.0), (5, 32768.0, 65536.0)]
    assert out.getvalue().splitlines() == [
        "epoch: 1 step: 2, loss scale 65536.0 -> 32768.0 (step skipped)",
        "epoch: 1 loss scale is 32768.0, skipped steps: 1 of 3 (total 1)",
        "epoch: 2 step: 2, loss scale 32768.0 -> 65536.0",
        "epoch: 2 loss scale is 65536.0, skipped steps: 0 of 3 (total 1)",
    ]


def test_loss_scale_monitor_quiet_mode_prints_nothing(capsys):
    mon = LossScaleMonitor(per_epoch=False)
    drive([mon], [[1.0, 1.0]], scales=[[8.0, 4.0]], skips=[[False, True]])
    assert capsys.readouterr().out == "" and mon.changes == [(2, 8.0, 4.0)]


# --- ProgressBar ---------------------------------------------------------------------


def test_progress_bar_shows_loss_scale_throughput_and_metrics():
    out = io.StringIO()
    drive(
        [ProgressBar(file=out, mininterval=0, live=True)],
        [[0.5, 0.25]],
        scales=[[1024.0, 2048.0]],
        epoch_metrics=[{"loss": 0.375, "val_accuracy": 0.875}],
    )
    text = out.getvalue()
    assert "loss 0.25  scale 2048  skipped 0  1000/s" in text
    assert "loss 0.375  val_accuracy 0.875" in text and "1/1" in text


def test_progress_bar_disabled_writes_nothing():
    out = io.StringIO()
    drive([ProgressBar(file=out, disable=True)], [[0.5, 0.25]])
    assert out.getvalue() == ""


# --- History ---------------------------------------------------------------------------


def test_history_records_steps_and_epochs_and_round_trips():
    hist = History()
    drive(
        [hist],
        [[0.5, 0.25], [0.125, 0.0625]],
        scales=[[4.0, 2.0], [2.0, 2.0]],
        skips=[[False, True], [False, False]],
        epoch_metrics=[{"loss": 0.4}, {"loss": 0.1, "val_accuracy": 0.9}],
    )
    assert hist.steps == [1, 2, 3, 4]
    assert hist.losses == [0.5, 0.25, 0.125, 0.0625]
    assert hist.loss_scales == [4.0, 2.0, 2.0, 2.0]
    assert hist.skipped == [False, True, False, False]
    assert hist.epochs == [1, 2] and hist.metrics["loss"] == [0.4, 0.1]
    assert math.isnan(hist.metrics["val_accuracy"][0]) and hist.metrics["val_accuracy"][1] == 0.9
    copy = History()
    copy.load_state_dict(hist.state_dict())
    restored, saved = copy.state_dict(), hist.state_dict()
    assert {k: v for k, v in restored.items() if k != "metrics"} == {
        k: v for k, v in saved.items() if k != "metrics"
    }
    assert restored["metrics"]["loss"] == [0.4, 0.1]
    assert (
        math.isnan(restored["metrics"]["val_accuracy"][0])
        and restored["metrics"]["val_accuracy"][1] == 0.9
    )
    hist.reset()
    assert hist.losses == [] and hist.metrics == {}


# --- CSVLogger -------------------------------------------------------------------------


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_logger_writes_one_row_per_epoch_and_adds_late_columns(tmp_path):
    path = tmp_path / "logs" / "run.csv"
    drive(
        [CSVLogger(path)],
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]],
        scales=[[8.0, 8.0], [4.0, 4.0], [4.0, 4.0]],
        epoch_metrics=[{"loss": 0.5}, {"loss": 0.25, "val_accuracy": 0.75}, {"loss": 0.125}],
    )
    rows = _read(path)
    assert list(rows[0]) == [
        "epoch",
        "step",
        "loss_scale",
        "skipped_steps",
        "samples_per_s",
        "loss",
        "val_accuracy",
    ]
    assert [
        (r["epoch"], r["step"], r["loss_scale"], r["loss"], r["val_accuracy"]) for r in rows
    ] == [
        ("1", "2", "8.0", "0.5", "nan"),  # not reported: nan, never a blank cell
        ("2", "4", "4.0", "0.25", "0.75"),
        ("3", "6", "4.0", "0.125", "nan"),
    ]


def test_csv_logger_append_on_resume_drops_abandoned_epochs(tmp_path):
    path = tmp_path / "run.csv"
    drive(
        [CSVLogger(path)], [[1.0]] * 3, epoch_metrics=[{"loss": 3.0}, {"loss": 2.0}, {"loss": 1.0}]
    )
    # Resume from the checkpoint after epoch 1: epochs 2-3 of the old run are dropped.
    drive(
        [CSVLogger(path, append=True)],
        [[1.0]],
        epoch_metrics=[{"loss": 1.5}],
        state=RunState(epoch=1, step=1),
    )
    assert [(r["epoch"], r["loss"]) for r in _read(path)] == [("1", "3.0"), ("2", "1.5")]
    # Without append the file starts over.
    drive([CSVLogger(path)], [[1.0]], epoch_metrics=[{"loss": 9.0}])
    assert [(r["epoch"], r["loss"]) for r in _read(path)] == [("1", "9.0")]


# --- EarlyStopping ---------------------------------------------------------------------


def _metrics(name, values):
    return [{name: v} for v in values]


def test_early_stopping_min_mode_stops_after_patience(capsys):
    es = EarlyStopping(monitor="val_loss", patience=2)
    state = drive(
        [es], [[1.0]] * 6, epoch_metrics=_metrics("val_loss", [1.0, 0.5, 0.6, 0.55, 0.4, 0.3])
    )
    assert state.stop_training and state.epoch == 4 and es.stopped_epoch == 4
    assert (es.best, es.best_epoch, es.wait) == (0.5, 2, 2)
    assert capsys.readouterr().out.strip() == (
        "early stopping at epoch 4: val_loss has not improved for 2 epoch(s); best 0.5 at epoch 2"
    )


def test_early_stopping_max_mode_with_min_delta_and_nan():
    es = EarlyStopping(monitor="accuracy", patience=2, min_delta=0.01, mode="max", verbose=False)
    # 0.805 is not 0.01 better than 0.8; NaN never improves.
    state = drive(
        [es], [[1.0]] * 5, epoch_metrics=_metrics("accuracy", [0.8, 0.805, float("nan"), 0.9, 0.95])
    )
    assert state.epoch == 3 and es.best == 0.8 and state.stop_training
    keeps_going = EarlyStopping(monitor="accuracy", patience=2, mode="max", verbose=False)
    state = drive(
        [keeps_going], [[1.0]] * 4, epoch_metrics=_metrics("accuracy", [0.5, 0.4, 0.6, 0.5])
    )
    assert state.epoch == 4 and not state.stop_training and keeps_going.best_epoch == 3


def test_early_stopping_missing_metric_and_bad_arguments():
    with pytest.raises(
        ValueError, match=r"monitors 'val_loss', which is not among this epoch's metrics \['loss'\]"
    ):
        drive([EarlyStopping(monitor="val_loss")], [[1.0]])
    with pytest.raises(ValueError, match="mode must be one of 'min', 'max', got 'auto'"):
        EarlyStopping(mode="auto")
    with pytest.raises(
        ValueError, match="patience must be an integer >= 1, got 0; pass e.g. patience=3"
    ):
        EarlyStopping(patience=0)
    with pytest.raises(ValueError, match="min_delta must be a number >= 0, got -0.1"):
        EarlyStopping(min_delta=-0.1)


def test_early_stopping_state_survives_a_resume():
    first = EarlyStopping(patience=2, verbose=False)
    drive([first], [[1.0]] * 2, epoch_metrics=_metrics("loss", [1.0, 1.5]))
    resumed = EarlyStopping(patience=2, verbose=False)
    resumed.load_state_dict(first.state_dict())
    state = drive(
        [resumed], [[1.0]], epoch_metrics=_metrics("loss", [1.2]), state=RunState(epoch=2)
    )
    assert state.stop_training and resumed.best == 1.0
    fresh = EarlyStopping(patience=2, verbose=False)
    state = drive([fresh], [[1.0]], epoch_metrics=_metrics("loss", [1.2]), state=RunState(epoch=2))
    assert not state.stop_training


# --- ModelCheckpoint -------------------------------------------------------------------


def test_model_checkpoint_saves_on_schedule_through_save_fn(tmp_path):
    calls = []

    def save_fn(path, state):
        calls.append((path.name, state.epoch, state.step))
        path.write_text(f"epoch {state.epoch}")

    ckpt = ModelCheckpoint(
        tmp_path / "ckpt", every_n_epochs=2, filename="e{epoch}-s{step}.pt", save_fn=save_fn
    )
    drive([ckpt], [[1.0, 1.0]] * 5)
    assert calls == [("e2-s4.pt", 2, 4), ("e4-s8.pt", 4, 8), ("e5-s10.pt", 5, 10)]
    assert ckpt.last_path == tmp_path / "ckpt" / "e5-s10.pt"
    assert ckpt.last_path.read_text() == "epoch 5"


def test_model_checkpoint_keep_last_deletes_only_its_own_old_files(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    ckpt = ModelCheckpoint(
        tmp_path, keep_last=2, save_fn=lambda path, state: path.write_bytes(b"x")
    )
    drive([ckpt], [[1.0]] * 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch0003.pt",
        "epoch0004.pt",
        "notes.txt",
    ]
    assert [p.name for p in ckpt.saved] == ["epoch0003.pt", "epoch0004.pt"]


def test_model_checkpoint_uses_the_trainer_save_hook(tmp_path):
    model = torch.nn.Linear(2, 2)

    def trainer_save(path):
        torch.save({"model": model.state_dict()}, path)

    ckpt = ModelCheckpoint(tmp_path, save_on_train_end=False)
    drive([ckpt], [[1.0]], state=RunState(save_checkpoint=trainer_save))
    loaded = torch.load(tmp_path / "epoch0001.pt", weights_only=True)
    torch.testing.assert_close(loaded["model"]["weight"], model.weight.detach())
    with pytest.raises(RuntimeError, match="nothing to save with: pass save_fn"):
        drive([ModelCheckpoint(tmp_path)], [[1.0]])


def test_model_checkpoint_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"only \{epoch\} and \{step\}"):
        ModelCheckpoint(tmp_path, filename="{loss}.pt")
    with pytest.raises(ValueError, match="must name a file inside directory"):
        ModelCheckpoint(tmp_path, filename="sub/{epoch}.pt")
    with pytest.raises(ValueError, match="every_n_epochs must be an integer >= 1, got 0"):
        ModelCheckpoint(tmp_path, every_n_epochs=0)
    with pytest.raises(ValueError, match="keep_last must be an integer >= 1 or None, got 0"):
        ModelCheckpoint(tmp_path, keep_last=0)
    with pytest.raises(TypeError, match="directory must be a str or Path, got int"):
        ModelCheckpoint(3)


# --- CallbackList and an end-to-end loop -------------------------------------------------


def test_callback_list_calls_hooks_in_order_and_checks_types():
    events = []

    class Recorder(Callback):
        def __init__(self, tag):
            self.tag = tag

        def on_train_begin(self, state):
            events.append((self.tag, "train_begin"))

        def on_epoch_begin(self, state):
            events.append((self.tag, "epoch_begin", state.epoch))

        def on_step_end(self, state):
            events.append((self.tag, "step", state.step))

        def on_epoch_end(self, state):
            events.append((self.tag, "epoch_end", state.epoch))

        def on_train_end(self, state):
            events.append((self.tag, "train_end"))

    drive([Recorder("a"), Recorder("b")], [[1.0]])
    assert events == [
        ("a", "train_begin"),
        ("b", "train_begin"),
        ("a", "epoch_begin", 1),
        ("b", "epoch_begin", 1),
        ("a", "step", 1),
        ("b", "step", 1),
        ("a", "epoch_end", 1),
        ("b", "epoch_end", 1),
        ("a", "train_end"),
        ("b", "train_end"),
    ]
    with pytest.raises(
        TypeError,
        match=r"callbacks\[0\] must be a mixprec.train.callbacks.Callback, "
        "got builtin_function_or_method",
    ):
        CallbackList([print])
    cbs = CallbackList([LossMonitor(), EarlyStopping()])
    assert cbs.state_dict() == {"EarlyStopping:0": {"best": math.inf, "best_epoch": 0, "wait": 0}}


def test_callbacks_follow_a_real_lenet5_training_run(tmp_path, capsys):
    from mixprec.train.data import train_test_loaders
    from mixprec.train.metrics import Accuracy
    from mixprec.train.models import LeNet5

    torch.manual_seed(0)
    train, test = train_test_loaders(batch_size=256, seed=0)
    model = LeNet5()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hist = History()
    cbs = CallbackList(
        [LossMonitor(per_print_times=len(train)), hist, CSVLogger(tmp_path / "log.csv")]
    )
    state = RunState(epochs=2, steps_per_epoch=len(train), model=model, optimizer=opt)
    cbs.on_train_begin(state)
    for _ in range(2):
        state.epoch += 1
        state.step_in_epoch = 0
        cbs.on_epoch_begin(state)
        for x, y in train:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            state.step += 1
            state.step_in_epoch += 1
            state.loss = loss.item()
            cbs.on_step_end(state)
        acc = Accuracy()
        with torch.no_grad():
            for x, y in test:
                acc.update(model(x), y)
        state.metrics = {"val_accuracy": acc.compute()}
        cbs.on_epoch_end(state)
    cbs.on_train_end(state)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == ["epoch: 1 step: 6", "epoch: 2 step: 6"]
    assert lines[1] == f"epoch: 2 step: 6, loss is {format_loss(hist.losses[-1])}"
    assert len(hist.losses) == 12 and hist.losses[-1] < hist.losses[0]
    assert [r["epoch"] for r in _read(tmp_path / "log.csv")] == ["1", "2"]
