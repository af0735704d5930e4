"""Seed 003: TensorFlow 2.3 ``tf.train.experimental.enable_mixed_precision_graph_rewrite``.

``mixprec.compat.tf.enable_mixed_precision_graph_rewrite(opt, loss_scale="dynamic", *,
model=, example_inputs=)``: wraps the optimizer in a ``LossScaleOptimizer`` and, given the
model (PyTorch has no global graph to rewrite), returns ``(rewritten_model, optimizer)``
from ``mixprec.rewrite``. The document's example, its loss-scale argument, the four op
lists, the one-API-only ``ValueError``, skipped steps, and the Keras ``TypeError``
example from its comparison section.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec import amp
from mixprec.compat import keras, tf
from mixprec.loss_scale import DynamicLossScale, StaticLossScale
from mixprec.rewrite import AmpLists, explain


def _colours(gm) -> dict[str, str]:
    """Node name -> the precision the rewrite painted it (ops only)."""
    return {
        n.name: n.meta["mixprec"]["colour"]
        for n in gm.graph.nodes
        if n.meta.get("mixprec", {}).get("role") == "op"
    }


def _node(gm, op: str, after: str | None = None):
    """The first node running ``op`` (optionally: fed by a node running ``after``)."""
    for n in gm.graph.nodes:
        meta = n.meta.get("mixprec", {})
        if meta.get("role") != "op" or meta.get("op") != op:
            continue
        if after is None or any(
            getattr(a, "meta", {}).get("mixprec", {}).get("op") == after for a in n.all_input_nodes
        ):
            return n
    raise AssertionError(f"no {op} node" + (f" after {after}" if after else ""))


# -- the document's example -----------------------------------------------------------


def test_seed_example_sequential_dense_fit():
    """model = Sequential([Dense(64, relu), Dense(64, softmax)]); opt = SGD();
    opt = enable_mixed_precision_graph_rewrite(opt); model.compile(loss="mse", optimizer=opt);
    model.fit(np.random.random((1024, 64)), np.random.random((1024, 64)))."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Softmax(dim=-1))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    x_train = torch.rand(1024, 64, generator=gen)
    y_train = torch.rand(1024, 64, generator=gen)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=32)  # Keras fit: 32

    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # Keras SGD() default rate
    fast, opt = tf.enable_mixed_precision_graph_rewrite(
        opt, model=model, example_inputs=x_train[:2]
    )
    assert isinstance(opt, tf.LossScaleOptimizer)
    assert opt.dynamic and float(opt.loss_scale) == 2.0**15 and opt.dynamic_growth_steps == 2000
    # Dense layers (matmuls: Allow) run in float16; Softmax (Deny) stays float32.
    report = explain(fast)
    colours = {(row.module, row.op): row.colour for row in report.rows}
    assert colours[("0", "linear")] == colours[("2", "linear")] == "float16"
    assert colours[("3", "softmax")] == "float32"

    # On the CPU, the seed's reference platform (Model would pick a GPU where there is one).
    history = mixprec.Model(fast, nn.MSELoss(), opt, metrics=["loss"], device="cpu").fit(1, loader)
    ref_history = mixprec.Model(
        reference, nn.MSELoss(), torch.optim.SGD(reference.parameters(), lr=0.01),
        metrics=["loss"], device="cpu",
    ).fit(1, loader)  # fmt: skip
    assert len(history.losses) == 32 and int(opt.iterations) == 32
    assert int(opt.skipped_steps) == 0
    # "the same accuracy reached in float32 is expected"
    torch.testing.assert_close(
        torch.tensor(history.losses), torch.tensor(ref_history.losses), rtol=1e-4, atol=0
    )
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == torch.float32  # variables stay float32
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    # It really computes in float16: the logits differ from float32's, by float16 rounding.
    out, ref_out = fast(x_train[:64]), reference(x_train[:64])
    assert out.dtype == torch.float32  # "all tensors appear to be float32"
    assert not torch.equal(out, ref_out)
    torch.testing.assert_close(out, ref_out, rtol=2e-3, atol=1e-5)


def test_without_model_returns_the_wrapped_optimizer_only():
    w = nn.Parameter(torch.ones(2))
    opt = tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1))
    assert isinstance(opt, tf.LossScaleOptimizer)
    assert opt.dynamic and float(opt.loss_scale) == 2.0**15


