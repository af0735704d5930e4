"""O1 with the default lists is ``torch.autocast``: the same outputs, gradients and
BatchNorm statistics bit for bit, no cast of a weight kept between steps, and no
interception of the forward's torch calls beyond what the user's own lists name."""

from __future__ import annotations

import copy
import gc
import math
import warnings
from collections import Counter

import amp_internals
import pytest
import real_models
import torch
import torch._dynamo as dynamo
from amp_internals import call_state_left, calls_left, is_hooked
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import amp

F32 = torch.float32
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def autocast_supports(device: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device, dtype)`` runs (it warns and turns itself off else)."""
    if device == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            with torch.autocast(device, dtype):
                return True
        except (UserWarning, RuntimeError):
            return False


class NewGELU(nn.Module):
    """GPT-2's GELU written out: ``pow`` and ``tanh`` in the model's own code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


def tiny_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 8 * 8, 5),
    )  # fmt: skip


def tiny_gelu() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), NewGELU(), nn.Linear(16, 16), nn.GELU("tanh"),
                         nn.LayerNorm(16), nn.Linear(16, 3))  # fmt: skip


def gpt2() -> nn.Module:
    return real_models.gpt2(layers=2, width=32)


def text() -> torch.Tensor:
    return real_models.char_batches(batch=2, length=12, steps=1)[0][0]


MODELS = {
    "resnet": (real_models.resnet, lambda: real_models.images(batch=2, size=8)[0]),
    "gpt2": (gpt2, text),
    "tiny_batchnorm": (tiny_batchnorm, lambda: real_models.images(batch=2, size=8)[0]),
    "tiny_gelu": (tiny_gelu, lambda: torch.randn(6, 8, generator=torch.Generator().manual_seed(1))),
}


def logits(out):
    return out.logits if hasattr(out, "logits") else out


