"""The lean amp level (O3's casts, Kahan-compensated updates) and ``amp.initialize``'s
``master_weights=`` option, through the API, ``Model`` and the command line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from mixprec import Model, amp
from mixprec.cli import main
from mixprec.loss_scale import NoOpLossScale
from mixprec.train.models import MLP

FAST = ["--quiet", "--threads", "1", "--device", "cpu"]  # the CPU is the reference here


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _steps(net: nn.Module, opt, n: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x, y = torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
        opt.scale_loss(nn.functional.cross_entropy(net(x), y)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_lean_is_o3_with_kahan_compensated_updates():
    lean_net, o3_net = _net(), _net()
    lean_net, lean = amp.initialize(
        lean_net, torch.optim.AdamW(lean_net.parameters(), lr=1e-3), "lean", torch.bfloat16
    )
    o3_net, o3 = amp.initialize(o3_net, torch.optim.AdamW(o3_net.parameters(), lr=1e-3), "O3",
                                torch.bfloat16, master_weights="kahan")  # fmt: skip
    assert {p.dtype for p in lean_net.parameters()} == {torch.bfloat16}  # norms too, as O3
    assert lean.master_weights == "kahan" and isinstance(lean.loss_scaler, NoOpLossScale)
    assert amp.get_policy(lean_net).compute_dtype == torch.bfloat16
    for a, b in zip(_steps(lean_net, lean), _steps(o3_net, o3)):
        assert torch.equal(a, b)
    # Adam's moments are bfloat16: the inner optimizer stepped the parameters themselves.
    moments = [s["exp_avg"].dtype for s in lean.inner_optimizer.state.values()]
    assert moments and set(moments) == {torch.bfloat16}


def test_lean_keeps_updates_that_plain_o3_rounds_away():
    """AdamW steps of 1e-4 on bfloat16 weights (half an ulp of 0.1 is 2e-4): O3 loses most
    of them, lean tracks O2's float32 masters (the reference) far closer."""
    runs = {}
    for level in ("O2", "O3", "lean"):
        net = _net()
        net, opt = amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-4), level,
                                  torch.bfloat16, loss_scale="none")  # fmt: skip
        _steps(net, opt, n=30)
        runs[level] = torch.cat([p.detach().float().flatten() for p in net.parameters()])
    start = torch.cat([p.detach().flatten() for p in _net().parameters()])
    o3_error = (runs["O3"] - runs["O2"]).norm()
    assert o3_error > 0.3 * (runs["O2"] - start).norm()
    assert (runs["lean"] - runs["O2"]).norm() < 0.5 * o3_error  # measured: 0.3


def test_o2_split_masters_train_bit_identically_to_fp32_masters():
    a, b = _net(), _net()
    a, opt_a = amp.initialize(a, torch.optim.AdamW(a.parameters(), lr=1e-2), "O2", torch.bfloat16)
    b, opt_b = amp.initialize(b, torch.optim.AdamW(b.parameters(), lr=1e-2), "O2", torch.bfloat16,
                              master_weights="split")  # fmt: skip
    assert (opt_a.master_weights, opt_b.master_weights) == (True, "split")  # True: float32
    for x, y in zip(_steps(a, opt_a), _steps(b, opt_b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("level", "dtype", "value", "error", "words"),
    [
        ("O1", torch.bfloat16, "kahan", ValueError, ["O1", "float32", "O2, O3 or lean"]),
        ("O0", torch.bfloat16, True, ValueError, ["O0", "nothing to keep masters of"]),
        ("lean", torch.float16, "stochastic", ValueError, ["bfloat16", "float16"]),
        ("O2", torch.float16, "split", ValueError, ["bfloat16"]),
        ("O2", torch.bfloat16, "fp64", ValueError, ["master_weights", "'fp64'", "kahan"]),
        ("O3", torch.bfloat16, 1, TypeError, ["master_weights", "int"]),
        ("LEAN", "int8", None, ValueError, ["dtype", "'int8'"]),
    ],
)
def test_bad_master_weights_are_refused_and_change_nothing(level, dtype, value, error, words):
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(error) as info:
        amp.initialize(net, opt, level, dtype, master_weights=value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert amp.get_policy(net) is None
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, before[name]) and tensor.dtype == torch.float32, name
    assert opt.state == {}


def test_model_trains_at_the_lean_level():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    y = (x[:, 0] > 0).long()
    net = MLP(16, hidden=(32,), num_classes=2)
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2), amp_level="lean",
                  dtype=torch.bfloat16, metrics=["accuracy"])  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model.train(5, loader)
    assert model.optimizer.master_weights == "kahan"
    assert model.eval(loader)["accuracy"] > 0.9


def test_cli_level_lean_trains_and_resumes_exactly(tmp_path, monkeypatch, dies_after_epoch):
    """``mixprec train --level lean`` records the level; a run that dies after epoch 2 and
    resumes ends with the uninterrupted run's weights and compensation buffers."""
    common = ["--level", "lean", "--model", "mlp", "--batch-size", "128", "--epochs", "3", *FAST]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", "--out", str(full), *common]) == 0
    with pytest.raises(dies_after_epoch(2)):
        main(["train", "--out", str(part), *common])
    monkeypatch.undo()
    assert main(["train", "--resume", str(part), *FAST]) == 0
    assert json.loads((full / "config.json").read_text())["level"] == "lean"
    a = torch.load(full / "checkpoints" / "epoch0003.pt", weights_only=False)
    b = torch.load(part / "checkpoints" / "epoch0003.pt", weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    comp_a = a["optimizer"]["mixprec"]["master"]
    comp_b = b["optimizer"]["mixprec"]["master"]
    assert comp_a.keys() == comp_b.keys() and comp_a["mode"] == "kahan"
    assert any(c.abs().sum() > 0 for c in comp_a["compensation"])  # the buffers hold something
    for key, value in comp_a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, comp_b[key]), key
        elif isinstance(value, list):
            assert all(torch.equal(u, v) for u, v in zip(value, comp_b[key])), key
    assert json.loads((full / "metrics.json").read_text())["test_accuracy"] > 0.9
