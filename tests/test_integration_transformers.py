"""MixprecTrainer (a real ``transformers.Trainer``) against mixprec's own training loop.

The Trainer builds its default optimizer (two parameter groups) and linear LR
schedule; the reference loop builds the same optimizer over the same groups, at the
same level (O2 bfloat16, float32 masters) and loss scale, and advances the schedule
on applied steps only. One step per epoch overflows (an inf in the data) and is
skipped on both sides; ``max_grad_norm`` clips. Weights, logged loss scales and
gradient norms agree, and ``train(resume_from_checkpoint=...)`` continues exactly.
"""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs the [hf] extra: pip install -e '.[hf]'")

from transformers import TrainingArguments, get_linear_schedule_with_warmup  # noqa: E402

from mixprec import DynamicLossScale, LossScaleOptimizer, amp  # noqa: E402
from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402

BATCH, CLIP, LR, EPOCHS, STEPS = 4, 0.5, 0.05, 2, 12
pytestmark = pytest.mark.usefixtures("one_thread")


class Toy(nn.Module):
    """A model in the Trainer's convention: ``forward(**batch)`` returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        self.loss = nn.MSELoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": self.loss(logits, labels), "logits": logits}


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(24, 8, generator=g), torch.randn(24, 4, generator=g)
        self.x[9, 3] = float("inf")  # batch 2 of every epoch overflows

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def make_loss_scale() -> DynamicLossScale:
    return DynamicLossScale(initial_scale=256.0, growth_interval=2)


def make_trainer(out, model) -> MixprecTrainer:
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
        learning_rate=LR, max_grad_norm=CLIP, logging_steps=1, save_strategy="epoch",
        report_to=[], use_cpu=True, train_sampling_strategy="sequential", disable_tqdm=True,
    )  # fmt: skip
    return MixprecTrainer(
        model=model, args=args, train_dataset=Pairs(), level="O2", dtype=torch.bfloat16,
        loss_scale=make_loss_scale(),
    )  # fmt: skip


def reference(trained: MixprecTrainer):
    """mixprec's own loop with the Trainer's optimizer class, groups and hyperparameters."""
    inner = trained._mixprec_optimizer().inner_optimizer
    names = {id(p): n for n, p in trained.model.named_parameters()}
    sizes = [len(g["params"]) for g in inner.param_groups]
    model_params = iter(trained._mixprec_optimizer().model_params())
    net = Toy()
    own = dict(net.named_parameters())
    groups = [
        {**{k: v for k, v in g.items() if k not in ("params", "initial_lr")},
         "lr": g["initial_lr"],  # the trained group's lr has been decayed
         "params": [own[names[id(next(model_params))]] for _ in range(n)]}
        for g, n in zip(inner.param_groups, sizes)
    ]  # fmt: skip
    accepted = inspect.signature(type(inner)).parameters
    fresh = type(inner)(groups, **{k: v for k, v in inner.defaults.items() if k in accepted})
    net, opt = amp.initialize(net, fresh, "O2", torch.bfloat16, loss_scale=make_loss_scale())
    sched = get_linear_schedule_with_warmup(opt, 0, STEPS)
    master = dict(
        zip(map(id, opt.model_params()), (p for g in opt.param_groups for p in g["params"]))
    )
    data = Pairs()
    scales, norms = [], []
    for _ in range(EPOCHS):
        for start in range(0, len(data), BATCH):
            loss = net(data.x[start : start + BATCH], data.y[start : start + BATCH])["loss"]
            opt.scale_loss(loss).backward()
            opt.unscale_()
            masters = [master[id(p)] for p in net.parameters()]  # the Trainer's order
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
            opt.step()
            if not opt.last_step_skipped:
                sched.step()
            opt.zero_grad()
            scales.append(float(opt.loss_scale))
    return net, opt, scales, norms


def history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def assert_same(model, trainer, ref_net, ref_opt):
    for mine, theirs in zip(model.parameters(), ref_net.parameters(), strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    opt = trainer._mixprec_optimizer()
    assert isinstance(opt, LossScaleOptimizer) and opt.master_weights
    assert float(opt.loss_scale) == float(ref_opt.loss_scale)
    assert int(opt.skipped_steps) == int(ref_opt.skipped_steps) == EPOCHS
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_the_trainer_matches_mixprecs_loop_and_resumes_exactly(tmp_path):
    model = Toy()
    trainer = make_trainer(tmp_path, model)
    trainer.train()
    ref_net, ref_opt, ref_scales, ref_norms = reference(trainer)
    assert max(n for n in ref_norms if n == n) > CLIP  # clipping acts (nan: the overflow)
    assert_same(model, trainer, ref_net, ref_opt)
    assert history(trainer, "mixprec/loss_scale") == ref_scales
    assert history(trainer, "mixprec/skipped_steps")[-1] == EPOCHS
    logged_norms = history(trainer, "grad_norm")
    finite = [(a, b) for a, b in zip(logged_norms, ref_norms) if b == b]
    assert len(finite) == STEPS - EPOCHS and all(a == b for a, b in finite)  # true norms

    first_epoch = tmp_path / f"checkpoint-{STEPS // EPOCHS}"
    assert (first_epoch / "scaler.pt").is_file()
    resumed_model = Toy()
    resumed = make_trainer(tmp_path / "again", resumed_model)
    resumed.train(resume_from_checkpoint=str(first_epoch))
    assert_same(resumed_model, resumed, ref_net, ref_opt)
    assert history(resumed, "mixprec/loss_scale") == ref_scales  # the first epoch's restored


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"level": "O9"}, ValueError, "level must be one of"),
        ({"dtype": "float32"}, ValueError, "dtype must be torch.float16 or torch.bfloat16"),
        ({"loss_scale": "sometimes"}, ValueError, "loss_scale must be"),
    ],
)
def test_bad_arguments_are_clear_errors_before_the_trainer_is_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        MixprecTrainer(model=Toy(), **kwargs)


def test_accelerates_own_autocast_is_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="leave both False"):
        MixprecTrainer(model=Toy(), args=args)


def test_a_loss_scale_optimizer_passed_in_is_refused(tmp_path):
    model = Toy()
    wrapped = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = MixprecTrainer(
        model=model, args=args, train_dataset=Pairs(), optimizers=(wrapped, None)
    )
    with pytest.raises(TypeError, match="pass the plain optimizer"):
        trainer.train()
    assert amp.get_policy(model) is None  # the level was not applied


def test_a_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "mixprec.integrations.transformers")
    with pytest.raises(ImportError, match=r'pip install -e "\.\[hf\]"'):
        importlib.import_module("mixprec.integrations.transformers")
