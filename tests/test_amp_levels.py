"""amp.initialize levels O0-O3/auto: what each kind of layer computes in, what the
optimizer steps, loss-scale defaults, custom lists, transformers, and rejected calls."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from amp_internals import batchnorm_low_input
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import amp
from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.numerics import any_nonfinite
from mixprec.optim import LossScaleOptimizer
from mixprec.rewrite import rewrite

F32 = torch.float32
LOW = [torch.bfloat16, torch.float16]


class Zoo(nn.Module):
    """One of each kind of layer the levels treat differently."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # BN follows
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.gn = nn.GroupNorm(4, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.prelu = nn.PReLU()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.relu(self.bn(self.conv(x)))).flatten(1)
        h = self.gn(self.ln(self.fc(h)))
        seq = h.unsqueeze(1).expand(-1, 3, -1)
        a, _ = self.attn(seq, seq, seq)
        r, _ = self.lstm(a)
        return self.head(self.prelu(r[:, -1]))


WHITE = ("conv", "fc", "attn", "lstm", "prelu", "head")
NORMS = ("bn", "ln", "gn")


def record_compute(model: nn.Module, *inputs: torch.Tensor) -> dict[str, tuple]:
    """Per submodule: (input dtype, {param: dtype as the forward reads it}).

    Forward pre-hooks registered after amp's run after its input cast and
    parameter shadowing, so they see exactly what the layer computes with.
    """
    seen: dict[str, tuple] = {}

    def hook(name):
        def pre(module, args):
            x = next(a for a in args if isinstance(a, torch.Tensor))
            params = {
                n: getattr(module, n).dtype for n, p in module._parameters.items() if p is not None
            }
            seen[name] = (x.dtype, params)

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    seen[""] = (out.dtype, {})
    return seen


def expected_compute(level: str, low: torch.dtype, name: str) -> torch.dtype:
    if level == "O0":
        return F32
    if name in NORMS:
        return low if level == "O3" else F32
    return low


def expected_storage(level: str, low: torch.dtype, name: str) -> torch.dtype:
    if level in ("O0", "O1") or (level == "O2" and name in NORMS):
        return F32
    return low


def make_zoo(level, low, **kwargs):
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return (*amp.initialize(model, opt, level, low, **kwargs), model)


@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("level", ["O0", "O2", "O3"])  # O1 is torch.autocast: test_o1_autocast
def test_each_kind_of_layer_computes_in_the_levels_dtype(level, low):
    model, opt, _ = make_zoo(level, low)
    x = torch.randn(5, 1, 4, 4)
    seen = record_compute(model, x)
    assert seen[""][0] == F32  # the model's output, hence the loss, is float32
    for name in (*WHITE, *NORMS, "relu"):
        in_dtype, params = seen[name]
        want = expected_compute(level, low, name)
        # O2's float32 BatchNorm takes its low input as it comes (its kernel computes
        # in float32 from it); every other layer sees the level's dtype.
        want_in = low if (level, name) == ("O2", "bn") else want
        assert in_dtype == want_in, (name, in_dtype, want_in)
        assert all(d == want for d in params.values()), (name, params, want)
        module = getattr(model, name)
        stored = {p.dtype for p in module.parameters()}
        assert stored <= {expected_storage(level, low, name)}, (name, stored)


@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_optimizer_steps_float32_where_the_level_says(level, low):
    model, opt, _ = make_zoo(level, low)
    assert isinstance(opt, LossScaleOptimizer)
    assert opt.master_weights == (level == "O2")
    stepped = {p.dtype for g in opt.param_groups for p in g["params"]}
    assert stepped == ({low} if level == "O3" else {F32})
    stepped = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in stepped]
    loss = F.cross_entropy(model(torch.randn(6, 1, 4, 4)), torch.tensor([0, 1, 2, 0, 1, 2]))
    assert loss.dtype == F32
    opt.scale_loss(loss).backward()
    opt.step()
    opt.zero_grad()
    assert int(opt.iterations) == 1 and int(opt.skipped_steps) == 0
    changed = [not torch.equal(p.detach(), b) for p, b in zip(stepped, before)]
    # In O3 an update below half a low-precision ulp rounds away (why O2 keeps masters).
    assert all(changed) if level != "O3" else any(changed)
    model_params = list(model.parameters())
    assert {p.dtype for p in model_params} == (
        {F32} if level in ("O0", "O1") else {F32, low} if level == "O2" else {low}
    )
    if level == "O2":  # the model holds the masters' values, in its own dtype
        for p, master in zip(model_params, stepped):
            assert torch.equal(p.detach(), master.detach().to(p.dtype))