def test_original_model_is_left_float32():
    """'You still build your graph in float32, and the graph rewrite will change certain
    ops to float16': the model object itself is untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    before = model(x)
    fast, _ = tf.enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, example_inputs=x
    )
    assert torch.equal(model(x), before)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # The rewritten model trains the same Parameter objects.
    assert {id(p) for p in fast.parameters()} <= {id(p) for p in model.parameters()}


# -- loss_scale: an int/float, "dynamic" or a loss-scale object --------------------------


@pytest.mark.parametrize("value", [128, 128.0, 2**20])
def test_loss_scale_number_is_a_fixed_scale(value):
    w = nn.Parameter(torch.ones(2))
    opt = tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1), loss_scale=value)
    assert opt.dynamic is False and opt.dynamic_counter is None
    assert isinstance(opt.loss_scaler, StaticLossScale)
    assert float(opt.loss_scale) == float(value) == opt.initial_scale


def test_loss_scale_dynamic_is_the_default():
    w = nn.Parameter(torch.ones(2))
    opt = tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1), "dynamic")
    assert isinstance(opt.loss_scaler, DynamicLossScale)
    assert (opt.initial_scale, opt.dynamic_growth_steps) == (2.0**15, 2000)


def test_loss_scale_objects_are_used_as_given():
    w = nn.Parameter(torch.ones(2))
    fixed = tf.FixedLossScale(256)
    opt = tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1), fixed)
    assert opt.loss_scaler is fixed and float(opt.loss_scale) == 256.0
    assert isinstance(opt, tf.LossScaleOptimizer) and opt.dynamic is False
    dyn = tf.DynamicLossScale(initial_loss_scale=64.0, increment_period=1, multiplier=4.0)
    opt = tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1), dyn)
    assert opt.loss_scaler is dyn and isinstance(opt, tf.LossScaleOptimizer) and opt.dynamic
    opt.scale_loss(w.sum()).backward()
    opt.step()
    assert dyn().item() == 256.0  # TF 1.15's rule: multiplied by 4 after 1 finite step


@pytest.mark.parametrize("bad", ["static", "Dynamic", True, None, -4, 0, [128]])
def test_bad_loss_scale_is_a_value_error(bad):
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError):
        tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1), loss_scale=bad)


def test_optimizer_must_be_a_plain_optimizer():
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError):
        tf.enable_mixed_precision_graph_rewrite("sgd")
    wrapped = tf.LossScaleOptimizer(torch.optim.SGD([w], lr=0.1))
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        tf.enable_mixed_precision_graph_rewrite(wrapped)


# -- only one mixed-precision API --------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_value_error_when_the_policy_api_is_also_used(policy):
    w = nn.Parameter(torch.ones(2))
    keras.set_global_policy(policy)
    try:
        with pytest.raises(ValueError, match="policy"):
            tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1))
    finally:
        keras.set_global_policy("float32")
    with keras.policy_scope(policy), pytest.raises(ValueError, match="policy"):
        tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1))
    # float32 again: allowed
    assert isinstance(
        tf.enable_mixed_precision_graph_rewrite(torch.optim.SGD([w], lr=0.1)),
        tf.LossScaleOptimizer,
    )


def test_a_model_under_a_policy_cannot_also_be_rewritten_and_vice_versa():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    amp.set_policy(net, "mixed_float16")
    with pytest.raises(ValueError, match="one mixed-precision API"):
        tf.enable_mixed_precision_graph_rewrite(
            torch.optim.SGD(net.parameters(), lr=0.1), model=net, example_inputs=torch.randn(2, 4)
        )
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    tf.enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(other.parameters(), lr=0.1), model=other, example_inputs=torch.randn(2, 4)
    )
    with pytest.raises(ValueError, match="one mixed-precision API"):
        amp.set_policy(other, "mixed_float16")


# -- skipped steps ----------------------------------------------------------------------


def test_nan_gradient_skips_the_update_and_the_global_step():
    """'If a NaN gradient occurs with dynamic loss scaling, the model update for that batch
    is skipped. In this case, the global step count is not incremented, and the
    LossScaleOptimizer attempts to decrease the loss scaling value.'"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    fast, opt = tf.enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(model.parameters(), lr=0.01), model=model, example_inputs=x
    )
    for _ in range(3):
        opt.scale_loss(nn.functional.mse_loss(fast(x), y)).backward()
        opt.step()
        opt.zero_grad()
    assert int(opt.iterations) == 3
    before = [p.detach().clone() for p in model.parameters()]
    # A batch whose float16 activations overflow: inf in the forward, NaN in the gradients.
    opt.scale_loss(nn.functional.mse_loss(fast(x * 1e4), y)).backward()
    assert any(not torch.isfinite(p.grad).all() for p in model.parameters())
    opt.step()
    opt.zero_grad()
    assert int(opt.iterations) == 3  # the global step is not incremented
    assert float(opt.loss_scale) == 2.0**14  # decreased
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- the four op lists ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "listed"),
    [
        ("conv2d", "allow"),  # WhiteList: "E.g. Conv2D"
        ("softmax", "deny"),  # BlackList: "E.g. Softmax"
        ("add", "infer"),  # GrayList: "E.g. Add and AvgPool"
        ("avg_pool2d", "infer"),
        ("argmax", "clear"),  # ClearList: "E.g. ArgMax and Floor"
        ("floor", "clear"),
    ],
)
def test_document_examples_are_on_their_lists(op, listed):
    assert AmpLists().list_of(op) == listed


