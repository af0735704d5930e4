"""The painting algorithm on hand-built graphs: one test per rule, plus levels and limits."""

import operator

import pytest
import torch
from torch import fx, nn

from mixprec.rewrite import AmpLists
from mixprec.rewrite._paint import paint

A = torch.ops.aten


class Builder:
    """A graph of ATen ops whose values are recorded like torch.export records them."""

    def __init__(self):
        self.graph = fx.Graph()
        self.nodes = {}

    def input(self, name, dtype=torch.float32, shape=(4, 4)):
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, dtype=dtype)
        self.nodes[name] = node
        return self

    def op(self, name, target, *inputs, dtype=torch.float32, shape=(4, 4), val=None):
        args = tuple(self.nodes[i] if isinstance(i, str) else i for i in inputs)
        node = self.graph.create_node("call_function", target, args, {}, name=name)
        node.meta["val"] = torch.empty(shape, dtype=dtype) if val is None else val
        self.nodes[name] = node
        return self

    def output(self, *names):
        self.graph.output(tuple(self.nodes[n] for n in names))
        return self

    def paint(self, level="default", lists=None, dtype=torch.float16):
        painting = paint(self.graph, lists or AmpLists(), dtype, level)
        low = {n.name for n in painting.low}
        return painting, low


def test_seed_chain_deny_infer_clear_infer_clear_allow_infer():
    # The chain from TensorFlow's rewrite: D -> I -> C -> I -> C -> A -> I.
    b = (
        Builder()
        .input("x")
        .input("w")
        .op("exp", A.exp.default, "x")  # deny
        .op("tanh", A.tanh.default, "exp")  # infer
        .op("relu", A.relu.default, "tanh")  # clear
        .op("sigmoid", A.sigmoid.default, "relu")  # infer
        .op("clone", A.clone.default, "sigmoid")  # clear
        .op("mm", A.mm.default, "clone", "w")  # allow
        .op("gelu", A.gelu.default, "mm")  # infer
        .output("gelu")
    )
    painting, low = b.paint()
    assert low == {"clone", "mm", "gelu"}
    reason = {n.name: painting.reason[n] for n in painting.vertices}
    assert reason["exp"] == "deny: on the deny list"
    for name in ("tanh", "relu", "sigmoid"):
        assert reason[name] == "deny: downstream of exp at node exp"
    assert reason["clone"] == "allow: clear op connected to painted mm at node mm"
    assert reason["mm"] == "allow: on the allow list"
    assert reason["gelu"] == "allow: follows painted mm at node mm"


def test_allow_ops_are_painted():
    _, low = Builder().input("x").op("mm", A.mm.default, "x", "x").output("mm").paint()
    assert low == {"mm"}


def test_deny_spreads_through_infer_and_through_clear_that_leads_to_infer():
    b = (
        Builder()
        .input("x")
        .op("log", A.log.default, "x")
        .op("view", A.view.default, "log", [16])
        .op("tanh", A.tanh.default, "view", shape=(16,))
        .op("mul", A.mul.Tensor, "tanh", "tanh", shape=(16,))
        .output("mul")
    )
    painting, low = b.paint()
    assert low == set()
    assert {painting.rule[v] for v in painting.vertices} == {"deny"}


def test_deny_does_not_spread_through_clear_ops_that_lead_to_an_allow_op():
    b = (
        Builder()
        .input("x")
        .op("softmax", A.softmax.int, "x", -1)
        .op("transpose", A.transpose.int, "softmax", 0, 1)
        .op("mm", A.mm.default, "transpose", "x")
        .output("mm")
    )
    painting, low = b.paint()
    assert low == {"transpose", "mm"}
    assert painting.rule[b.nodes["transpose"]] == "clear-region"


def test_infer_and_clear_between_two_allow_ops_are_painted():
    b = (
        Builder()
        .input("x")
        .op("mm1", A.mm.default, "x", "x")
        .op("add", A.add.Tensor, "mm1", "x")
        .op("relu", A.relu.default, "add")
        .op("tanh", A.tanh.default, "relu")
        .op("mm2", A.mm.default, "tanh", "x")
        .output("mm2")
    )
    painting, low = b.paint()
    assert low == {"mm1", "add", "relu", "tanh", "mm2"}
    for name in ("add", "relu", "tanh"):
        assert painting.rule[b.nodes[name]] == "between-allow"
        assert painting.reason[b.nodes[name]] == (
            "allow: on a path between mm at node mm1 and mm at node mm2"
        )


def test_a_deny_op_blocks_the_path_between_allow_ops():
    b = (
        Builder()
        .input("x")
        .op("mm1", A.mm.default, "x", "x")
        .op("tanh", A.tanh.default, "mm1")
        .op("exp", A.exp.default, "tanh")
        .op("gelu", A.gelu.default, "exp")
        .op("mm2", A.mm.default, "gelu", "x")
        .output("mm2")
    )
    painting, low = b.paint()
    # tanh follows mm1; exp is deny; gelu is downstream of exp.
    assert low == {"mm1", "tanh", "mm2"}
    assert painting.rule[b.nodes["tanh"]] == "follows-allow"
    assert painting.reason[b.nodes["gelu"]] == "deny: downstream of exp at node exp"


def test_clear_regions_touching_an_allow_op_are_painted_both_ways():
    b = (
        Builder()
        .input("x")
        .op("relu", A.relu.default, "x")
        .op("view", A.view.default, "relu", [4, 4])
        .op("mm", A.mm.default, "view", "x")
        .op("t", A.t.default, "mm")
        .op("neg", A.neg.default, "t")
        .output("neg")
    )
    _, low = b.paint()
    assert low == {"relu", "view", "mm", "t", "neg"}


