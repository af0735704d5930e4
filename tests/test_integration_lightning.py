"""MixprecPrecision in a real Lightning Trainer, against mixprec's own training loop.

Same seed, data, level (O2 bfloat16, float32 masters) and loss scale on both sides;
the data holds an inf, so one step per epoch overflows and is skipped on both, and
gradient clipping is on. Lightning runs the same operations in the same order, so
the weights agree bit for bit.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip(
    "lightning", reason="needs the [lightning] extra: pip install 'mixprec[lightning]'"
)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402

from mixprec import DynamicLossScale, LossScaleOptimizer, amp  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

BATCH, CLIP, LR, EPOCHS = 4, 0.05, 0.1, 2
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # Lightning's own notices: its pytree helper on this torch, and that a resumed run
    # does not get the checkpoint callback back (this one saves no more).
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def make_loss_scale() -> DynamicLossScale:
    return DynamicLossScale(initial_scale=256.0, growth_interval=2)  # grows within the run


def make_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 8, generator=g), torch.randn(24, 4, generator=g)
    x[9, 3] = float("inf")  # batch 2 of every epoch overflows
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def make_net8() -> nn.Module:
    """The middle layer (32 -> 16) can run in float8; 8 -> 32 and 16 -> 4 cannot."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def reference(accumulate: int = 1, level: str = "O2", make=make_net, fp8=False):
    """mixprec's own loop: scale, backward, unscale, clip, step (skipped on overflow)."""
    net = make()
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    net, opt = amp.initialize(net, sgd, level, torch.bfloat16, loss_scale=make_loss_scale(),
                              fp8=fp8)  # fmt: skip
    batches = list(make_loader())
    scales, norms = [], []
    for _ in range(EPOCHS):
        for start in range(0, len(batches), accumulate):
            for x, y in batches[start : start + accumulate]:
                opt.scale_loss(F.mse_loss(net(x), y) / accumulate).backward()
            opt.unscale_()
            masters = [p for g in opt.param_groups for p in g["params"]]
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
            opt.step()
            opt.zero_grad()
            scales.append(float(opt.loss_scale))
    return net, opt, scales, norms


