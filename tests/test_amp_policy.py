"""Per-module policies (set_policy / to_float) and the per-step parameter cast cache."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from amp_internals import call_state_left, calls_left, is_hooked
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import amp
from mixprec.policy import Policy, policy_scope, set_global_policy
from mixprec.rewrite import rewrite

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def input_dtypes(model: nn.Module, *inputs) -> tuple[dict[str, torch.dtype], object]:
    seen = {}

    def hook(name):
        return lambda m, args: seen.__setitem__(name, args[0].dtype)

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return seen, out


def mlp(seed=0, *sizes):
    torch.manual_seed(seed)
    sizes = sizes or (4, 8, 8, 2)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def test_one_float32_layer_inside_a_float16_model_keras_example():
    # Keras: Dense(..)(x) under mixed_float16, with Dense(2, dtype="float32") last.
    model = mlp()
    amp.set_policy(model, "mixed_float16")
    amp.set_policy(model[4], "float32")
    seen, out = input_dtypes(model, torch.randn(3, 4))
    assert seen["0"] == F16 and seen["2"] == F16 and seen["4"] == F32
    assert out.dtype == F32  # the float32 last layer's output, as in Keras
    assert {p.dtype for p in model.parameters()} == {F32}
    assert str(amp.get_policy(model)) == "mixed_float16" and amp.get_policy(model[0]) is None
    assert amp.compute_dtype(model[0]) == F16 and amp.compute_dtype(model[4]) == F32


def test_layers_after_a_float32_override_cast_its_output_back():
    model = mlp(0, 4, 8, 8, 8, 2)
    amp.set_policy(model, "mixed_bfloat16")
    amp.to_float(model[2], torch.float32)
    seen, out = input_dtypes(model, torch.randn(3, 4))
    assert seen["2"] == F32 and seen["4"] == BF16 and seen["6"] == BF16
    assert out.dtype == BF16


def test_to_float_is_mindspore_cell_to_float():
    conv = nn.Conv2d(1, 2, 3)
    amp.to_float(conv, torch.bfloat16)
    assert amp.get_policy(conv) == Policy("mixed_bfloat16")
    y = conv(torch.ones(1, 1, 5, 5))
    assert y.dtype == BF16 and conv.weight.dtype == F32
    y.float().sum().backward()
    assert conv.weight.grad.dtype == F32


def test_output_dtype_is_honoured():
    lin = nn.Linear(3, 3)
    amp.set_policy(lin, "p=f32,c=bf16,o=f16")
    assert lin(torch.ones(2, 3)).dtype == F16
    amp.set_policy(lin, "p=bf16,c=bf16,o=f32")  # a second call replaces the policy
    assert lin.weight.dtype == BF16 and lin(torch.ones(2, 3)).dtype == F32


def test_set_policy_without_policy_uses_the_global_one():
    try:
        set_global_policy("mixed_bfloat16")
        a = nn.Linear(2, 2)
        amp.set_policy(a)
        assert amp.get_policy(a) == Policy("mixed_bfloat16")
        with policy_scope("float16"):
            b = nn.Linear(2, 2)
            amp.set_policy(b)
        assert b.weight.dtype == F16
    finally:
        set_global_policy(None)


def test_mixed_policy_gradients_equal_explicit_casts():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    ref_w, ref_b = (p.detach().clone().requires_grad_() for p in (lin.weight, lin.bias))
    x = torch.randn(4, 5)
    amp.set_policy(lin, "p=f32,c=bf16,o=f32")
    lin(x).square().sum().backward()
    F.linear(x.bfloat16(), ref_w.bfloat16(), ref_b.bfloat16()).float().square().sum().backward()
    assert torch.equal(lin.weight.grad, ref_w.grad) and torch.equal(lin.bias.grad, ref_b.grad)


def test_calling_a_member_directly_and_submodules_read_by_their_parent():
    model = mlp()
    amp.set_policy(model, "mixed_bfloat16")
    assert model[0](torch.randn(2, 4)).dtype == BF16  # member: casts and shadows itself
    assert "weight" not in model[0].__dict__  # and cleans up
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    amp.set_policy(mha, "mixed_bfloat16")  # out_proj.weight is read, never called
    x = torch.randn(2, 3, 8)
    out, _ = mha(x, x, x)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert mha.out_proj.weight.grad.dtype == F32


def test_rnn_weights_are_cast_through_their_flat_list():
    lstm = nn.LSTM(4, 6, batch_first=True)
    amp.to_float(lstm, torch.bfloat16)
    out, (h, c) = lstm(torch.randn(2, 3, 4))
    assert out.dtype == h.dtype == BF16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == F32 for p in lstm.parameters())
    assert all(w.dtype == F32 for w in lstm._flat_weights)  # restored after the call


def test_batchnorm_in_a_mixed_region_keeps_float32_weights_and_statistics():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    amp.set_policy(model, "mixed_bfloat16")
    out = model(torch.randn(4, 1, 5, 5))
    assert out.dtype == BF16 and model[1].running_mean.dtype == F32
    assert model[1].running_mean.abs().sum() > 0


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        self.fc(x)
        raise RuntimeError("boom")


def test_an_exception_in_forward_leaves_nothing_behind():
    model = Fails()
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1, 2))
    assert "weight" not in model.fc.__dict__
    assert call_state_left() == {}
    assert not torch._C._is_torch_function_mode_enabled()
    assert not torch.is_autocast_enabled("cpu")  # O1's torch.autocast was left
    assert is_hooked(model) and calls_left(model) == {}
    assert calls_left(model.fc) == {}  # its hooks did nothing inside O1's region


def test_an_exception_in_forward_leaves_nothing_behind_with_custom_lists():
    model = Fails()
    amp.initialize(model, level="O1", dtype=torch.bfloat16, white_list=[nn.Linear, torch.mm])
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1, 2))
    assert "weight" not in model.fc.__dict__
    assert call_state_left() == {}
    assert not torch._C._is_torch_function_mode_enabled()
    assert is_hooked(model) and calls_left(model) == {}
    assert is_hooked(model.fc) and calls_left(model.fc) == {}


def test_tied_weights_get_one_gradient_through_both_uses():
    torch.manual_seed(0)
    emb = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    amp.set_policy(model, "mixed_bfloat16")
    model(torch.tensor([[1, 2, 3]])).float().sum().backward()
    ref = nn.Parameter(emb.weight.detach().clone())
    F.linear(
        F.embedding(torch.tensor([[1, 2, 3]]), ref.bfloat16()), ref.bfloat16()
    ).float().sum().backward()
    torch.testing.assert_close(emb.weight.grad, ref.grad)


def test_deepcopy_and_pickle_give_independent_working_models():
    model = mlp()
    amp.set_policy(model, "mixed_bfloat16")
    x = torch.randn(3, 4)
    model(x).float().sum().backward()  # fills the cast cache
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].weight.add_(1.0)
    assert not torch.equal(clone(x), model(x))  # the clone casts its own weights
    assert clone(x).dtype == BF16 and amp.get_policy(clone) == Policy("mixed_bfloat16")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x))
    assert pickle.loads(pickle.dumps(model))(x).dtype == BF16


class CastCounter(TorchDispatchMode):
    """Counts float32 -> low casts of tensors shaped like the weight."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.startswith("_to_copy") and tuple(args[0].shape) == self.shape:
            if args[0].dtype == F32 and kwargs.get("dtype") in (BF16, F16):
                self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_weights_are_cast_once_per_forward_and_never_stale(fused):
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    model = nn.Sequential(lin, nn.Tanh(), lin)  # one weight, used twice per forward
    amp.set_policy(model, "p=f32,c=bf16,o=f32")
    opt = torch.optim.Adam(lin.parameters(), lr=0.1, fused=fused, foreach=None if fused else True)
    x = torch.randn(3, 6)
    counter = CastCounter(lin.weight.shape)
    with counter:
        model(x).sum().backward()
    assert counter.count == 1  # reused within the forward pass
    with counter, torch.no_grad():
        model(x)
    assert counter.count == 2  # a new pass casts again: nothing outlives a forward

    def expected():
        w, b = lin.weight.bfloat16(), lin.bias.bfloat16()
        return F.linear(torch.tanh(F.linear(x.bfloat16(), w, b)), w, b).float()

    opt.step()  # fused Adam updates without a version bump: the next pass sees it
    with counter:
        out = model(x)
    torch.testing.assert_close(out, expected())
    lin.weight.data.mul_(2.0)  # .data edits are invisible to version counters
    with counter:
        out = model(x)
    torch.testing.assert_close(out, expected())
    assert counter.count == 4


