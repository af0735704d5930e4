"""Float8 all-gather of weights under FSDP2: the hooks called directly (one process), and
2 gloo ranks training under ``fully_shard`` against the same model without float8
all-gather (bit for bit) and against one process on the global batch (close), with the
bytes each all-gather moves counted by a custom all-gather."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo import needs_gloo
from torch import nn

from mixprec.float8 import (
    Float8AllGatherWeight,
    Float8Conv1D,
    Float8GatheredWeight,
    Float8Linear,
    convert_to_float8,
    enable_fsdp_float8_all_gather,
    precompute_float8_amax_for_fsdp,
)
from mixprec.tools import run_on_ranks


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (in memory): what the pre-hook's all-reduce runs over."""
    if dist.is_initialized():
        pytest.skip("a process group is initialised already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def fake_mesh(group, size: int = 1):
    """What the pre-hook reads of FSDP2's mesh: its size and its group."""
    return types.SimpleNamespace(size=lambda: size, get_group=lambda: group)


def layer(cls=Float8Linear, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    f8 = cls(32, 48) if cls is Float8Linear else cls(48, 32)
    enable_fsdp_float8_all_gather(f8)
    return f8


def plain_weight(module: nn.Module) -> torch.Tensor:
    return module.weight._tensor


@needs_gloo
@pytest.mark.parametrize("cls", [Float8Linear, Float8Conv1D])
def test_hooks_give_the_layers_own_cast_and_forward(one_rank_group, cls):
    f8 = layer(cls)
    weight = f8.weight
    assert isinstance(weight, Float8AllGatherWeight) and isinstance(weight, nn.Parameter)
    (data,), (inv_scale,) = weight.fsdp_pre_all_gather(
        fake_mesh(one_rank_group), weight.size(), weight.stride(), f8, None
    )
    reference = cls(32, 48) if cls is Float8Linear else cls(48, 32)
    with torch.no_grad():
        reference.weight.copy_(plain_weight(f8))
        reference.bias.copy_(f8.bias)
    want8, want_inv = reference.weight_scaling._cast(reference.weight.detach())
    assert data.dtype == torch.float8_e4m3fn and data.shape == weight.shape
    assert torch.equal(data.view(torch.uint8), want8.view(torch.uint8))
    assert torch.equal(inv_scale, want_inv)
    assert torch.equal(f8.weight_scaling.scale, reference.weight_scaling.scale)
    gathered, inner = weight.fsdp_post_all_gather((data,), (inv_scale,), torch.float32)
    assert isinstance(gathered, Float8GatheredWeight) and inner == (data,)
    assert gathered.dtype == torch.float32 and gathered.shape == weight.shape

    # The layer's forward takes the gathered weight as its float8 weight: same output and
    # gradients as the plain layer casting its own weight.
    f8.weight = nn.Parameter(gathered)
    x = torch.randn(4, 3, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = f8(xa), reference(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert f8.weight.grad.dtype == torch.float32
    assert torch.equal(f8.weight.grad, reference.weight.grad)


@needs_gloo
def test_pre_hook_pads_a_short_shard_and_post_hook_updates_out(one_rank_group):
    f8 = layer()
    short = Float8AllGatherWeight(plain_weight(f8)[:10].clone())
    (data,), (inv_scale,) = short.fsdp_pre_all_gather(
        fake_mesh(one_rank_group, 3), torch.Size([30, 32]), (32, 1), f8, None
    )
    assert data.shape == (10, 32)  # 30 rows on 3 ranks: 10 each, no padding
    (data,), (inv_scale,) = short.fsdp_pre_all_gather(
        fake_mesh(one_rank_group, 2), torch.Size([24, 32]), (32, 1), f8, None
    )
    assert data.shape == (12, 32) and torch.all(data[10:].float() == 0)
    gathered, _ = short.fsdp_post_all_gather((data,), (inv_scale,), torch.bfloat16)
    assert gathered.dtype == torch.bfloat16
    new_inv = inv_scale * 2
    assert short.fsdp_post_all_gather((data,), (new_inv,), torch.bfloat16, out=gathered) is None
    assert gathered.float8_parts()[1] is new_inv
    with pytest.raises(TypeError, match="Float8GatheredWeight"):
        short.fsdp_post_all_gather((data,), (new_inv,), torch.bfloat16, out=torch.zeros(2))


def test_gathered_weight_views_dequantizes_and_refuses_writes():
    w = torch.tensor([[0.5, -2.0, 1.0], [0.25, 4.0, -0.75]])
    data, inv = (w * 64).to(torch.float8_e4m3fn), torch.tensor(1 / 64)
    g = Float8GatheredWeight(data, inv, torch.bfloat16)
    assert g.dtype == torch.bfloat16 and g.shape == (2, 3)
    t = g.t()
    assert isinstance(t, Float8GatheredWeight) and t.float8_parts()[0].shape == (3, 2)
    assert torch.equal(t.float8_parts()[0].view(torch.uint8), data.t().view(torch.uint8))
    assert torch.equal(g + 0, w.to(torch.bfloat16))  # exact: all values fit float8
    with pytest.raises(RuntimeError, match="sharded parameters"):
        g.add_(1.0)


def test_sharded_weight_computes_as_its_tensor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    twin = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    twin.load_state_dict(model.state_dict())
    convert_to_float8(model, fsdp_float8_all_gather=True)
    convert_to_float8(twin)
    x = torch.randn(8, 32)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    for m, opt in zip((model, twin), opts):
        m(x).square().mean().backward()
        opt.step()
    assert type(model[0].weight) is Float8AllGatherWeight  # the optimizer kept it wrapped
    assert torch.equal(plain_weight(model[0]), twin[0].weight.detach())
    assert torch.equal(model(x), twin(x))


def test_refusals_change_nothing():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    before = [type(m) for m in model]
    with pytest.raises(ValueError, match="recipe='delayed'.*recipe='dynamic'"):
        convert_to_float8(model, "delayed", fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="recipe='rowwise'"):
        convert_to_float8(model, "rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(TypeError, match="fsdp_float8_all_gather must be True or False"):
        convert_to_float8(model, fsdp_float8_all_gather="yes")
    assert [type(m) for m in model] == before
    convert_to_float8(model, "delayed", module_filter="0")
    with pytest.raises(ValueError, match="layer '0' uses recipe='delayed'"):
        convert_to_float8(model, module_filter="2", fsdp_float8_all_gather=True)
    assert type(model[2]) is nn.Linear and type(model[0].weight) is nn.Parameter
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        enable_fsdp_float8_all_gather("model")


def test_tied_weights_stay_tied():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].weight = model[0].weight
    convert_to_float8(model, fsdp_float8_all_gather=True)
    assert model[0].weight is model[1].weight
    assert enable_fsdp_float8_all_gather(model) == ["0", "1"]  # again: unchanged
    assert model[0].weight is model[1].weight and type(model[0].weight) is Float8AllGatherWeight


# -- 2 ranks ------------------------------------------------------------------------

STEPS = 3
IN, HIDDEN = 64, 128


def build(float8_all_gather: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, IN))
    convert_to_float8(model, fsdp_float8_all_gather=float8_all_gather)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, IN, generator=g), torch.randn(8, IN, generator=g)


def train(model: nn.Module, step_batch, precompute_at=()) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        if step in precompute_at:  # after the previous step, as a training loop calls it
            precompute_float8_amax_for_fsdp(model)
        x, y = step_batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return (t._tensor if isinstance(t, Float8AllGatherWeight) else t).clone()


def sharded_run(rank: int, float8_all_gather: bool, param_dtype: torch.dtype | None,
                precompute_at=()) -> dict:  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    gathered: list[tuple[int, torch.dtype]] = []  # (bytes sent by this rank, dtype)

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            gathered.append((input_tensor.numel() * input_tensor.element_size(),
                             input_tensor.dtype))  # fmt: skip
            return super().__call__(output_tensor, input_tensor, group, async_op)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    model = build(float8_all_gather)
    for module in (model[0], model[2]):
        fully_shard(module, mesh=mesh, mp_policy=policy)
        module.set_custom_all_gather(CountingAllGather())
    fully_shard(model, mesh=mesh, mp_policy=policy)
    wrapped = [type(p.to_local()).__name__ for p in model.parameters()]
    all_reduces = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        all_reduces.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        losses = train(model, lambda step: batch(rank, step), precompute_at)
    finally:
        dist.all_reduce = all_reduce
    refused = ""
    try:
        enable_fsdp_float8_all_gather(model)
    except ValueError as err:
        refused = str(err)
    return {
        "params": [full(p) for p in model.parameters()],
        "losses": losses,
        "gathered": [b for b, _ in gathered],
        "dtypes": sorted({str(d) for _, d in gathered}),
        "wrapped": wrapped,
        "scale": model[0].weight_scaling.scale.clone(),
        "refused": refused,
        "all_reduces": all_reduces,
    }


def fsdp_float8_checks(rank: int) -> dict:
    runs = {
        "float8": sharded_run(rank, True, None),
        "precomputed": sharded_run(rank, True, None, precompute_at=range(STEPS)),
        "precomputed_once": sharded_run(rank, True, None, precompute_at=(0,)),
        "float32": sharded_run(rank, False, None),
        "float8_bf16": sharded_run(rank, True, torch.bfloat16),
        "bf16": sharded_run(rank, False, torch.bfloat16),
    }
    if rank == 0:
        runs["reference"] = unsharded_reference()
    return runs


def unsharded_reference() -> dict:
    """One process, the unsharded float8 model: each rank's batch through the whole model
    (the float8 casts of inputs and gradients see that rank's batch, as under FSDP),
    the two gradients averaged, one SGD step."""
    model = build(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    params = list(model.parameters())
    losses: list[list[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        grads = []
        for r in range(2):
            x, y = batch(r, step)
            loss = F.mse_loss(model(x), y)
            grads.append(torch.autograd.grad(loss, params))
            losses[r].append(loss.detach())
        for p, g0, g1 in zip(params, *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return {"params": [full(p) for p in params], "losses": losses}


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(fsdp_float8_checks, world_size=2, timeout=180)


def weight_numels() -> list[tuple[int, int]]:
    return [(HIDDEN * IN, HIDDEN), (IN * HIDDEN, IN)]  # (weight, bias) of each layer


@needs_gloo
@pytest.mark.slow
def test_float8_all_gather_trains_as_the_float32_all_gather_bit_for_bit(ranks):
    for rank in ranks:
        assert rank["float8"]["wrapped"][0] == "Float8AllGatherWeight"
        assert rank["float32"]["wrapped"][0] == "Tensor"
        for got, want in zip(rank["float8"]["params"], rank["float32"]["params"]):
            assert torch.equal(got, want)
        assert torch.equal(torch.stack(rank["float8"]["losses"]),
                           torch.stack(rank["float32"]["losses"]))  # fmt: skip
        assert torch.equal(rank["float8"]["scale"], rank["float32"]["scale"])
    for got, want in zip(ranks[0]["float8"]["params"], ranks[1]["float8"]["params"]):
        assert torch.equal(got, want)  # every rank holds the same model


@needs_gloo
@pytest.mark.slow
def test_float8_all_gather_matches_the_unsharded_float8_model(ranks):
    reference = ranks[0]["reference"]
    for r, rank in enumerate(ranks):
        got, want = torch.stack(rank["float8"]["losses"]), torch.stack(reference["losses"][r])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(ranks[0]["float8"]["params"], reference["params"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_gloo
@pytest.mark.slow
def test_all_gathers_move_one_byte_per_weight_element(ranks):
    world = 2
    float8 = sum(w // world * 1 + b // world * 4 for w, b in weight_numels())
    float32 = sum((w + b) // world * 4 for w, b in weight_numels())
    bf16 = sum((w + b) // world * 2 for w, b in weight_numels())
    float8_bf16 = sum(w // world * 1 + b // world * 2 for w, b in weight_numels())
    for rank in ranks:
        for name, per_step in (("float8", float8), ("float32", float32), ("bf16", bf16),
                               ("float8_bf16", float8_bf16)):  # fmt: skip
            sent = rank[name]["gathered"]
            # One gather per layer for the forward, one again for the backward (FSDP2
            # reshards after the forward).
            assert len(sent) % STEPS == 0 and sum(sent) % STEPS == 0
            per_layer = sorted(set(sent))
            layer_bytes = {w // world * (1 if "float8" in name else (2 if "bf16" in name else 4))
                           + b // world * (2 if "bf16" in name else 4)
                           for w, b in weight_numels()}  # fmt: skip
            assert set(per_layer) == layer_bytes, (name, per_layer, layer_bytes)
            assert sum(layer_bytes) == per_step
        assert rank["float8"]["dtypes"] == ["torch.uint8"]  # float8 and float32 mixed: bytes
        assert rank["float32"]["dtypes"] == ["torch.float32"]
        assert "before fully_shard" in rank["float8"]["refused"]


@needs_gloo
@pytest.mark.slow
def test_precomputed_amaxes_take_one_all_reduce_per_step_and_change_no_bit(ranks):
    # Without it each gather all-reduces its weight's amax: 2 weights x (forward and
    # backward gather) x 3 steps. Precomputed after every step: one all-reduce of both
    # amaxes per step. Precomputed once: the first step's gathers use it, the later steps'
    # see their shards changed by the optimizer and all-reduce for themselves.
    for rank in ranks:
        assert rank["float8"]["all_reduces"] == [1] * (2 * 2 * STEPS)
        assert rank["precomputed"]["all_reduces"] == [2] * STEPS
        assert rank["precomputed_once"]["all_reduces"] == [2] + [1] * (2 * 2 * (STEPS - 1))
        for run in ("precomputed", "precomputed_once"):
            for got, want in zip(rank[run]["params"], rank["float8"]["params"]):
                assert torch.equal(got, want), run
            assert torch.equal(torch.stack(rank[run]["losses"]),
                               torch.stack(rank["float8"]["losses"]))  # fmt: skip


def test_precompute_refuses_a_model_without_sharded_float8_weights():
    model = nn.Sequential(nn.Linear(32, 32))
    convert_to_float8(model, fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="no FSDP2-sharded float8 all-gather weight"):
        precompute_float8_amax_for_fsdp(model)  # not sharded yet
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        precompute_float8_amax_for_fsdp(model[0].weight)