def o1_and_autocast(name: str, device: str, dtype: torch.dtype):
    """One training forward and backward of the model under O1 and under torch.autocast,
    from the same weights and the same dropout masks."""
    make, batch = MODELS[name]
    model, reference = make().to(device), make().to(device)
    x = batch().to(device)
    amp.initialize(model, level="O1", dtype=dtype)
    torch.manual_seed(7)
    out = logits(model(x))
    out.square().sum().backward()
    torch.manual_seed(7)
    with torch.autocast(device, dtype):
        ref = logits(reference(x))
    ref = ref.float()  # O1 hands the loss float32
    ref.square().sum().backward()
    return (model, out), (reference, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_o1_is_torch_autocast_bit_for_bit(name, dtype, device):
    """BatchNorm, ReLU, the residual add, GELU's pow and tanh run where autocast runs
    them (on a CPU: in low precision), so logits, gradients and BatchNorm statistics
    are autocast's exactly."""
    if not autocast_supports(device, dtype):
        pytest.skip(f"torch.autocast({device!r}, {dtype}) is not supported here")
    (model, out), (reference, ref) = o1_and_autocast(name, device, dtype)
    assert out.dtype == F32 and torch.equal(out, ref)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == F32 and p.grad.dtype == F32, pname
        assert torch.equal(p.grad, q.grad), pname
    for (bname, b), c in zip(model.named_buffers(), reference.buffers()):
        assert b.dtype == c.dtype and torch.equal(b, c), bname  # BatchNorm statistics


@pytest.mark.parametrize("device", DEVICES)
def test_o1_eval_and_no_grad_are_torch_autocast(device):
    make, batch = MODELS["resnet"]
    model, reference = make().to(device).eval(), make().to(device).eval()
    x = batch().to(device)
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    with torch.no_grad():
        got = model(x)
        with torch.autocast(device, torch.bfloat16):
            want = reference(x).float()
    assert torch.equal(got, want)


def test_passing_the_default_lists_is_the_same_as_leaving_them_out():
    (model, out), (_, ref) = o1_and_autocast("tiny_gelu", "cpu", torch.bfloat16)
    again = tiny_gelu()
    amp.initialize(again, level="O1", dtype=torch.bfloat16, white_list=amp.get_white_list(),
                   black_list=amp.get_black_list())  # fmt: skip
    x = MODELS["tiny_gelu"][1]()
    inside = set()  # what the layers run under: torch.autocast itself
    again[0].register_forward_pre_hook(
        lambda m, args: inside.add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    )
    assert torch.equal(again(x), ref) and inside == {(True, torch.bfloat16)}


class Probe(nn.Module):
    """Records, in the middle of the forward, whether a torch function mode is active."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch._C._is_torch_function_mode_enabled())
        return x


@pytest.mark.parametrize(
    "lists, intercepted",
    [
        ({}, False),  # torch.autocast: the dispatcher casts, Python sees no torch call
        ({"white_list": [nn.Linear], "black_list": [nn.LayerNorm]}, False),  # modules: hooks
        ({"white_list": [nn.Linear, torch.matmul]}, True),  # functions: a function mode
    ],
    ids=["defaults", "module-types", "functions"],
)
def test_o1_intercepts_torch_calls_only_when_its_lists_name_functions(lists, intercepted):
    seen: list[bool] = []
    model = nn.Sequential(nn.Linear(4, 4), Probe(seen), nn.LayerNorm(4), nn.Linear(4, 2))
    amp.initialize(model, level="O1", dtype=torch.bfloat16, **lists)
    model(torch.randn(2, 4))
    assert seen == [intercepted]


def test_o1_with_the_defaults_enters_autocast_once_per_forward(monkeypatch):
    """One torch.autocast region per forward pass, however deep the model: every module
    of a 12-layer GPT-2 carries hooks (a call of any of them opens the region when none
    is open), which do nothing inside it; autocast does the rest."""
    model = real_models.gpt2(layers=12, width=16)
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    assert all(is_hooked(m) for m in model.modules())
    entered = []
    real = torch.autocast.__enter__
    monkeypatch.setattr(torch.autocast, "__enter__", lambda self: entered.append(1) or real(self))
    model(text())
    assert len(entered) == 1 and call_state_left() == {}
    assert all(p.dtype == F32 for p in model.parameters())


def live_storages() -> dict[int, tuple[torch.dtype, int]]:
    """Every tensor storage Python can reach: data pointer -> (dtype, bytes)."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        # type(), not isinstance: some module objects warn when asked for __class__.
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            try:
                storage = obj.untyped_storage()
                if storage.nbytes():
                    found[storage.data_ptr()] = (obj.dtype, storage.nbytes())
            except RuntimeError:  # a fake tensor left by an earlier compile: no storage
                continue
    return found


def kept_after_steps(model: nn.Module, forward, steps: int = 2):
    """The storages that a few training steps leave alive, and their bytes."""
    x = MODELS["tiny_gelu"][1]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = live_storages()
    alive = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]  # no reuse
    for _ in range(steps):
        forward(model, x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    kept = {ptr: v for ptr, v in live_storages().items() if ptr not in before}
    del alive
    return kept


@pytest.mark.parametrize(
    "lists", [{}, {"white_list": [nn.Linear, torch.matmul]}], ids=["defaults", "custom-lists"]
)
def test_no_cast_of_a_weight_outlives_the_step(lists):
    """autocast's weight-cast cache lives only inside its region; O1's (both paths) does
    too: after the steps no low-precision storage is left, and O1 keeps no more bytes
    alive than torch.autocast does."""
    theirs = kept_after_steps(tiny_gelu(), _autocast_forward)
    model = tiny_gelu()
    amp.initialize(model, level="O1", dtype=torch.bfloat16, **lists)
    ours = kept_after_steps(model, lambda m, x: m(x))
    low = [v for v in ours.values() if v[0] == torch.bfloat16]
    assert low == [], f"{len(low)} bfloat16 storages kept between steps"
    assert sum(n for _, n in ours.values()) <= sum(n for _, n in theirs.values())


def _autocast_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        return model(x)


class Ops(TorchDispatchMode):
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


def test_a_users_float32_layer_inside_o1_computes_in_float32():
    """A policy set before initialize is kept: autocast is off in its region."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    amp.to_float(model[2], torch.float32)
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    ops = Ops()
    with ops:
        model(torch.randn(3, 4))
    assert ops.ops[("addmm", ("torch.bfloat16",))] == 1  # the first layer: autocast
    assert ops.ops[("addmm", ("torch.float32",))] == 1  # the user's float32 head


def test_keep_batchnorm_fp32_at_o1_runs_normalisation_in_float32():
    model = tiny_batchnorm()
    amp.initialize(model, level="O1", dtype=torch.bfloat16, keep_batchnorm_fp32=True)
    ops = Ops()
    with ops:
        out = model(MODELS["tiny_batchnorm"][1]())
    assert ops.dtypes_of("convolution") == {"torch.bfloat16"}
    assert ops.dtypes_of("native_batch_norm", "_native_batch_norm_legit") == {"torch.float32"}
    assert ops.dtypes_of("addmm") == {"torch.bfloat16"} and out.dtype == F32


@pytest.mark.parametrize("probe", ["this-cpu", "cannot"])
def test_o1_float16_runs_lstms_in_float32_where_cpu_autocast_cannot(probe, monkeypatch):
    """oneDNN has no float16 LSTM on CPUs without float16 instructions, so there
    ``torch.autocast("cpu", torch.float16)`` fails in an LSTM's forward; O1 runs the
    LSTM in float32 and the rest under autocast. "cannot" makes any CPU one of those."""
    if probe == "cannot":
        amp_internals.pretend_cpu_autocast_cannot_run_lstm(monkeypatch)
    runs = amp_internals.cpu_autocast_runs_lstm(torch.float16)
    model = real_models.lstm(width=16)
    reference = copy.deepcopy(model)
    amp.initialize(model, level="O1", dtype=torch.float16)
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = (out[0] if isinstance(out, tuple) else out).dtype
        return hook

    for name in ("lstm", "head"):
        getattr(model, name).register_forward_hook(record(name))
    ids, targets = real_models.char_batches(batch=2, length=12, steps=1)[0]
    loss = real_models.lm_loss(model(ids), targets)
    loss.backward()
    assert seen == {"lstm": torch.float16 if runs else F32, "head": torch.float16}
    want = real_models.lm_loss(reference(ids), targets)
    assert abs(loss.item() - want.item()) < 0.01  # float16 head only: near float32
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_lstm_probe_draws_no_random_number():
    """Building the probe's LSTM initialises its weights: the user's stream is kept."""
    amp_internals.forget_cpu_autocast_probe()
    torch.manual_seed(3)
    amp_internals.cpu_autocast_runs_lstm(torch.float16)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))


def test_o1_on_a_device_type_without_autocast_is_refused_and_leaves_nothing_behind():
    model = nn.Linear(2, 2, device="meta")
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="torch.autocast.*'meta'.*O2 or O3"):
        model(torch.ones(1, 2, device="meta"))
    assert call_state_left() == {} and calls_left(model) == {}


def test_compiled_o1_keeps_autocast_across_a_graph_break():
    """Under torch.compile autocast rides on a function mode that Dynamo carries over a
    graph break in the forward: the compiled model computes what the eager one does."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            dynamo.graph_break()
            return self.b(torch.tanh(h).pow(2))

    torch.manual_seed(0)
    model = Broken()
    amp.initialize(model, level="O1", dtype=torch.bfloat16)
    eager = copy.deepcopy(model)
    x = torch.randn(3, 4)
    dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager")
        assert torch.equal(compiled(x), eager(x))
        assert call_state_left() == {} and not torch.is_autocast_enabled("cpu")
    finally:
        dynamo.reset()