def test_inference_mode_casts_are_not_reused_for_training():
    lin = nn.Linear(3, 3)
    amp.set_policy(lin, "mixed_bfloat16")
    with torch.inference_mode():
        lin(torch.ones(1, 3))
    lin(torch.ones(1, 3)).float().sum().backward()
    assert lin.weight.grad is not None


def test_bad_arguments_raise_and_change_nothing():
    model = mlp()
    keys = [sorted(m.__dict__) for m in model.modules()]  # a claim would be an attribute
    with pytest.raises(ValueError, match="mixed_float16"):
        amp.set_policy(model, "mixed_fp8")
    with pytest.raises(TypeError, match="policy must be"):
        amp.set_policy(model, 16)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        amp.set_policy("model", "float16")
    with pytest.raises(ValueError, match="to_float"):
        amp.to_float(model, torch.int8)
    with pytest.raises(ValueError, match="to_float"):
        amp.to_float(model, "fp8")
    assert [sorted(m.__dict__) for m in model.modules()] == keys
    rewrite(model)  # no API claimed the model: the graph rewrite may still take it
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {F32}


def test_policies_and_the_graph_rewrite_exclude_each_other():
    model = mlp()
    rewrite(model, torch.randn(2, 4))
    with pytest.raises(ValueError, match="already uses the mixprec 'rewrite' API"):
        amp.set_policy(model, "mixed_float16")
    fresh = mlp()
    amp.to_float(fresh[0], torch.bfloat16)
    with pytest.raises(ValueError, match="already uses the mixprec 'amp' API"):
        rewrite(fresh[0], torch.randn(2, 4))
    with pytest.raises(ValueError, match="submodule '0' already uses the mixprec 'amp' API"):
        rewrite(fresh, torch.randn(2, 4))


def test_policies_set_before_initialize_are_kept():
    # MindSpore's tutorial: network.conv1.to_float(float16), then amp_level="O2".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(18, 4), nn.Linear(4, 2))
    amp.to_float(model[3], torch.float32)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", BF16)
    seen, out = input_dtypes(model, torch.randn(2, 1, 5, 5))
    assert seen["0"] == BF16 and seen["2"] == BF16 and seen["3"] == F32
    assert model[3].weight.dtype == F32 and model[2].weight.dtype == BF16
    assert out.dtype == F32
    opt.scale_loss(out.sum()).backward()
    opt.step()