class Toy(L.LightningModule):
    def __init__(self, manual: bool = False, make=make_net) -> None:
        super().__init__()
        self.net = make()
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)  # self(x): the level casts at the module's forward
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class Recorder(Logger):
    """Keeps what Lightning's loggers are sent."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self.hyperparams = params

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))


def fit(module, tmp_path, ckpt_path=None, callbacks=(), level="O2", fp8=False, **trainer_args):
    recorder = Recorder()
    plugin = MixprecPrecision(level=level, dtype=torch.bfloat16, loss_scale=make_loss_scale(),
                              fp8=fp8)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, plugins=[plugin], logger=recorder,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
        default_root_dir=tmp_path, **trainer_args,
    )  # fmt: skip
    trainer.fit(module, make_loader(), ckpt_path=ckpt_path)
    return trainer, plugin, recorder


def logged(recorder, key):
    return [m[key] for m in recorder.metrics if key in m]


def assert_same_run(module, trainer, reference_run):
    ref_net, ref_opt, ref_scales, _ = reference_run
    opt = trainer.optimizers[0]
    assert isinstance(opt, LossScaleOptimizer) and opt.master_weights
    for mine, theirs in zip(module.net.parameters(), ref_net.parameters(), strict=True):
        assert mine.dtype == theirs.dtype
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"]):
        assert torch.equal(mine, theirs)  # the float32 masters
    assert float(opt.loss_scale) == ref_scales[-1]
    assert int(opt.skipped_steps) == int(ref_opt.skipped_steps) == EPOCHS
    assert int(opt.iterations) == int(ref_opt.iterations)


def test_automatic_optimization_matches_mixprecs_loop_and_resumes_exactly(tmp_path):
    reference_run = reference()
    _, _, ref_scales, ref_norms = reference_run
    assert max(ref_norms) > CLIP  # clipping acts
    steps = list(zip(ref_scales, ref_scales[1:]))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps)  # grows, backs off

    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    module = Toy()
    trainer, plugin, recorder = fit(module, tmp_path, callbacks=[saves], gradient_clip_val=CLIP)
    assert_same_run(module, trainer, reference_run)
    assert plugin.precision == trainer.precision == "bf16-mixed"
    assert module.net[0].weight.dtype == torch.bfloat16  # O2: low precision
    assert module.net[1].weight.dtype == torch.float32  # but the LayerNorm
    # The loss scale after every step and the running count of skipped steps reach the loggers.
    assert logged(recorder, "mixprec/loss_scale") == ref_scales
    assert logged(recorder, "mixprec/skipped_steps")[-1] == EPOCHS

    # Resume from the end of the first epoch in a fresh process state: same end point.
    first_epoch = torch.load(next(tmp_path.glob("ckpt/epoch=0*.ckpt")), weights_only=False)
    assert first_epoch["MixprecPrecision"] == {"level": "O2", "dtype": "torch.bfloat16", "fp8": None}
    assert "mixprec" in first_epoch["optimizer_states"][0]
    resumed = Toy()
    path = str(next(tmp_path.glob("ckpt/epoch=0*.ckpt")))
    trainer2, _, recorder2 = fit(
        resumed, tmp_path / "again", ckpt_path=path, gradient_clip_val=CLIP
    )
    assert_same_run(resumed, trainer2, reference_run)
    assert logged(recorder2, "mixprec/loss_scale") == ref_scales[len(ref_scales) // 2 :]


@pytest.mark.parametrize("mode", ["accumulate_grad_batches", "manual"])
def test_accumulation_and_manual_optimization_match_mixprecs_loop(mode, tmp_path):
    if mode == "manual":  # training_step clips through self.clip_gradients
        module, args, run = Toy(manual=True), {}, reference()
    else:
        module, run = Toy(), reference(accumulate=2)
        args = {"accumulate_grad_batches": 2, "gradient_clip_val": CLIP}
    trainer, _, recorder = fit(module, tmp_path, **args)
    assert_same_run(module, trainer, run)
    assert logged(recorder, "mixprec/loss_scale") == run[2]


def test_the_lean_level_matches_mixprecs_loop(tmp_path):
    """Level ``lean``: bfloat16 everywhere (the LayerNorm too), Kahan-compensated steps."""
    module, run = Toy(), reference(level="lean")
    trainer, plugin, _ = fit(module, tmp_path, level="lean", gradient_clip_val=CLIP)
    assert trainer.optimizers[0].master_weights == "kahan"
    assert plugin.precision == "bf16-true"
    assert module.net[1].weight.dtype == torch.bfloat16
    assert_same_run(module, trainer, run)


def test_float8_layers_match_mixprecs_loop(tmp_path):
    """``fp8="delayed"``: the eligible layer runs in float8 under Lightning exactly as in
    mixprec's own loop (weights, masters, scale and amax histories bit for bit)."""
    from mixprec.float8 import Float8Linear

    module, run = Toy(make=make_net8), reference(make=make_net8, fp8="delayed")
    trainer, plugin, _ = fit(module, tmp_path, fp8="delayed", gradient_clip_val=CLIP)
    assert isinstance(module.net[2], Float8Linear) and type(module.net[0]) is nn.Linear
    assert plugin.state_dict()["fp8"] == "delayed"
    assert_same_run(module, trainer, run)
    history = module.net[2].grad_scaling.amax_history
    assert history.any() and torch.equal(history, run[0][2].grad_scaling.amax_history)


def test_a_loss_scale_optimizer_from_configure_optimizers_is_refused():
    plugin = MixprecPrecision(level="O1", dtype=torch.bfloat16)
    net = plugin.convert_module(make_net())
    wrapped = LossScaleOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="return the plain optimizer"):
        plugin.connect(net, [wrapped], [])


def test_resuming_at_another_level_is_refused_before_anything_loads():
    saved = MixprecPrecision(level="O2", dtype=torch.bfloat16).state_dict()
    with pytest.raises(ValueError, match="level O2 in torch.bfloat16 with fp8=None; this plugin "
                       "is level O1"):  # fmt: skip
        MixprecPrecision(level="O1", dtype=torch.bfloat16).load_state_dict(saved)
    with pytest.raises(ValueError, match="this plugin is level O2 in torch.bfloat16 with fp8='dy"):
        MixprecPrecision(level="O2", dtype=torch.bfloat16, fp8=True).load_state_dict(saved)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"level": "O4"}, ValueError, "level must be one of"),
        ({"level": 2}, TypeError, "level must be a str"),
        ({"dtype": torch.float32}, ValueError, "dtype must be torch.float16 or torch.bfloat16"),
        ({"loss_scale": -1.0}, ValueError, "loss_scale"),
        ({"log_metrics": "yes"}, TypeError, "log_metrics must be True or False"),
        ({"device": 0}, TypeError, "device must be a str or torch.device"),
        ({"fp8": "fast"}, ValueError, "fp8 must be one of 'dynamic', 'delayed'"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MixprecPrecision(**kwargs)


def test_auto_decides_by_the_device():
    level, dtype, _ = amp.choose_auto("cpu")
    plugin = MixprecPrecision(level="auto", device="cpu")
    assert (plugin.level, plugin.dtype) == (level, dtype)


def test_a_missing_lightning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "mixprec.integrations.lightning")
    # The pinned requirement (works without a checkout) and the checkout's extra.
    with pytest.raises(ImportError, match=r'pip install "lightning>=.*pip install -e "\.\[lightning\]"'):
        importlib.import_module("mixprec.integrations.lightning")