@pytest.mark.parametrize("low", LOW, ids=str)
def test_batchnorm_running_statistics_stay_float32_under_o2(low):
    model, opt, _ = make_zoo("O2", low)
    bn = model.bn
    assert bn.running_mean.dtype == bn.running_var.dtype == F32
    assert bn.num_batches_tracked.dtype == torch.int64
    model(torch.randn(8, 1, 4, 4) * 3 + 1)
    assert bn.running_mean.dtype == bn.running_var.dtype == F32
    assert bn.running_mean.abs().sum() > 0  # updated by the forward
    assert bn.weight.dtype == F32 and model.conv.weight.dtype == low


class _Casts(TorchDispatchMode):
    """Counts dtype casts (``aten._to_copy``) dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def _conv_bn_step(low, pass_through):
    """One O2 forward and backward of a conv-BatchNorm-ReLU net; the BatchNorm takes its
    low input as it comes or (``pass_through=False``) cast up and back as before."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))  # fmt: skip
    model, _ = amp.initialize(net, None, "O2", low)
    x = torch.randn(6, 3, 8, 8) * 2 + 1
    casts = _Casts()
    with batchnorm_low_input(pass_through), casts:
        out = model(x)
        out.square().sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return out, grads, model[1], casts.count


@pytest.mark.parametrize("low", LOW, ids=str)
def test_o2_batchnorm_takes_low_input_without_the_casts_and_computes_the_same(low):
    out, grads, bn, casts = _conv_bn_step(low, True)
    ref_out, ref_grads, ref_bn, ref_casts = _conv_bn_step(low, False)
    # Two casts forward (up on entry, down on exit) and their two backward are gone.
    assert casts == ref_casts - 4
    assert torch.equal(out, ref_out)  # float32 arithmetic inside the kernel either way
    for name, g in ref_grads.items():  # the gradients round in another order
        torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-3, msg=name)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-5, atol=1e-6)
    assert bn.weight.dtype == bn.running_mean.dtype == F32


def test_compiled_o2_batchnorm_takes_low_input_too():
    """The traced hooks decide as the eager ones: 2 casts fewer in the captured graph."""

    def graph_casts(pass_through):
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        model, _ = amp.initialize(net, None, "O2", torch.bfloat16)
        counts = []

        def backend(gm, example_inputs):
            counts.append(sum(n.op == "call_method" and n.target == "to" for n in gm.graph.nodes))
            return gm.forward

        with batchnorm_low_input(pass_through):
            out = torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 3, 6, 6))
        torch._dynamo.reset()
        return counts, out

    (casts,), out = graph_casts(True)
    (ref_casts,), ref_out = graph_casts(False)
    assert casts == ref_casts - 2 and torch.equal(out, ref_out)


def test_batchnorm_keeps_its_casts_where_the_output_is_float32_or_the_input_is_not_low():
    """O1's ``keep_batchnorm_fp32`` wants a float32 output (computed in float32, never
    rounded): cast up on entry. A float64 input is cast to the layer's float32."""
    torch.manual_seed(0)
    model, _ = amp.initialize(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), None, "O1",
                              torch.bfloat16, keep_batchnorm_fp32=True)  # fmt: skip
    seen = record_compute(model, torch.randn(4, 1, 5, 5))
    assert seen["1"][0] == F32
    model, _ = amp.initialize(nn.Sequential(nn.BatchNorm1d(3)), None, "O2", torch.bfloat16)
    seen = record_compute(model, torch.randn(4, 3, dtype=torch.float64))
    assert seen["0"][0] == torch.bfloat16  # the root cast the model's input: low, passed on
    bn = nn.BatchNorm1d(3)
    amp.set_policy(bn, "float32")
    assert bn(torch.randn(4, 3, dtype=torch.float64)).dtype == F32  # float64 is cast


