"""Cast planning and insertion on hand-built graphs: where casts go, and where they don't."""

import pytest
import torch
from torch import fx

from mixprec.rewrite import AmpLists
from mixprec.rewrite._casts import CAST_OP, apply_plan, simplify_casts
from mixprec.rewrite._paint import paint
from mixprec.rewrite._plan import minimize_casts, plan_casts

A = torch.ops.aten
LOW = torch.float16


class Builder:
    def __init__(self):
        self.graph = fx.Graph()
        self.nodes = {}

    def input(self, name, shape=(4, 4), dtype=torch.float32):
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, dtype=dtype)
        self.nodes[name] = node
        return self

    def op(self, name, target, *inputs, shape=(4, 4), dtype=torch.float32, **kwargs):
        args = tuple(self.nodes[i] if isinstance(i, str) else i for i in inputs)
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta["val"] = torch.empty(shape, dtype=dtype)
        self.nodes[name] = node
        return self

    def output(self, *names):
        values = tuple(self.nodes[n] for n in names)
        self.graph.output(values[0] if len(values) == 1 else values)
        return self

    def rewrite(self, level="default", keep_output_dtype=False):
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        painting = paint(self.graph, AmpLists(), LOW, level)
        plan, saved = minimize_casts(painting, keep_output_dtype)
        apply_plan(gm, painting, plan, saved)
        return gm, painting, plan


def casts(gm):
    """The casts the rewrite inserted (user-written casts are not counted)."""
    return [
        n
        for n in gm.graph.nodes
        if n.target is CAST_OP and n.meta.get("mixprec", {}).get("role") == "cast"
    ]


def cast_sources(gm):
    return sorted((n.args[0].name, str(n.args[1]).replace("torch.", "")) for n in casts(gm))


class DtypeRecorder(fx.Interpreter):
    def run(self, *args):
        self.dtypes = {}
        return super().run(*args)

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = out.dtype
        return out


def test_one_cast_per_value_and_dtype_shared_by_all_consumers():
    b = (
        Builder()
        .input("x")
        .input("w")
        .op("mm1", A.mm.default, "x", "w")
        .op("mm2", A.mm.default, "x", "mm1")
        .op("exp", A.exp.default, "mm1")
        .op("log", A.log.default, "mm1")
        .op("out", A.mul.Tensor, "exp", "log")
        .output("out", "mm2")
    )
    gm, _, _ = b.rewrite()
    assert cast_sources(gm) == [
        ("mm1", "float32"),
        ("mm2", "float32"),
        ("w", "float16"),
        ("x", "float16"),
    ]
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    out, mm2 = gm(x, w)
    assert out.dtype == mm2.dtype == torch.float32
    torch.testing.assert_close(mm2, x @ (x @ w), atol=0.05, rtol=0.01)


def test_no_casts_inside_a_low_precision_region():
    b = (
        Builder()
        .input("x")
        .op("mm1", A.mm.default, "x", "x")
        .op("relu", A.relu.default, "mm1")
        .op("tanh", A.tanh.default, "relu")
        .op("mm2", A.mm.default, "tanh", "x")
        .output("mm2")
    )
    gm, _, _ = b.rewrite()
    assert cast_sources(gm) == [("mm2", "float32"), ("x", "float16")]
    recorder = DtypeRecorder(gm)
    recorder.run(torch.randn(4, 4))
    assert {recorder.dtypes[n] for n in ("mm1", "relu", "tanh", "mm2")} == {LOW}


def test_outputs_are_cast_back_unless_keep_output_dtype():
    def build():
        return Builder().input("x").op("mm", A.mm.default, "x", "x").output("mm")

    gm, _, _ = build().rewrite()
    assert gm(torch.randn(4, 4)).dtype == torch.float32
    gm, _, _ = build().rewrite(keep_output_dtype=True)
    assert gm(torch.randn(4, 4)).dtype == LOW
    assert cast_sources(gm) == [("x", "float16")]