class SkipsOddBatches(Toy):
    def training_step(self, batch, batch_idx):
        if batch_idx % 2:
            return None  # Lightning skips the backward: nothing to unscale or step
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_a_training_step_that_returns_none_with_clipping_skips_the_step(tmp_path):
    module = SkipsOddBatches()
    trainer, plugin, _ = fit(module, tmp_path, gradient_clip_val=CLIP)
    opt = plugin._optimizers[0]
    batches = len(make_loader()) * EPOCHS
    # Only the even batches stepped (one of them per epoch overflows and is skipped).
    assert int(opt.iterations) + int(opt.skipped_steps) == (batches + 1) // 2
    assert all(torch.isfinite(p).all() for p in module.parameters())


def grad_norm(parameters) -> float:
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad.float()) for p in parameters])))  # fmt: skip


class DropsFirstBatches(Toy):
    """Manual optimization that clips each batch and drops the first of every epoch, as
    a loop that skips a norm spike does; it records the clipped norms."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(F.mse_loss(self(x), y))
        self.clip_gradients(opt, gradient_clip_val=1e9, gradient_clip_algorithm="norm")
        self.norms.append(grad_norm(self.parameters()))  # the masters' (shown in the model)
        if batch_idx > 0:
            opt.step()
        opt.zero_grad()  # after batch 0: the step is dropped
        return None


def test_a_dropped_manual_step_leaves_the_next_batch_to_unscale_its_own(tmp_path):
    module = DropsFirstBatches()
    fit(module, tmp_path)
    net = make_net()
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    net, opt = amp.initialize(net, sgd, "O2", torch.bfloat16, loss_scale=make_loss_scale())
    norms = []
    for _ in range(EPOCHS):
        for index, (x, y) in enumerate(make_loader()):
            opt.scale_loss(F.mse_loss(net(x), y)).backward()
            opt.unscale_()
            norms.append(grad_norm(net.parameters()))
            if index > 0:
                opt.step()
            opt.zero_grad()
    assert module.norms[:2] == norms[:2] and module.norms[1] < 100  # true gradients
    assert [math.isfinite(n) for n in module.norms] == [math.isfinite(n) for n in norms]
    for mine, theirs in zip(module.net.parameters(), net.parameters(), strict=True):
        assert torch.equal(mine, theirs)


class LogsTheScale(Toy):
    """The common Lightning idiom for logging the loss scale and un-scaling gradients by
    hand, written against ``MixedPrecision``'s ``scaler``."""

    def on_after_backward(self) -> None:
        scaler = self.trainer.precision_plugin.scaler
        if scaler is not None:
            self.seen = [*getattr(self, "seen", []), scaler.get_scale()]
            assert torch.equal(scaler._scale, torch.tensor(self.seen[-1]))


def test_the_plugins_scaler_reads_the_shared_scale_as_mixedprecisions_does(tmp_path):
    module = LogsTheScale()
    _, plugin, _ = fit(module, tmp_path)
    _, _, scales, _ = reference()
    assert module.seen == [256.0, *scales[:-1]]  # each step's scale before its update
    assert MixprecPrecision(level="O2", dtype=torch.bfloat16).scaler is None  # as Lightning's


def test_a_module_trained_by_one_trainer_is_tested_by_another(tmp_path):
    module = Toy()
    fit(module, tmp_path)
    trained = [p.detach().clone() for p in module.parameters()]
    tester = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False,
                       plugins=[MixprecPrecision(level="O2", dtype=torch.bfloat16)])  # fmt: skip

    class Evaluated(type(module)):
        def test_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1])

    module.__class__ = Evaluated
    tester.test(module, make_loader(), verbose=False)
    assert all(torch.equal(a, b) for a, b in zip(trained, module.parameters()))
    other = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      plugins=[MixprecPrecision(level="O3", dtype=torch.bfloat16)])  # fmt: skip
    with pytest.raises(ValueError, match="prepared by a MixprecPrecision at level O2"):
        other.test(module, make_loader(), verbose=False)


def test_the_plugin_names_its_device():
    assert MixprecPrecision(level="O2", dtype=torch.bfloat16, device="cpu").device == "cpu"


