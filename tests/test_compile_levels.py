"""Every amp level under torch.compile and torch.export: no graph breaks from mixprec, no
recompiles after warm-up, and the compiled model computes what the eager one does."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter

from mixprec import amp

LEVELS = ["O0", "O1", "O2", "O3"]
MODES = ["train", "eval"]


class Tiny(nn.Module):
    """Every path the hooks take: an allow-listed layer, a float32 norm, self-attention
    (``query is key``), batch norm (parameters not shadowed), a raw Parameter fed to an
    allow-listed function (``torch.matmul``) and a deny-listed function (softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)
        self.mix = nn.Parameter(torch.randn(4, 4) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        h = h + self.att(h, h, h, need_weights=False)[0]
        h = self.bn(h.flatten(0, 1)).reshape(h.shape)
        return torch.softmax(torch.matmul(self.out(h), self.mix), dim=-1)


def make(level: str, mode: str) -> nn.Module:
    torch.manual_seed(0)
    model, _ = amp.initialize(Tiny(), level=level, dtype=torch.bfloat16)
    return model.train(mode == "train")


def inputs() -> torch.Tensor:
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()
    gc.collect()  # compiled code keeps fake tensors alive: free them for later tests


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_no_graph_breaks(level, mode):
    # The model alone compiles to one graph (the O0 row shows it), so every break
    # at another level would be the hooks'.
    model = make(level, mode)
    report = dynamo.explain(lambda x: model(x))(inputs())
    assert report.graph_break_count == 0, [str(b.reason)[:200] for b in report.break_reasons]
    assert report.graph_count == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_compiled_equals_eager(level, mode):
    """Outputs and gradients of the compiled model are the eager model's, function lists
    (O1's matmul in bfloat16, softmax in float32) included."""
    eager = make(level, mode)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(lambda x: compiled_model(x), backend="aot_eager")
    x = inputs()
    want, got = eager(x), compiled(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    if mode == "train":
        want.square().sum().backward()
        got.square().sum().backward()
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert q.grad.dtype == p.grad.dtype, name
                torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=2e-3, msg=name)
    for (name, b), c in zip(eager.named_buffers(), compiled_model.buffers()):
        torch.testing.assert_close(c, b, msg=name)  # batch-norm statistics


@pytest.mark.parametrize("level", LEVELS)
def test_compiling_the_module_itself_equals_eager(level):
    """``torch.compile(model)`` compiles the root's hooks as frames of their own, so
    O1's function-cast mode is entered in one compiled frame and used in the next;
    the forward starts with a listed torch function (``torch.relu``), which must see
    the mode's lists. Three calls (the third one reuses the graphs), then eager again:
    no call state may leak out of a compiled call."""
    from amp_internals import call_state_left

    eager = make(level, "eval")
    compiled_model = copy.deepcopy(eager)
    first = compiled_model.forward
    compiled_model.forward = lambda x: first(torch.relu(x))
    eager_first = eager.forward
    eager.forward = lambda x: eager_first(torch.relu(x))
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = inputs()
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-2, atol=1e-3)
    assert call_state_left() == {}
    torch.testing.assert_close(compiled_model(x), eager(x), rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_o1_function_lists_apply_under_compile(level):
    """The matmul on a raw Parameter runs where the level says, compiled or not: O1 in
    bfloat16 (its output differs from float32's), O0 in float32."""
    model = make(level, "eval")
    plain = copy.deepcopy(model)
    compiled = torch.compile(lambda x: model(x), backend="aot_eager")
    x = torch.randn(3, 4, 4)
    probe = lambda m, h: torch.matmul(h, m.mix)  # noqa: E731
    model.forward = lambda h: probe(model, h)
    plain.forward = lambda h: probe(plain, h)
    want, got = plain(x), compiled(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = torch.matmul(x, plain.mix.detach())
    assert (want != exact).any() == (level != "O0")


@pytest.mark.parametrize("level", LEVELS)
def test_no_recompiles_after_warm_up(level):
    """Training steps with an optimizer (parameters change in place) and a switch to
    eval and back reuse the graphs built in the first round."""
    model = make(level, "train")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CompileCounter()
    compiled = torch.compile(lambda x: model(x), backend=counter)

    def step(x):
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    x = inputs()
    step(x)
    model.eval()
    with torch.no_grad():
        compiled(x)
    model.train()
    warm = counter.frame_count
    with dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            step(x)
        model.eval()
        with torch.no_grad():
            compiled(x)
    assert counter.frame_count == warm


@pytest.mark.parametrize("level", LEVELS)
def test_export(level):
    model = make(level, "eval")
    x = inputs()
    program = torch.export.export(model, (x,))
    torch.testing.assert_close(program.module()(x), model(x), rtol=1e-2, atol=1e-3)
    # The casts are in the exported graph itself, where the level puts them.
    assert ("torch.bfloat16" in program.graph_module.code) == (level != "O0")


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_compiled_train_step_with_the_wrapper_equals_eager(level):
    """Forward, ``scale_loss(...).backward()``, ``step()``, ``zero_grad()`` compiled as one
    function: the same parameters, loss scale and counters as eager, over steps with an
    overflow."""

    def run(compile_step: bool):
        dynamo.reset()
        torch.manual_seed(0)
        model = Tiny()
        model, opt = amp.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), level, torch.bfloat16
        )

        def train_step(x, overflow):
            loss = model(x).square().mean()
            opt.scale_loss(loss).backward()
            model.out.bias.grad.add_(overflow)
            opt.step()
            opt.zero_grad()

        step = torch.compile(train_step, backend="aot_eager") if compile_step else train_step
        counters = []
        for i in range(4):
            step(inputs() + i, torch.tensor(float("inf") if i == 1 else 0.0))
            counters.append((int(opt.iterations), int(opt.skipped_steps)))
        return [p.detach().clone() for p in model.parameters()], opt.loss_scale.clone(), counters

    eager_params, eager_scale, eager_counters = run(False)
    params, scale, counters = run(True)
    assert counters == eager_counters
    assert eager_counters[-1][1] == 1  # the overflow step was skipped
    torch.testing.assert_close(scale, eager_scale)
    for got, want in zip(params, eager_params):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("mode", MODES)
