"""``master_weights="split8"`` everywhere lean is: ``amp.initialize``, ``Model`` (train,
checkpoint, resume), the Lightning plugin; and ``"kahan"`` saving no random state."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec import Model, amp
from mixprec.optim import AdamW8bit, LossScaleOptimizer, Split8MasterWeights
from mixprec.tools import live_tensor_bytes
from mixprec.train.callbacks import ModelCheckpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 3))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(32, 6, generator=gen) for _ in range(n)]
    return [(x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()) for x in xs]  # learnable classes


def _train(net: nn.Module, opt: LossScaleOptimizer, n: int = 6) -> list[torch.Tensor]:
    """torch's clipping recipe as written, ``n`` steps."""
    for x, y in _batches(n):
        opt.scale_loss(nn.functional.cross_entropy(net(x), y)).backward()
        opt.unscale_()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_initialize_split8_is_the_split8_masters_built_by_hand():
    net = _net()
    model, opt = amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-2), "O2",
                                torch.bfloat16, master_weights="split8")  # fmt: skip
    assert isinstance(opt._master, Split8MasterWeights) and opt.master_weights == "split8"
    got = _train(model, opt)

    ref_net = _net()
    ref_model, ref = amp.initialize(ref_net, torch.optim.AdamW(ref_net.parameters(), lr=1e-2),
                                    "O2", torch.bfloat16, master_weights=False)  # fmt: skip
    ref._master = Split8MasterWeights(ref.inner_optimizer)
    want = _train(ref_model, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())


def test_split8_with_adamw8bit_holds_7_bytes_per_parameter_with_gradients():
    """2 (bfloat16 weight) + 1 (correction) + 2 (8-bit moments) + 2 (bfloat16 gradient),
    plus the moments' per-block scales, from live tensor storages."""
    torch.manual_seed(0)
    x = torch.randn(8, 256)
    baseline = live_tensor_bytes()
    net = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 256, bias=False))
    model, opt = amp.initialize(net, AdamW8bit(net.parameters(), lr=1e-3), "O3", torch.bfloat16,
                                master_weights="split8")  # fmt: skip
    opt.scale_loss(model(x).float().square().mean()).backward()
    opt.step()  # the moments exist from here on
    opt.scale_loss(model(x).float().square().mean()).backward()
    grads = [p.grad for p in model.parameters()]  # noqa: F841 - held for the scan
    n = sum(p.numel() for p in model.parameters())
    per_param = (live_tensor_bytes() - baseline) / n
    # + the moments' scales (8 bytes a block of 256) and each tensor's float32 step count
    assert 7.0 <= per_param <= 7.0 + 8 / 256 + 0.001, per_param


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"master_weights": "split8", "use_ema": True}, ["use_ema", "'split8'", "'fp32'"]),
        ({"master_weights": "split9"}, ["master_weights", "'split9'", "'split8'"]),
    ],
)
def test_loss_scale_optimizer_refuses_what_split8_cannot_do(kwargs, words):
    net = _net().to(torch.bfloat16)
    inner = torch.optim.AdamW(net.parameters())
    with pytest.raises(ValueError) as info:
        LossScaleOptimizer(inner, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    ("level", "dtype", "words"),
    [("O1", torch.bfloat16, ["level='O1'", "O2"]), ("O2", torch.float16, ["bfloat16", "'fp32'"])],
)
def test_initialize_refuses_split8_where_it_cannot_work_and_changes_nothing(level, dtype, words):
    net = _net()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError) as info:
        amp.initialize(net, torch.optim.AdamW(net.parameters()), level, dtype, master_weights="split8")
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert all(torch.equal(t, before[k]) and t.dtype == torch.float32 for k, t in net.state_dict().items())


def _model(master_weights) -> Model:
    net = _net()
    return Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level="O2",
                 dtype=torch.bfloat16, master_weights=master_weights, metrics=["loss"])  # fmt: skip


def test_model_split8_trains_and_resumes_bit_exactly(tmp_path):
    data = _batches(4)
    full = _model("split8")
    assert full.optimizer.master_weights == "split8"
    full.train(4, data)

    part = _model("split8")
    part.train(2, data, callbacks=[ModelCheckpoint(tmp_path)])
    resumed = _model("split8")
    resumed.train(4, data, resume=tmp_path / "epoch0002.pt")
    for a, b in zip(full.network.parameters(), resumed.network.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full.optimizer._master.corrections, resumed.optimizer._master.corrections):
        assert torch.equal(a, b)
    assert full.history.losses[-1] < full.history.losses[0]


def test_model_refuses_master_weights_the_rewrite_cannot_have():
    net = _net()
    with pytest.raises(ValueError, match="amp_level='rewrite'"):
        Model(net, optimizer=torch.optim.AdamW(net.parameters()), amp_level="rewrite",
              dtype=torch.bfloat16, master_weights="split8")  # fmt: skip


def test_kahan_saves_no_random_state_and_loads_older_checkpoints():
    net = _net()
    model, opt = amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-2), "lean",
                                torch.bfloat16)  # fmt: skip
    _train(model, opt, 2)
    state = opt.state_dict()
    assert state["mixprec"]["master"]["mode"] == "kahan"
    assert state["mixprec"]["master"]["generators"] == {}
    # A checkpoint written when kahan still saved a generator state loads, ignoring it.
    old = copy.deepcopy(state)
    old["mixprec"]["master"]["generators"] = {"cpu": torch.Generator().get_state()}
    opt.load_state_dict(old)
    assert not opt._master._generators


def test_stochastic_still_saves_and_restores_its_generator():
    net = _net()
    model, opt = amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-2), "lean",
                                torch.bfloat16, master_weights="stochastic")  # fmt: skip
    _train(model, opt, 1)
    state = copy.deepcopy(opt.state_dict())
    after_one = [p.detach().clone() for p in model.parameters()]
    first = _train(model, opt, 1)
    opt.load_state_dict(state)
    with torch.no_grad():
        for p, v in zip(model.parameters(), after_one):
            p.copy_(v)
    again = _train(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


lightning = pytest.importorskip("lightning")


def test_lightning_plugin_steps_split8_masters():
    from mixprec.integrations.lightning import MixprecPrecision

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    plugin = MixprecPrecision("O2", torch.bfloat16, master_weights="split8")
    assert "master_weights='split8'" in repr(plugin)
    module = Module()
    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, plugins=plugin)  # fmt: skip
    x, y = map(torch.cat, zip(*_batches(4)))
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32))
    opt = trainer.optimizers[0]
    assert isinstance(opt, LossScaleOptimizer) and isinstance(opt._master, Split8MasterWeights)
    start = [p.to(torch.bfloat16) for p in _net().parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(module.net.parameters(), start))
    with pytest.raises(ValueError, match="bfloat16"):
        MixprecPrecision("O2", torch.float16, master_weights="split8")
