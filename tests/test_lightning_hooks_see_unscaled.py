"""Lightning documents ``on_before_optimizer_step`` as seeing unscaled gradients: with
MixprecPrecision at O2 the model's ``p.grad`` there are the unscaled float32 gradients
that are stepped, not the low-precision ones still multiplied by the loss scale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import lightning as L  # noqa: E402

from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),
]


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.norms: list[float] = []
        self.dtypes: set[torch.dtype] = set()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.net.parameters()]
        self.dtypes |= {g.dtype for g in grads}
        self.norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.float()) for g in grads]))))  # fmt: skip

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # weights fixed: norms comparable


def _norms(plugin) -> tuple[list[float], set[torch.dtype]]:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
    module = Recorder()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=plugin)  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return module.norms, module.dtypes


def test_o2_hook_sees_unscaled_gradients():
    reference, _ = _norms(None)
    mixed, dtypes = _norms(MixprecPrecision("O2", torch.bfloat16, loss_scale=2.0**15))
    assert dtypes == {torch.float32}  # the float32 masters' gradients are shown
    assert len(mixed) == len(reference) == 2
    for got, want in zip(mixed, reference):
        assert abs(got - want) / want < 0.05  # bfloat16 compute, not 32768 times too big