def test_float32_elementwise_ops_read_low_inputs_without_a_cast():
    b = (
        Builder()
        .input("x")
        .op("mm", A.mm.default, "x", "x")
        .op("exp", A.exp.default, "x")
        .op("add", A.add.Tensor, "mm", "exp")  # float32: fed by exp (deny)
        .output("add")
    )
    gm, _, _ = b.rewrite()
    assert cast_sources(gm) == [("x", "float16")]
    x = torch.randn(4, 4)
    out = gm(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ x + x.exp(), atol=0.05, rtol=0.01)


def test_a_zero_dim_float32_operand_does_not_promote_so_a_cast_is_kept():
    b = (
        Builder()
        .input("x")
        .op("mm", A.mm.default, "x", "x")
        .op("total", A.sum.default, "x", shape=())
        .op("add", A.add.Tensor, "mm", "total")  # float32: fed by sum (deny)
        .output("add")
    )
    gm, _, _ = b.rewrite()
    assert ("mm", "float32") in cast_sources(gm)
    assert gm(torch.randn(4, 4)).dtype == torch.float32


def test_bias_is_added_in_float32_when_the_consumers_want_float32():
    b = (
        Builder()
        .input("x", shape=(3, 4))
        .input("w", shape=(5, 4))
        .input("b", shape=(5,))
        .op("linear", A.linear.default, "x", "w", "b", shape=(3, 5))
        .output("linear")
    )
    gm, _, plan = b.rewrite()
    linear = next(n for n in gm.graph.nodes if n.name == "linear")
    assert plan.bias_splits == {linear}
    assert linear.args[2] is None
    assert cast_sources(gm) == [("w", "float16"), ("x", "float16")]
    x, w, bias = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    out = gm(x, w, bias)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), atol=0.02, rtol=0.01)
    recorder = DtypeRecorder(gm)
    recorder.run(x, w, bias)
    assert recorder.dtypes["linear"] == LOW


def test_bias_stays_inside_when_a_consumer_wants_low_precision():
    b = (
        Builder()
        .input("x", shape=(4, 4))
        .input("b", shape=(4,))
        .op("linear", A.linear.default, "x", "x", "b")
        .op("mm", A.mm.default, "linear", "x")
        .output("mm")
    )
    gm, _, plan = b.rewrite()
    assert plan.bias_splits == set()
    assert ("b", "float16") in cast_sources(gm)


def test_user_casts_that_cancel_or_do_nothing_are_removed():
    b = (
        Builder()
        .input("x")
        .op("same", A.to.dtype, "x", torch.float32)  # already float32
        .op("mm1", A.mm.default, "same", "same")
        .op("up", A.to.dtype, "mm1", torch.float32)  # low -> float32 ...
        .op("mm2", A.mm.default, "up", "x")  # ... -> low again
        .output("mm2")
    )
    gm, _, plan = b.rewrite()
    names = {n.name for n in gm.graph.nodes}
    assert "same" not in names and "up" not in names
    mm2 = next(n for n in gm.graph.nodes if n.name == "mm2")
    assert mm2.args[0].name == "mm1"
    assert cast_sources(gm) == [("mm2", "float32"), ("x", "float16")]


def test_a_user_cast_to_float32_is_reused_as_the_cast():
    b = (
        Builder()
        .input("x")
        .op("mm", A.mm.default, "x", "x")
        .op("up", A.to.dtype, "mm", torch.float32)
        .op("exp1", A.exp.default, "up")
        .op("exp2", A.exp.default, "mm")
        .output("exp1", "exp2")
    )
    gm, _, plan = b.rewrite()
    exp2 = next(n for n in gm.graph.nodes if n.name == "exp2")
    assert exp2.args[0].name == "up"
    assert cast_sources(gm) == [("x", "float16")]
    assert plan.cost == 2  # the cast of x, and the user's cast, which now converts