def test_clear_ops_with_no_allow_op_nearby_stay_float32():
    b = Builder().input("x").op("relu", A.relu.default, "x").op("tanh", A.tanh.default, "relu")
    painting, low = b.output("tanh").paint()
    assert low == set()
    assert painting.reason[b.nodes["tanh"]] == ("float32: infer op with no painted op to follow")


def test_infer_following_allow_is_painted_unless_it_has_a_deny_input():
    b = (
        Builder()
        .input("x")
        .op("mm", A.mm.default, "x", "x")
        .op("bias", A.add.Tensor, "mm", "x")  # matmul -> bias add stays together
        .op("exp", A.exp.default, "x")
        .op("mixed", A.add.Tensor, "mm", "exp")  # fed by a deny op
        .output("bias", "mixed")
    )
    painting, low = b.paint()
    assert low == {"mm", "bias"}
    assert painting.rule[b.nodes["bias"]] == "follows-allow"
    assert painting.reason[b.nodes["mixed"]] == "deny: downstream of exp at node exp"


def test_unlisted_ops_stay_float32():
    b = Builder().input("x").op("mm", A.mm.default, "x", "x").op("erfinv", A.erfinv.default, "mm")
    painting, low = b.output("erfinv").paint()
    assert low == {"mm"}
    assert painting.reason[b.nodes["erfinv"]] == "float32: on no list"


def test_only_float32_values_are_painted():
    b = (
        Builder()
        .input("x")
        .input("i", dtype=torch.int64)
        .input("d", dtype=torch.float64)
        .op("mm_int", A.mm.default, "i", "i", dtype=torch.int64)
        .op("mm_f64", A.mm.default, "d", "d", dtype=torch.float64)
        .op("mm", A.mm.default, "x", "x")
        .op("gt", A.gt.Scalar, "mm", 0.0, dtype=torch.bool)
        .output("mm_int", "mm_f64", "gt")
    )
    painting, low = b.paint()
    assert low == {"mm"}
    assert {v.name for v in painting.vertices} == {"mm"}


def test_tuple_outputs_are_painted_through_their_getitem_edges():
    values = (torch.empty(4), torch.empty(4, dtype=torch.int64))
    b = (
        Builder()
        .input("x")
        .op("maxdim", A.max.dim, "x", 1, val=values)
        .op("values", operator.getitem, "maxdim", 0, shape=(4,))
        .op("indices", operator.getitem, "maxdim", 1, dtype=torch.int64, shape=(4,))
        .op("mv", A.mv.default, "x", "values", shape=(4,))
        .output("mv", "indices")
    )
    painting, low = b.paint()
    assert low == {"maxdim", "mv"}
    assert painting.is_low(b.nodes["values"]) and painting.is_low(b.nodes["indices"])


def test_level_allow_only_paints_allow_ops_only():
    b = (
        Builder()
        .input("x")
        .op("mm1", A.mm.default, "x", "x")
        .op("relu", A.relu.default, "mm1")
        .op("mm2", A.mm.default, "relu", "x")
        .output("mm2")
    )
    painting, low = b.paint(level="allow_only")
    assert low == {"mm1", "mm2"}
    assert painting.reason[b.nodes["relu"]] == "float32: level allow_only converts allow ops only"


def test_level_treat_infer_as_deny():
    b = (
        Builder()
        .input("x")
        .op("mm1", A.mm.default, "x", "x")
        .op("gelu", A.gelu.default, "mm1")
        .op("relu", A.relu.default, "gelu")
        .op("add", A.add.Tensor, "relu", "x")
        .op("mm2", A.mm.default, "add", "x")
        .output("mm2")
    )
    painting, default_low = b.paint()
    assert default_low == {"mm1", "gelu", "relu", "add", "mm2"}
    painting, low = b.paint(level="treat_infer_as_deny")
    assert low == {"mm1", "mm2"}
    assert painting.reason[b.nodes["gelu"]] == (
        "deny: infer op treated as deny (level treat_infer_as_deny)"
    )
    assert painting.reason[b.nodes["relu"]] == "deny: downstream of gelu at node gelu"


def test_level_unsafe_force_all_paints_everything_float32():
    b = (
        Builder()
        .input("x")
        .op("exp", A.exp.default, "x")
        .op("total", A.sum.default, "exp", shape=())
    )
    _, low = b.output("total").paint(level="unsafe_force_all")
    assert low == {"exp", "total"}


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match="unknown level 'O2'.*'allow_only'"):
        Builder().input("x").output("x").paint(level="O2")


def test_custom_lists_change_the_painting():
    b = Builder().input("x").op("exp", A.exp.default, "x").output("exp")
    assert b.paint()[1] == set()
    lists = AmpLists().remove("deny", "exp").add("allow", "exp")
    assert b.paint(lists=lists)[1] == {"exp"}


def test_module_calls_with_float_parameters_are_never_painted():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.norm(x))

    gm = fx.symbolic_trace(Net())
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(2, 4)
    painting = paint(gm.graph, AmpLists(), torch.float16, "unsafe_force_all", root=gm)
    by_name = {v.name: v for v in painting.vertices}
    assert set(by_name) == {"norm", "act"}
    assert painting.low == {by_name["act"]}
    assert painting.reason[by_name["norm"]].startswith("float32: module call with float")


def test_in_place_ops_are_never_painted_by_the_painter():
    b = Builder().input("x").op("mm", A.mm.default, "x", "x").op("relu_", A.relu_.default, "mm")
    painting, low = b.output("relu_").paint()
    assert low == {"mm"}
    assert painting.rule[b.nodes["relu_"]] == "blocked"