class _GrayAdds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        a = self.l2(self.l1(x) + 1.0)  # Add between two Allow ops
        b = self.l3(torch.softmax(x, -1) + 1.0)  # Add downstream of a Deny op
        return a + b


def test_gray_ops_run_low_unless_downstream_from_a_deny_op():
    net = _GrayAdds()
    gm, _ = tf.enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(net.parameters(), lr=0.1), model=net, example_inputs=torch.randn(2, 8)
    )
    colours = _colours(gm)
    assert colours[_node(gm, "add", after="linear").name] == "float16"
    assert colours[_node(gm, "add", after="softmax").name] == "float32"
    assert colours[_node(gm, "softmax").name] == "float32"
    # Allow ops are always converted, even downstream from the Deny op.
    assert all(colours[n] == "float16" for n in colours if n.startswith("linear"))


class _Convs(nn.Module):
    def __init__(self, middle) -> None:
        super().__init__()
        self.c1, self.c2, self.middle = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 4, 3), middle

    def forward(self, x):
        return self.c2(self.middle(self.c1(x)))


@pytest.mark.parametrize(
    ("middle", "op"),
    [
        (nn.AvgPool2d(2), "avg_pool2d"),  # Gray
        (nn.ReLU(), "relu"),  # Clear
        (nn.MaxPool2d(2), "max_pool2d"),  # Clear
        (torch.floor, "floor"),
    ],
)
def test_gray_and_clear_ops_between_convs_run_in_float16(middle, op):
    net = _Convs(middle) if isinstance(middle, nn.Module) else _Convs(_Lambda(middle))
    gm, _ = tf.enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(net.parameters(), lr=0.1),
        model=net,
        example_inputs=torch.randn(2, 1, 12, 12),
    )
    colours = _colours(gm)
    assert colours[_node(gm, "conv2d").name] == "float16"
    assert colours[_node(gm, op).name] == "float16"


class _Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_rewrite_works_without_any_layer_objects():
    """'the graph rewrite works in any model that uses tf.functions', not only Keras
    layers: here a model of bare parameters and functional ops."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(16, 32) / 4)
            self.w2 = nn.Parameter(torch.randn(32, 4) / 6)

        def forward(self, x):
            return torch.log_softmax(torch.relu(x @ self.w1) @ self.w2, dim=-1)

    torch.manual_seed(0)
    net = Functional()
    x = torch.randn(8, 16)
    gm, opt = tf.enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(net.parameters(), lr=0.1), model=net, example_inputs=x
    )
    colours = _colours(gm)
    low = {n for n, c in colours.items() if c == "float16"}
    assert any(n.startswith(("matmul", "mm")) for n in low)
    assert colours[_node(gm, "log_softmax").name] == "float32"
    torch.testing.assert_close(gm(x), net(x), rtol=1e-2, atol=1e-2)
    opt.scale_loss(-gm(x)[:, 0].mean()).backward()
    assert net.w1.grad is not None and net.w1.grad.dtype == torch.float32


# -- the Keras TypeError example: Dense(2)(x) + Dense(2, dtype="float32")(x) --------------


class _TwoDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_keras_type_error_example_the_rewrite_never_raises():
    torch.manual_seed(0)
    net = _TwoDense()
    x = torch.randn(5, 3)
    expected = net(x)
    gm, _ = tf.enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(net.parameters(), lr=0.1), model=net, example_inputs=x
    )
    out = gm(x)  # no TypeError
    assert out.dtype == torch.float32
    colours = _colours(gm)
    assert sorted(colours[n] for n in colours if n.startswith("linear")) == ["float16"] * 2
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_keras_type_error_example_the_policy_api_promotes_instead():
    """With the policy API (mixed_float16, one layer float32) the float16 + float32 add
    that raised a TypeError in Keras follows PyTorch's type promotion: float32."""
    torch.manual_seed(0)
    net = _TwoDense()
    x = torch.randn(5, 3)
    expected = net(x)
    amp.set_policy(net, "mixed_float16")
    amp.set_policy(net.b, "float32")  # Dense(2, dtype="float32")
    assert net.a(x).dtype == torch.float16 and net.b(x).dtype == torch.float32
    out = net(x)  # no TypeError
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