def test_simplify_keeps_lossy_round_trips():
    b = (
        Builder()
        .input("x")
        .op("down", A.to.dtype, "x", LOW, dtype=LOW)
        .op("up", A.to.dtype, "down", torch.float32)
        .output("up")
    )
    assert simplify_casts(b.graph) == 0
    assert [n.name for n in b.graph.nodes] == ["x", "down", "up", "output"]


def test_dtype_arguments_of_painted_ops_follow_the_painting():
    b = (
        Builder()
        .input("x")
        .op("mm", A.mm.default, "x", "x")
        .op("softmax", A.softmax.int, "mm", -1, torch.float32)
        .op("zeros", A.zeros.default, [4, 4], dtype=torch.float32)
        .op("add", A.add.Tensor, "softmax", "zeros")
        .output("add")
    )
    gm, _, _ = b.rewrite(level="unsafe_force_all", keep_output_dtype=True)
    recorder = DtypeRecorder(gm)
    out = recorder.run(torch.randn(4, 4))
    assert out.dtype == LOW
    assert recorder.dtypes["softmax"] == recorder.dtypes["zeros"] == LOW


def test_in_place_ops_follow_the_tensor_they_modify_and_it_is_never_cast():
    b = (
        Builder()
        .input("x")
        .op("relu_", A.relu_.default, "x")  # modifies an input: must stay in place
        .op("mm", A.mm.default, "relu_", "relu_")
        .op("add_", A.add_.Tensor, "mm", "x")  # modifies a low-precision result
        .output("add_")
    )
    gm, painting, plan = b.rewrite()
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["relu_"].args[0] is nodes["x"]
    assert nodes["add_"].args[0] is nodes["mm"]
    assert nodes["add_"] in plan.low and nodes["relu_"] not in plan.low
    x = torch.randn(4, 4)
    expected = x.relu() @ x.relu() + x.relu()
    out = gm(x)
    assert torch.equal(x, x.relu())  # the input was modified in place, as before
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.01)


def test_batch_norm_weight_bias_and_running_stats_are_never_cast():
    b = (
        Builder()
        .input("x", shape=(2, 3, 4, 4))
        .input("w1", shape=(3, 3, 1, 1))
        .input("gamma", shape=(3,))
        .input("beta", shape=(3,))
        .input("mean", shape=(3,))
        .input("var", shape=(3,))
        .op("conv1", A.conv2d.default, "x", "w1", shape=(2, 3, 4, 4))
        .op(
            "bn",
            A.batch_norm.default,
            "conv1",
            "gamma",
            "beta",
            "mean",
            "var",
            True,
            0.1,
            1e-5,
            False,
            shape=(2, 3, 4, 4),
        )
        .op("conv2", A.conv2d.default, "bn", "w1", shape=(2, 3, 4, 4))
        .output("conv2")
    )
    gm, painting, _ = b.rewrite()
    assert painting.rule[b.nodes["bn"]] == "between-allow"
    assert cast_sources(gm) == [("conv2", "float32"), ("w1", "float16"), ("x", "float16")]
    mean, var = torch.zeros(3), torch.ones(3)
    x = torch.randn(2, 3, 4, 4) + 3.0
    gm(x, torch.randn(3, 3, 1, 1), torch.ones(3), torch.zeros(3), mean, var)
    assert mean.dtype == torch.float32 and mean.abs().sum() > 0  # updated in place


def test_minimize_casts_returns_flexible_ops_to_float32_when_that_saves_casts():
    b = (
        Builder()
        .input("x")
        .op("mm", A.mm.default, "x", "x")
        .op("add", A.add.Tensor, "mm", "x")  # follows mm: TensorFlow paints it
        .output("add")
    )
    painting = paint(b.graph, AmpLists(), LOW)
    assert b.nodes["add"] in painting.low
    assert plan_casts(painting, keep_output_dtype=False).cost == 2  # x, output
    plan, saved = minimize_casts(painting, keep_output_dtype=False)
    assert plan.cost == 1 and saved == {b.nodes["add"]: 1}
    gm = fx.GraphModule(torch.nn.Module(), b.graph)
    apply_plan(gm, painting, plan, saved)
    assert b.nodes["add"].meta["mixprec"]["reason"] == (
        "float32: follows painted mm at node mm, but float32 saves 1 cast(s)"
    )