class Evaluates(Toy):
    def test_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_trainer_that_fitted_tests_and_predicts(level, tmp_path):
    """``trainer.test``/``predict`` after ``fit`` connect the optimizers ``fit`` left: the
    plugin's own wrappers pass through (they used to be refused as user-made)."""
    module = Evaluates()
    trainer, plugin, _ = fit(module, tmp_path, level=level)
    wrappers = list(trainer.optimizers)
    trained = [p.detach().clone() for p in module.parameters()]
    trainer.test(module, make_loader(), verbose=False)
    trainer.predict(module, [x for x, _ in make_loader()])
    assert trainer.optimizers == wrappers and plugin._optimizers == wrappers
    assert all(torch.equal(a, b) for a, b in zip(trained, module.parameters()))


def test_the_plugin_pickles_for_strategies_that_spawn_processes():
    """``ddp_spawn`` pickles the plugin: its settings and loss scale travel, the record of
    converted modules (a weak set) starts empty, and a converted module is still known."""
    import pickle

    plugin = MixprecPrecision(level="O2", dtype=torch.bfloat16, loss_scale=make_loss_scale())
    module = Toy()
    plugin.convert_module(module)
    copy = pickle.loads(pickle.dumps(plugin))
    assert (copy.level, copy.dtype, copy.precision) == ("O2", torch.bfloat16, "bf16-mixed")
    assert float(copy.loss_scale.scale) == 256.0 and len(copy._converted) == 0
    moved = pickle.loads(pickle.dumps(module))  # as the module reaches another process
    assert copy.convert_module(moved) is moved and moved in copy._converted
    with pytest.raises(ValueError, match="prepared by a MixprecPrecision at level O2"):
        pickle.loads(pickle.dumps(MixprecPrecision(level="O1"))).convert_module(moved)


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_autocast_context_manager_is_lightnings_for_the_plugins_dtype(level):
    plugin = MixprecPrecision(level=level, dtype=torch.bfloat16, device="cpu")
    with plugin.autocast_context_manager():
        assert torch.is_autocast_enabled("cpu") == (level != "O0")
        assert not torch.is_autocast_cache_enabled()
        out = nn.Linear(2, 2)(torch.ones(1, 2))
    assert out.dtype == (torch.float32 if level == "O0" else torch.bfloat16)


def test_clipping_a_fused_optimizer_the_plugin_did_not_wrap_is_refused_and_changes_nothing():
    net = make_net()
    fused = torch.optim.Adam(net.parameters(), lr=LR, fused=True)
    for p in net.parameters():
        p.grad = torch.full_like(p, 1000.0)  # still multiplied by the loss scale
    plugin = MixprecPrecision(level="O1", dtype=torch.float16, device="cpu")
    before = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="Adam, does not allow for gradient clipping here"):
        plugin.clip_gradients(fused, clip_val=1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, net.parameters()))
    plugin.clip_gradients(fused, clip_val=0.0)  # no clipping asked: nothing to refuse
    # Without a loss scale (bfloat16 O1) its gradients are true ones: clipping is fine.
    unscaled = MixprecPrecision(level="O1", dtype=torch.bfloat16, device="cpu")
    unscaled.clip_gradients(fused, clip_val=1.0)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))
    assert float(norm) == pytest.approx(1.0, rel=1e-4)


def test_stepping_an_optimizer_the_plugin_did_not_wrap_on_scaled_losses_is_refused():
    net = make_net()
    first, second = list(net.children())[0], list(net.children())[-1]
    plugin = MixprecPrecision(level="O1", dtype=torch.float16, device="cpu")
    plugin.connect(net, [torch.optim.SGD(first.parameters(), lr=LR)], [])
    stranger = torch.optim.SGD(second.parameters(), lr=LR)
    before = [p.detach().clone() for p in net.parameters()]
    calls = []
    with pytest.raises(RuntimeError, match="did not wrap this SGD.*scaled gradients"):
        plugin.optimizer_step(stranger, model=Toy(), closure=lambda: calls.append(1))
    assert calls == []  # refused before the training step ran
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    # Unscaled losses (bfloat16 O1): its gradients are true ones, so it steps as Lightning's.
    unscaled = MixprecPrecision(level="O1", dtype=torch.bfloat16, device="cpu")
    unscaled.connect(net, [torch.optim.SGD(first.parameters(), lr=LR)], [])
    for p in second.parameters():
        p.grad = torch.ones_like(p)
    module = Toy()
    module.trainer = L.Trainer(logger=False, enable_checkpointing=False,
                               enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    module.trainer.strategy.connect(module)
    unscaled.optimizer_step(stranger, model=module, closure=lambda: calls.append(1))
    assert calls == [1]
    assert not torch.equal(before[-1], second.bias)
