"""Float8 where users reach it: ``amp.initialize(..., fp8=)`` at every level, checkpoints,
``torch.compile``, ``mixprec train --fp8``, ``mixprec compare`` and the epoch metrics."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from mixprec import amp
from mixprec.cli import main
from mixprec.float8 import Float8Linear, convert_to_float8, read_float8_stats

FAST = ["--quiet", "--threads", "1", "--device", "cpu"]  # the CPU is the reference here


@pytest.fixture
def small_data(tmp_path):
    """A small, separable task for the main job: float8 matmuls are slow on a CPU."""
    import numpy as np

    gen = np.random.default_rng(0)
    x = gen.normal(size=(120, 16)).astype("float32")
    path = tmp_path / "small.npz"
    np.savez(path, x=x, y=(x[:, 0] > 0).astype("int64"))
    return ["--data", str(path), "--model", "mlp", "--batch-size", "16"]
LEVELS = ["O0", "O1", "O2", "O3", "lean"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 5))


def _batches(n: int = 4):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen))
            for _ in range(n)]  # fmt: skip


def _train(net, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(net(x), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("level", LEVELS)
def test_fp8_at_every_level_trains_and_stays_near_the_level_without_it(level):
    """The first layer (16x32) runs in float8, the head (32x5) cannot; same Parameters; the
    first step's loss is the level's own within float8's error (e4m3: 2**-4 relative)."""
    plain, fp8 = _net(), _net()
    params = list(fp8.parameters())
    plain, opt_plain = amp.initialize(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2),
                                      level, torch.bfloat16)  # fmt: skip
    fp8, opt = amp.initialize(fp8, torch.optim.AdamW(fp8.parameters(), lr=1e-2), level,
                              torch.bfloat16, fp8=True)  # fmt: skip
    assert isinstance(fp8[0], Float8Linear) and type(fp8[3]) is nn.Linear
    assert all(a is b for a, b in zip(fp8.parameters(), params))
    batches = _batches(8)
    ours, theirs = _train(fp8, opt, batches), _train(plain, opt_plain, batches)
    assert abs(ours[0] - theirs[0]) < 0.05 * theirs[0]
    assert ours[-1] < ours[0]  # it learns
    stats = read_float8_stats(fp8)["0"]
    assert stats["amax_input"] > 0 and stats["amax_grad"] > 0
    assert stats["saturated_fraction_input"] == 0.0  # dynamic scaling clips nothing


def test_fp8_through_initialize_equals_converting_first():
    a, b = _net(), _net()
    a, opt_a = amp.initialize(a, torch.optim.SGD(a.parameters(), lr=0.1), "O2", torch.bfloat16,
                              fp8="delayed")  # fmt: skip
    convert_to_float8(b, "delayed")
    b, opt_b = amp.initialize(b, torch.optim.SGD(b.parameters(), lr=0.1), "O2", torch.bfloat16)
    assert _train(a, opt_a, _batches()) == _train(b, opt_b, _batches())
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    ("model", "fp8", "error", "words"),
    [
        (nn.Sequential(nn.Linear(3, 5)), True, ValueError, ["no linear layer", "in_features=3"]),
        (None, "fast", ValueError, ["fp8", "'fast'", "'delayed'"]),
        (None, 1, TypeError, ["fp8", "int"]),
    ],
)
def test_bad_fp8_is_refused_and_changes_nothing(model, fp8, error, words):
    net = model if model is not None else _net()
    before = copy.deepcopy(net.state_dict())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with pytest.raises(error) as info:
        amp.initialize(net, opt, "O2", torch.bfloat16, fp8=fp8)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert amp.get_policy(net) is None and not any(isinstance(m, Float8Linear) for m in net.modules())
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(t, before[k]) for k, t in net.state_dict().items())
    assert opt.state == {}


def test_checkpoint_carries_the_amax_histories_and_resumes_exactly():
    def fresh():
        net = _net()
        return amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-2), "O2",
                              torch.bfloat16, fp8="delayed")  # fmt: skip

    batches = _batches(6)
    net, opt = fresh()
    _train(net, opt, batches)
    net2, opt2 = fresh()
    _train(net2, opt2, batches[:3])
    saved = copy.deepcopy((net2.state_dict(), opt2.state_dict()))
    assert "0.grad_scaling.amax_history" in saved[0] and saved[0]["0.grad_scaling.amax_history"].any()
    net3, opt3 = fresh()
    net3.load_state_dict(saved[0])
    opt3.load_state_dict(saved[1])
    _train(net3, opt3, batches[3:])
    for (name, x), y in zip(net.state_dict().items(), net3.state_dict().values()):
        assert torch.equal(x, y), name