@pytest.mark.parametrize("keep", [False, True])
def test_minimize_casts_never_touches_allow_or_between_allow_ops(keep):
    b = (
        Builder()
        .input("x")
        .op("mm1", A.mm.default, "x", "x")
        .op("add", A.add.Tensor, "mm1", "x")
        .op("mm2", A.mm.default, "add", "x")
        .output("mm2")
    )
    painting = paint(b.graph, AmpLists(), LOW)
    plan, saved = minimize_casts(painting, keep_output_dtype=keep)
    assert plan.low == painting.low == {b.nodes[n] for n in ("mm1", "add", "mm2")}
    assert saved == {}


def test_bias_stays_inside_when_every_float32_consumer_promotes():
    # A residual add whose other operand is float32 reads the low-precision output as
    # it is: splitting the bias off would write and read that output in float32.
    b = (
        Builder()
        .input("x", shape=(3, 4))
        .input("w", shape=(5, 4))
        .input("b", shape=(5,))
        .input("r", shape=(3, 5))
        .op("linear", A.linear.default, "x", "w", "b", shape=(3, 5))
        .op("e", A.exp.default, "r", shape=(3, 5))  # deny: the residual stays float32
        .op("add", A.add.Tensor, "linear", "e", shape=(3, 5))
        .output("add")
    )
    gm, _, plan = b.rewrite()
    assert plan.bias_splits == set() and plan.cost == 3
    assert cast_sources(gm) == [("b", "float16"), ("w", "float16"), ("x", "float16")]
    x, w, bias, r = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5), torch.randn(3, 5)
    recorder = DtypeRecorder(gm)
    recorder.run(x, w, bias, r)
    assert (recorder.dtypes["linear"], recorder.dtypes["add"]) == (LOW, torch.float32)
    want = torch.nn.functional.linear(x, w, bias) + r.exp()
    torch.testing.assert_close(gm(x, w, bias, r), want, atol=0.02, rtol=0.01)


def test_a_residual_stream_turns_float32_op_by_op_and_its_branches_stay_low():
    # Two blocks: norm (exp, deny) -> linear -> relu -> residual add. Each add follows a
    # painted op; returned to float32 one at a time, each promotes its branch's
    # low-precision output (autocast's pattern). Returning the branch with it would
    # save as many kernels (a float32 bias add for a bias cast) and run it in float32.
    b = Builder().input("x").input("w").input("b", shape=(4,))
    b.op("h", A.mm.default, "x", "w").op("stream0", A.add.Tensor, "h", "x")
    for i in range(2):
        b.op(f"norm{i}", A.exp.default, f"stream{i}")
        b.op(f"linear{i}", A.linear.default, f"norm{i}", "w", "b")
        b.op(f"relu{i}", A.relu.default, f"linear{i}")
        b.op(f"stream{i + 1}", A.add.Tensor, f"stream{i}", f"relu{i}")
    gm, painting, plan = b.output("stream2").rewrite()
    low = {n.name for n in plan.low}
    assert {"relu0", "relu1"} <= low and not low & {"stream0", "stream1", "stream2"}
    # x, w, b and each norm's output to low precision; nothing back to float32
    assert plan.bias_splits == set() and plan.cost == 5
    assert all(str(d) == "torch.float16" for _, d in plan.casts)
    x, w, bias = torch.randn(4, 4) / 4, torch.randn(4, 4) / 4, torch.randn(4) / 4
    stream = x @ w + x
    for _ in range(2):
        stream = stream + torch.nn.functional.linear(stream.exp(), w, bias).relu()
    torch.testing.assert_close(gm(x, w, bias), stream, atol=0.05, rtol=0.02)