def test_o3_keeps_batchnorm_low_and_keep_batchnorm_fp32_flips_it():
    model, _, _ = make_zoo("O3", torch.bfloat16)
    assert model.bn.running_mean.dtype == torch.bfloat16 and model.ln.weight.dtype == torch.bfloat16
    model, _, _ = make_zoo("O3", torch.bfloat16, keep_batchnorm_fp32=True)
    assert model.bn.running_mean.dtype == F32 and model.ln.weight.dtype == F32
    seen = record_compute(model, torch.randn(5, 1, 4, 4))
    # BatchNorm's kernel takes the bfloat16 input with its float32 weights; the
    # layer norm's input is cast up.
    assert seen["bn"] == (torch.bfloat16, {"weight": F32, "bias": F32})
    assert seen["ln"][0] == F32 and seen["fc"][0] == torch.bfloat16
    model, _, _ = make_zoo("O2", torch.bfloat16, keep_batchnorm_fp32=False)
    assert model.bn.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "level, low, kind",
    [
        ("O0", torch.float16, NoOpLossScale),
        ("O1", torch.float16, DynamicLossScale),
        ("O1", torch.bfloat16, NoOpLossScale),
        ("O2", torch.float16, DynamicLossScale),
        ("O2", torch.bfloat16, NoOpLossScale),
        ("O3", torch.float16, NoOpLossScale),
        ("O3", torch.bfloat16, NoOpLossScale),
    ],
)
def test_default_loss_scale_per_level(level, low, kind):
    _, opt, _ = make_zoo(level, low)
    assert type(opt.loss_scaler) is kind
    assert opt.loss_scale.dtype == F32 and opt.loss_scale.dim() == 0


class _Watched(TorchDispatchMode):
    """Runs each op as it is: under any dispatch mode a CPU takes a GPU's ways
    (:func:`mixprec.numerics.cpu_shortcuts`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("flat", [False, True])
def test_unscaled_bfloat16_o2_checks_the_model_gradients_and_skips_an_overflow(flat):
    """Without a loss scale the step reads the bfloat16 gradients once (half the bytes of
    their float32 copies; on a CPU, ``flat``, the masters' float32 buffer the copy has
    just read: :func:`~mixprec.numerics.cpu_shortcuts`, off under a dispatch mode, where
    the GPU's way runs) and rewrites nothing; an inf or NaN still skips the step."""
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1), "O2",
                                torch.bfloat16)  # fmt: skip
    x, target = torch.randn(2, 4), torch.randn(2, 3)
    checked = []

    def check(tensors, device):  # what the finite check reads
        checked.append([t.dtype for t in tensors])
        return any_nonfinite(tensors, device)

    for poison in (False, True, False):
        (model(x).float() * target).sum().backward()
        if poison:
            model[0].weight.grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.detach().clone() for p in model.parameters()]
        checked.clear()
        watched = contextlib.nullcontext() if flat else _Watched()
        with mock.patch("mixprec.loss_scale.any_nonfinite", check), watched:
            opt.step()
        low = [torch.float32] if flat else [torch.bfloat16, torch.bfloat16]  # (12 + 3 in one)
        assert checked == [low + [torch.float32, torch.float32]]
        for p, g in zip(model.parameters(), grads, strict=True):  # nothing rewritten
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
        changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
        assert changed == [not poison] * 4, (poison, changed)
        opt.zero_grad()
    assert int(opt.skipped_steps) == 1 and int(opt.iterations) == 2


def test_loss_scale_argument_forms():
    ls = StaticLossScale(64.0)
    assert make_zoo("O1", torch.bfloat16, loss_scale=ls)[1].loss_scaler is ls
    assert float(make_zoo("O1", torch.bfloat16, loss_scale=256)[1].loss_scale) == 256.0
    assert isinstance(
        make_zoo("O3", torch.float16, loss_scale="dynamic")[1].loss_scaler, DynamicLossScale
    )


@pytest.mark.parametrize(
    "make, level, compute, stored",
    [
        (lambda: nn.LayerNorm(4), "O2", F32, F32),
        (lambda: nn.LayerNorm(4), "O3", torch.bfloat16, torch.bfloat16),
        (lambda: nn.Linear(4, 4), "O2", torch.bfloat16, torch.bfloat16),
    ],
)
def test_a_model_that_is_itself_a_listed_layer(make, level, compute, stored):
    model = make()
    amp.initialize(model, level=level, dtype=torch.bfloat16)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.weight.dtype)))
    out = model(torch.randn(2, 4))
    assert seen == [(compute, compute)] and model.weight.dtype == stored and out.dtype == F32


