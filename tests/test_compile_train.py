"""``Model(..., compile=True)`` and ``mixprec train --compile``: the compiled network trains
to the same parameters as the eager one, at every level."""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from mixprec.cli import main
from mixprec.train import Model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Compiled code keeps fake tensors alive; later tests that walk live tensors
    # (memory readings) must not see them.
    dynamo.reset()
    yield
    dynamo.reset()
    gc.collect()


def _data(n: int = 16):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, n, 8)]


def _trained(level: str, compile: bool) -> list[torch.Tensor]:
    dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = Model(net, optimizer=opt, amp_level=level, dtype=torch.bfloat16, compile=compile)
    model.train(1, _data())
    return [p.detach().float().clone() for p in model.network.parameters()]


def test_compile_flag_compiles_the_network_in_place():
    net = nn.Linear(4, 2)
    model = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), compile=True)
    assert model.network is net and net._compiled_call_impl is not None
    assert set(net.state_dict()) == {"weight", "bias"}  # checkpoints keep their keys
    assert Model(nn.Linear(4, 2)).network._compiled_call_impl is None


def test_compile_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="compile"):
        Model(nn.Linear(4, 2), compile="yes")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "rewrite"])
def test_compiled_model_trains_like_eager(level):
    eager, compiled = _trained(level, False), _trained(level, True)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_cli_train_has_a_compile_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--compile" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_train_compile_matches_eager(tmp_path):
    results = {}
    for flag in ([], ["--compile"]):
        out = tmp_path / ("compiled" if flag else "eager")
        args = ["train", "--out", str(out), "--epochs", "2", "--level", "O1", *flag]
        assert main([*args, "--quiet", "--threads", "1"]) == 0
        results[bool(flag)] = json.loads((out / "metrics.json").read_text())
    eager, compiled = results[False], results[True]
    assert compiled["config"].get("compile") is True
    assert compiled["final_loss_scale"] == eager["final_loss_scale"]
    assert abs(compiled["test_accuracy"] - eager["test_accuracy"]) < 0.02, (compiled, eager)