def test_rewrite_compiles_without_breaks_and_equals_eager(mode):
    from mixprec.rewrite import rewrite

    torch.manual_seed(0)
    model = Tiny().train(mode == "train")
    x = inputs()
    graph = rewrite(model, x, dtype=torch.bfloat16)
    report = dynamo.explain(lambda t: graph(t))(x)
    assert report.graph_break_count == 0, [str(b.reason)[:200] for b in report.break_reasons]
    eager_graph = copy.deepcopy(graph)
    compiled = torch.compile(lambda t: graph(t), backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager_graph(x), rtol=1e-2, atol=1e-3)


def test_o1_code_dynamo_skips_runs_under_autocast_when_compiled():
    """Code Dynamo does not trace (here a ``torch._dynamo.disable`` function, as a graph
    break would leave) runs between compiled graphs inside O1's region: its matmul must
    run in bfloat16 as eager O1's does, and the region must end with the forward."""

    @torch._dynamo.disable
    def untraced(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.matmul(h, w)

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = untraced(self.inp(x), self.w)
            return h.float() * 2

    torch.manual_seed(0)
    eager, _ = amp.initialize(Broken(), level="O1", dtype=torch.bfloat16)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = torch.randn(3, 4)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
    with torch.no_grad():  # outside the forward: no autocast left behind
        assert untraced(compiled_model.inp(x), compiled_model.w).dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    exact = (torch.matmul(eager.inp(x), eager.w) * 2).float()
    assert (compiled(x) != exact).any()  # the untraced matmul did run in bfloat16