def test_without_optimizer_returns_none():
    model = nn.Linear(2, 2)
    out, opt = amp.initialize(model, level="O2", dtype=torch.bfloat16)
    assert out is model and opt is None and model.weight.dtype == torch.bfloat16


def test_auto_is_o1_bf16_on_a_bf16_cpu_and_o2_by_capability_on_cuda(monkeypatch, caplog):
    # The CPU and capability cases in full are in test_auto_level.py.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    torch.manual_seed(0)
    model, reference = nn.Linear(4, 4), nn.Linear(4, 4)
    reference.load_state_dict(model.state_dict())
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto")
    x = torch.randn(3, 4)
    with torch.autocast("cpu", torch.bfloat16):  # O1 bfloat16 is torch.autocast
        want = reference(x).float()
    assert torch.equal(model(x), want)
    assert model.weight.dtype == torch.float32  # O1: float32 parameters
    assert not opt.master_weights
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert amp.choose_auto("cuda:0")[:2] == ("O2", torch.float16)
    # initialize decides by the model's device: on a device type with no fast low
    # precision, float32.
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        meta, _ = amp.initialize(nn.Linear(1, 1, device="meta"), level="auto")
    assert meta.weight.dtype == torch.float32
    assert "auto: level O0" in caplog.text and "no known fast low precision on meta" in caplog.text


class Recorder(TorchDispatchMode):
    """Counts aten ops by (name, floating input dtypes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        self.ops[(func.__name__.split(".")[0], tuple(sorted(map(str, dtypes))))] += 1
        return func(*args, **(kwargs or {}))

    def dtypes_of(self, *names: str) -> set[str]:
        return {d for (n, ds), _ in self.ops.items() if n in names for d in ds}


MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu")


class Scores(nn.Module):
    """Functional code in a forward: a raw-parameter matmul and a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ self.w, dim=-1) + x


#: O1 lists of the user's own, which O1 applies itself (the defaults are torch.autocast).
CUSTOM = dict(
    white_list=[nn.Linear, torch.matmul],
    black_list=[nn.InstanceNorm1d, nn.LayerNorm, torch.softmax, torch.log_softmax],
)


def test_o1_function_lists_reach_functional_code():
    torch.manual_seed(0)
    model = nn.Sequential(Scores(), nn.LayerNorm(8))
    amp.initialize(model, level="O1", dtype=torch.bfloat16, **CUSTOM)
    rec = Recorder()
    with rec:
        model(torch.randn(4, 8)).sum().backward()
    assert rec.dtypes_of("mm") == {"torch.bfloat16"}  # x @ w, forward and backward
    # x @ w hands softmax bfloat16; softmax is deny-listed and casts it up.
    assert rec.dtypes_of("_softmax") == {"torch.float32"}
    assert model[0].w.grad.dtype == F32


def autocast_twin(make, x, low=torch.bfloat16):
    """``make()`` under O1 and under torch.autocast: outputs, gradients, cast counts."""
    from mixprec.rewrite import CastCounter

    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    reference = make()
    amp.initialize(model, level="O1", dtype=low)
    with CastCounter() as ours:
        out = model(x)
        out.sum().backward()
    with CastCounter() as theirs:
        with torch.autocast("cpu", dtype=low):
            ref = reference(x)
        ref = ref.float()  # O1 hands the loss float32 too
        ref.sum().backward()
    return (out, model), (ref, reference), ours.count, theirs.count


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(),
                               nn.Linear(32, 4)), (8, 16)),
        (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                               nn.Linear(36, 3)), (4, 1, 8, 8)),
        (lambda: nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False),
            nn.Flatten(), nn.Linear(64, 3)), (2, 4, 16)),
    ],
    ids=["mlp", "convnet", "transformer"],
)  # fmt: skip
def test_o1_is_torch_autocast_bit_for_bit_with_as_many_casts(make, shape):
    """Allow-listed outputs stay low, so O1 runs the same kernels on the same dtypes as
    torch.autocast: the same outputs and gradients, bit for bit, and no extra cast."""
    x = torch.randn(*shape)
    (out, model), (ref, reference), ours, theirs = autocast_twin(make, x)
    assert out.dtype == F32 and torch.equal(out, ref)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == F32 and torch.equal(p.grad, q.grad)
    assert ours == theirs