def test_fp8_level_compiles_without_graph_breaks_and_equals_eager():
    eager, _ = amp.initialize(_net(), None, "O2", torch.bfloat16, fp8="delayed")
    compiled_net = copy.deepcopy(eager)
    x = _batches(1)[0][0]
    dynamo.reset()
    report = dynamo.explain(lambda t: copy.deepcopy(eager)(t))(x)
    assert report.graph_break_count == 0, [str(b.reason)[:200] for b in report.break_reasons]
    compiled = torch.compile(lambda t: compiled_net(t), backend="aot_eager")
    for _ in range(3):
        want, got = eager(x), compiled(x)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for (name, a), b in zip(eager.state_dict().items(), compiled_net.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)  # amax histories too
    dynamo.reset()


def test_cli_fp8_reports_layers_records_stats_and_resumes(tmp_path, capsys, small_data):
    out = tmp_path / "run"
    assert main(["train", "--fp8", "delayed", *small_data, "--epochs", "2", "--out", str(out),
                 *FAST]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "float8 (delayed): layers.1, layers.3" in text and "layers.5 (out_features=2" in text
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.75
    epochs = metrics["float8"]["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert set(epochs[-1]["layers"]) == {"layers.1", "layers.3"}
    assert epochs[-1]["layers"]["layers.1"]["amax_grad"] > 0
    assert json.loads((out / "config.json").read_text())["fp8"] == "delayed"
    header = (out / "metrics.csv").read_text().splitlines()[0]
    assert "fp8_saturated" in header and "fp8_overflows" in header
    checkpoint = torch.load(out / "checkpoints" / "epoch0002.pt", weights_only=False)
    assert checkpoint["model"]["layers.1.input_scaling.amax_history"].any()
    # A resumed run keeps float8 and its recipe; another recipe is refused by name.
    assert main(["train", "--resume", str(out), "--fp8", "dynamic", *FAST]) == 2
    assert "--fp8 dynamic contradicts" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--epochs", "3", *FAST]) == 0
    assert len(json.loads((out / "metrics.json").read_text())["float8"]["epochs"]) == 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "lenet5"], ["--fp8", "lenet5", "fc1", "not a multiple of 16"]),
    ],
)
def test_cli_fp8_usage_errors(argv, words, tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["train", "--fp8", *argv, "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    for word in words:
        assert word in err, (word, err)
    assert not out.exists()


def test_compare_has_an_fp8_entry(tmp_path, small_data):
    out = tmp_path / "cmp"
    assert main(["compare", "--levels", "O2+fp8", *small_data, "--epochs", "2", "--out", str(out),
                 *FAST]) == 0  # fmt: skip
    rows = json.loads((out / "compare.json").read_text())
    assert [r["config"] for r in rows] == ["O2 bfloat16 fp8-dynamic"]
    assert rows[0]["accuracy"] > 0.8


def _fsdp2_float8_rank(rank: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = _fsdp_net()
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        net(_fsdp_batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in net.state_dict().items() if k.endswith(("weight", "bias"))}


def _fsdp_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8(net, "delayed")
    return net


def _fsdp_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))


@pytest.mark.slow  # two processes; FSDP2 itself is covered by test_distributed_fsdp.py
def test_fsdp2_sharded_float8_layers_train_like_one_process():
    """FSDP2 gathers each float8 layer's weight before its forward, so the casts see the
    whole weight: both ranks end with the same parameters, within float8's error of one
    process on the global batch. Each rank scales its own activations and gradients, so
    the gradients differ from one process's by float8 rounding: up to (2**-3 + 2**-4) of
    their magnitude (e5m2 gradient times e4m3 operand), hence 0.25 of the update here."""
    from mixprec.tools import run_on_ranks

    first, second = run_on_ranks(_fsdp2_float8_rank, world_size=2, timeout=120)
    net = _fsdp_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        x = torch.cat([_fsdp_batch(rank, step) for rank in range(2)])
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
        start = _fsdp_net().state_dict()[name]
        moved = (net.state_dict()[name] - start).abs().max()
        assert (tensor - net.state_dict()[name]).abs().max() < 0.25 * moved + 1e-6, name


def test_the_graph_rewrite_keeps_float8_layers_whole_and_explains_them():
    """Export would trace through the float8 autograd.Function and lose its backward, so a
    model with float8 layers is captured by symbolic_trace with each one kept as a call:
    explain names them (colour float8), the rest is painted as usual, gradients reach
    every weight and the amax histories advance."""
    from mixprec import LossScaleOptimizer
    from mixprec.rewrite import explain, rewrite

    net = _net()
    convert_to_float8(net, "delayed")
    gm = rewrite(net, (torch.randn(4, 16),), dtype=torch.bfloat16)
    report = explain(gm)
    rows = {row.module: row for row in report.rows if row.op == "linear"}
    assert rows["0"].colour == "float8" and "float8 layer" in rows["0"].reason
    assert rows["3"].colour == "bfloat16"  # the 32x5 head is an ordinary linear
    assert report.method == "symbolic_trace"
    opt = LossScaleOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))
    losses = _train(gm, opt, _batches(8))
    assert all(p.grad is None for p in net.parameters())  # zero_grad ran; now check a step
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(gm(x), y).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    assert net[0].grad_scaling.amax_history[:2].all()
    assert losses[-1] < losses[0]