class Chain(nn.Module):
    """Allow-listed layers in a row, then deny-listed ones with and without parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.InstanceNorm1d(1)  # no parameters: cast up by its own policy
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        h = self.ln(self.norm(h.unsqueeze(1)).squeeze(1))
        return torch.log_softmax(self.a(h), dim=-1)


def test_o1_allow_listed_outputs_stay_low_and_deny_listed_ops_cast_up():
    torch.manual_seed(0)
    model = Chain()
    amp.initialize(model, level="O1", dtype=torch.bfloat16, **CUSTOM)
    seen = record_compute(model, torch.randn(4, 8))
    assert seen["a"][0] == seen["b"][0] == torch.bfloat16  # b takes a's output as it is
    assert seen["norm"][0] == seen["ln"][0] == F32
    assert seen[""][0] == F32  # the model's output, whatever its last op gave
    rec = Recorder()
    with rec:
        model(torch.randn(4, 8))
    assert rec.dtypes_of("_log_softmax") == {"torch.float32"}
    assert rec.dtypes_of("addmm") == {"torch.bfloat16"}


def test_the_default_deny_functions_are_o1s_only():
    assert {F.softmax, F.log_softmax, F.cross_entropy, torch.exp} <= set(amp.get_black_list())
    model = nn.Sequential(Scores())
    amp.initialize(model, level="O2", dtype=torch.bfloat16)
    rec = Recorder()
    with rec:
        model(torch.randn(4, 8))
    assert rec.dtypes_of("_softmax") == {"torch.bfloat16"}  # O2 computes it low


def test_custom_black_list_function_runs_float32_inside_a_low_region():
    model = nn.Sequential(Scores())
    amp.initialize(model, level="O2", dtype=torch.bfloat16, black_list=[torch.softmax])
    rec = Recorder()
    with rec:
        out = model(torch.randn(4, 8))
    assert rec.dtypes_of("_softmax") == {"torch.float32"}
    assert rec.dtypes_of("mm") == {"torch.bfloat16"} and out.dtype == F32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x))


def test_custom_white_list_replaces_defaults_and_black_wins_inside_white():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 2, 1), nn.Flatten(), Block(), nn.Linear(8, 2))
    amp.initialize(model, level="O1", dtype=torch.bfloat16, white_list=[Block])
    seen = record_compute(model, torch.randn(3, 2, 4))
    assert seen["0"][0] == F32 and seen["3"][0] == F32  # conv and linear no longer listed
    assert seen["2"][0] == torch.bfloat16 and seen["2.fc"][0] == torch.bfloat16
    assert seen["2.norm"][0] == F32  # default black list, inside the white block


def test_custom_black_list_at_o2():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    amp.initialize(model, level="O2", dtype=torch.bfloat16, black_list=[nn.Linear])
    seen = record_compute(model, torch.randn(3, 4))
    assert seen["0"][0] == F32 and seen["2"][0] == F32 and model[0].weight.dtype == F32
    assert seen["1"][0] == torch.bfloat16 and model[1].weight.dtype == torch.bfloat16


def test_default_lists_are_copies():
    white = amp.get_white_list()
    white.clear()
    assert nn.Linear in amp.get_white_list() and torch.matmul in amp.get_white_list()
    assert nn.MultiheadAttention in amp.get_white_list()
    black = amp.get_black_list()
    black.append(nn.Linear)
    assert nn.Linear not in amp.get_black_list()
    assert {nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm} <= set(amp.get_black_list())


def encoder(seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 3)
    )


@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_transformer_encoder_trains_and_evaluates_at_every_level(level, low):
    x = torch.randn(2, 5, 16)
    reference = encoder()
    reference.eval()
    with torch.no_grad():
        want = reference(x)
    model = encoder()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), level, low)
    rec = Recorder()
    with rec:
        loss = model(x).square().mean()
        opt.scale_loss(loss).backward()
    opt.step()
    opt.zero_grad()
    matmul_dtypes = rec.dtypes_of(*MATMULS)
    assert matmul_dtypes == ({"torch.float32"} if level == "O0" else {str(low)}), matmul_dtypes
    assert torch.isfinite(loss) and loss.dtype == F32
    model.eval()  # eval takes nn.TransformerEncoderLayer's fused fast path when it can
    with torch.no_grad():
        model.load_state_dict(reference.state_dict())
        got = model(x)
    with torch.inference_mode():
        again = model(x)
    assert got.dtype == again.dtype == F32
    tolerance = 1e-5 if level == "O0" else 0.1
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(again, got)


def test_o1_multihead_attention_matmuls_run_low_with_float32_parameters():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x)[0]

    wrapped = Wrap()
    amp.initialize(wrapped, level="O1", dtype=torch.bfloat16)
    rec = Recorder()
    with rec:
        wrapped(x).sum().backward()
    assert rec.dtypes_of(*MATMULS) == {"torch.bfloat16"}
    assert {p.dtype for p in mha.parameters()} == {F32}
    assert mha.in_proj_weight.grad.dtype == F32 and mha.out_proj.weight.grad.dtype == F32


def snapshot(model: nn.Module):
    return (
        {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()},
        {n: b.dtype for n, b in model.named_buffers()},
        [
            (len(m._forward_pre_hooks), len(m._forward_hooks), sorted(m.__dict__))
            for m in model.modules()
        ],
    )


def same(a, b):
    return (
        a[1] == b[1]
        and a[2] == b[2]
        and all(a[0][k][0] == b[0][k][0] and torch.equal(a[0][k][1], b[0][k][1]) for k in a[0])
    )


BAD_CALLS = [
    (dict(level="O4"), ValueError, "O4"),
    (dict(level="rewrite"), ValueError, "mixprec.rewrite.rewrite(model"),
    (dict(level=1), TypeError, "level"),
    (dict(dtype=torch.float32), ValueError, "float32"),
    (dict(dtype=torch.int8), ValueError, "dtype"),
    (dict(optimizer="sgd"), TypeError, "optimizer"),
    (dict(keep_batchnorm_fp32="yes"), TypeError, "keep_batchnorm_fp32"),
    (dict(level="O1", keep_batchnorm_fp32=False), ValueError, "O3"),
    (dict(white_list="Linear"), TypeError, "white_list"),
    (dict(white_list=[nn.Linear(2, 2)]), TypeError, "module instance"),
    (dict(white_list=[print]), TypeError, "intercept"),
    (dict(black_list=[int]), TypeError, "nn.Module"),
    (dict(white_list=[nn.Linear], black_list=[nn.Linear]), ValueError, "share"),
    (dict(level="O2", black_list=[nn.LayerNorm], keep_batchnorm_fp32=True), ValueError, "not both"),
    (dict(level="O0", white_list=[nn.Linear]), ValueError, "O0"),
    (dict(loss_scale=-2.0), ValueError, "-2.0"),
    (dict(loss_scale="big"), ValueError, "big"),
    (dict(loss_scale=True), TypeError, "True"),
]


@pytest.mark.parametrize("kwargs, error, fragment", BAD_CALLS)
def test_rejected_calls_raise_and_change_nothing(kwargs, error, fragment):
    torch.manual_seed(0)
    model = Zoo()
    kwargs = dict(kwargs)
    opt = kwargs.pop("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    before = snapshot(model)
    with pytest.raises(error) as info:
        amp.initialize(model, opt, **kwargs)
    assert fragment in str(info.value)
    assert same(before, snapshot(model))
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", torch.bfloat16)


def test_other_rejections_change_nothing():
    model = Zoo()
    before = snapshot(model)
    with pytest.raises(ValueError, match="needs an optimizer"):
        amp.initialize(model, None, "O1", loss_scale=128)
    with pytest.raises(ValueError, match="optimizer holds none"):
        amp.initialize(model, torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=1), "O2")
    inner = torch.optim.SGD(model.parameters(), lr=1)
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        amp.initialize(model, LossScaleOptimizer(inner), "O1")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        amp.initialize("model")
    assert same(before, snapshot(model))


def test_initialize_twice_or_after_the_rewrite_raises():
    model = Zoo()
    amp.initialize(model, level="O1")
    with pytest.raises(ValueError, match="already has a policy"):
        amp.initialize(model, level="O2")
    rewritten = Zoo()
    rewrite(rewritten)  # claims the model at once (captured at its first call)
    before = snapshot(rewritten)
    with pytest.raises(ValueError, match="only one mixed-precision API|Only one"):
        amp.initialize(rewritten, level="O1")
    assert same(before, snapshot(rewritten))
    inner = Zoo()
    rewrite(inner.fc)  # a rewritten submodule counts too
    with pytest.raises(ValueError, match="rewrite"):
        amp.initialize(inner, level="O1")