def test_cli_rewrite_level_with_fp8_trains(tmp_path, small_data, capsys):
    out = tmp_path / "rw"
    assert main(["train", "--level", "rewrite", "--fp8", *small_data, "--epochs", "2",
                 "--out", str(out), *FAST]) == 0  # fmt: skip
    assert "float8 (dynamic): layers.1, layers.3" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test_accuracy"] > 0.8
    assert metrics["float8"]["epochs"][-1]["layers"]["layers.3"]["amax_grad"] > 0


def test_the_precision_report_carries_float8_amax_and_saturation():
    """``mixprec.diagnose`` runs float8 layers in float8 and reports their statistics from
    the last batch (the same numbers ``read_float8_stats`` gives), leaving the model's
    float8 state as it was; the report's JSON round-trips them."""
    import mixprec
    from mixprec.diagnostics import PrecisionReport

    net = _net()
    convert_to_float8(net, "delayed")
    before = copy.deepcopy(net.state_dict())
    batches = _batches(3)
    report = mixprec.diagnose(net, nn.functional.cross_entropy, batches, torch.bfloat16)
    assert all(torch.equal(t, before[k]) for k, t in net.state_dict().items())
    assert set(report.float8) == {"0"}
    replay = copy.deepcopy(net)
    for x, y in batches:
        nn.functional.cross_entropy(replay(x), y).backward()
    assert report.float8["0"] == read_float8_stats(replay)["0"]
    assert any(line.startswith("float8 layer 0: amax input") for line in report.summary_lines())
    assert PrecisionReport.from_dict(report.to_dict()).float8 == report.float8
    assert mixprec.diagnose(_net(), nn.functional.cross_entropy, batches).float8 is None


@pytest.mark.parametrize("dtypes", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_the_float32_emulation_computes_what_the_float8_kernel_does(dtypes, monkeypatch):
    """Where ``torch._scaled_mm`` has no kernel (AVX2-only CPUs, older GPUs) the products are
    emulated in float32: exact products, so equal to a float64 reference up to float32
    summation, and to the kernel itself where this machine has one."""
    from mixprec.float8 import _matmul, as_float8_dtype, native_scaled_mm, scaled_mm

    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(32, 64, generator=gen) * 8).to(as_float8_dtype(dtypes[0]))
    b = (torch.randn(48, 64, generator=gen) * 8).to(as_float8_dtype(dtypes[1])).t()
    sa, sb = torch.tensor(0.25), torch.tensor(3.0)
    reference = (a.double() @ b.double() * 0.75).float()
    native = native_scaled_mm("cpu")
    monkeypatch.setitem(_matmul._PROBED, "cpu", False)  # as on a device without the kernel
    emulated = scaled_mm(a, b, sa, sb, torch.float32)
    torch.testing.assert_close(emulated, reference, rtol=1e-6, atol=1e-5)
    if native:
        kernel = torch._scaled_mm(a, b.t().contiguous().t(), scale_a=sa, scale_b=sb,
                                  out_dtype=torch.float32)  # fmt: skip
        torch.testing.assert_close(emulated, kernel, rtol=1e-6, atol=1e-5)
    # A whole float8 layer on the emulation: its first loss is the float32 model's, within
    # float8's error, as on the kernel (test_fp8_at_every_level_...).
    net, plain = _net(), _net()
    net, opt = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O0", fp8=True)
    x, y = _batches(1)[0]
    loss, want = (float(nn.functional.cross_entropy(m(x), y).detach()) for m in (net, plain))
    assert abs(loss - want) < 0.05 * want


def test_cli_fp8_takes_the_rowwise_recipe(tmp_path, capsys, small_data):
    out = tmp_path / "run"
    assert main(["train", "--fp8", "rowwise", *small_data, "--epochs", "1", "--out", str(out),
                 *FAST]) == 0  # fmt: skip
    assert "float8 (rowwise): layers.1, layers.3" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["fp8"] == "rowwise"
    assert main(["train", "--fp8", "rowwise_by_column", *small_data, "--out", str(out)]) == 2
    assert "rowwise_with_gw_hp" in capsys.readouterr().err  # the choices are named
