"""Graph capture: torch.export first, symbolic_trace as fallback, train/eval, in-place ops."""

import pytest
import torch
from test_rewrite_api import api_of
from torch import fx, nn

import mixprec.rewrite._capture as capture_module
from mixprec.rewrite import CaptureError, count_casts, explain, rewrite

A = torch.ops.aten


class ShapeChecked(nn.Module):
    """Checks its input's shape in Python, which symbolic_trace cannot follow."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        if x.dim() != 2 or x.shape[-1] != 8:
            raise ValueError(f"expected (batch, 8), got {tuple(x.shape)}")
        return self.fc(x).relu()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(self.drop(x.flatten(1)))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -x


def test_export_captures_with_the_models_own_parameters_and_buffers():
    model = ConvNet()
    captured = capture_module.capture(model, torch.randn(2, 3, 6, 6))
    assert captured.method == "export"
    gm = captured.module
    assert gm.get_parameter("conv.weight") is model.conv.weight
    assert gm.get_buffer("bn.running_mean") is model.bn.running_mean


def test_shape_checks_are_captured_by_export():
    with pytest.raises(fx.proxy.TraceError):
        fx.symbolic_trace(ShapeChecked())
    model = ShapeChecked()
    gm = rewrite(model, torch.randn(4, 8), dtype=torch.bfloat16)
    assert explain(gm).method == "export"
    x = torch.randn(7, 8)
    torch.testing.assert_close(gm(x), model(x), atol=0.05, rtol=0.02)


def test_failing_export_falls_back_to_symbolic_trace(monkeypatch):
    def failing_export(model, args):
        raise RuntimeError("export cannot handle this model")

    monkeypatch.setattr(capture_module, "_export", failing_export)
    torch.manual_seed(0)
    model = ConvNet()
    x = torch.randn(4, 3, 6, 6)
    gm = rewrite(model, x, dtype=torch.bfloat16)
    report = explain(gm)
    assert report.method == "symbolic_trace"
    assert gm.meta["mixprec"]["export_error"].endswith("export cannot handle this model")
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    colours = {row.node: row.colour for row in report.rows if row.op != "cast"}
    assert colours["bn"] == "bfloat16"  # a BatchNorm call: mixed-dtype kernel, no cast
    # nn.Linear and nn.Conv2d are traced through, so their weights are cast in the graph.
    assert any(row.op == "cast" and row.module == "fc" for row in report.rows)
    gm.eval(), model.eval()
    torch.testing.assert_close(gm(x), model(x), atol=0.05, rtol=0.05)
    assert count_casts(gm, x) <= count_casts(model, x, autocast_dtype=torch.bfloat16)
    gm.train()
    gm(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert int(model.bn.num_batches_tracked) == 1


def test_when_both_captures_fail_the_error_names_the_construct_and_the_alternative():
    model = DataDependent().eval()
    with pytest.raises(CaptureError) as info:
        rewrite(model, torch.randn(2, 3))
    message = str(info.value)
    assert "could not capture DataDependent" in message
    assert "torch.export failed in forward()" in message
    assert "torch.fx.symbolic_trace failed in forward()" in message
    assert "`if x.sum() > 0:`" in message
    assert "mixprec.amp.initialize(model, level='O1')" in message
    assert model.training is False and api_of(model) is None


def test_mode_constants_are_tied_to_the_training_flag():
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    gm = capture_module.capture(layer, torch.randn(2, 3, 8)).module
    dropouts = [n for n in gm.graph.nodes if n.target is A.dropout.default]
    attention = [n for n in gm.graph.nodes if n.target is A.scaled_dot_product_attention.default]
    flag = dropouts[0].args[2]  # one node, a submodule's training flag, for every dropout
    assert flag.op == "call_module"
    assert len(dropouts) == 3 and all(n.args[2] is flag for n in dropouts)
    assert len(attention) == 1 and isinstance(attention[0].args[4], fx.Node)
    assert gm.get_submodule(flag.target).training is True
    gm.eval()
    assert gm.get_submodule(flag.target).training is False


def test_in_place_ops_on_intermediate_values_become_out_of_place():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            y.relu_()
            y += x
            return y

    gm = capture_module.capture(Net(), torch.randn(2, 4)).module
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert A.relu.default in targets and A.add.Tensor in targets
    assert A.relu_.default not in targets and A.add_.Tensor not in targets


def test_in_place_ops_on_inputs_stay_in_place():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2)
    relu_ = g.call_function(A.relu_.default, (x,))
    relu_.meta["val"] = torch.empty(2)
    g.output(relu_)
    assert capture_module.functionalize_inplace(g) == 0

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x.relu_()
            return self.fc(x)

    model = Net()
    gm = rewrite(model, torch.randn(2, 4), dtype=torch.bfloat16)
    x = torch.randn(3, 4)
    expected = model(x.clone())
    out = gm(x)
    assert torch.equal(x, x.relu())  # the caller sees the in-place change
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)


def test_a_batch_of_one_warns_that_the_batch_size_is_fixed():
    with pytest.warns(UserWarning, match="batch size 1"):
        capture_module.capture(nn.Linear(3, 3), torch.randn(1, 3))
    with pytest.warns(UserWarning, match="batch size 1"):
        gm = rewrite(nn.Linear(3, 3), torch.randn(1, 3), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"for inputs \[1, 3\] float32 and is called with \[2, 3\]"):
        gm(torch.randn(2, 3))


@pytest.mark.parametrize(
    "call, got",
    [((4, 5, 8), r"\[4, 5, 8\] float32 \(Guard failed"), ((4, 3), r"\[4, 3\] float32")],
    ids=["another-length", "a-dimension-fewer"],
)
def test_a_graph_called_with_inputs_of_another_shape_says_so_and_how_to_fix_it(call, got):
    """Only the batch dimension is free; torch's own failures here are an
    AssertionError with a guard's text and an IndexError."""
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    gm = rewrite(model, torch.randn(4, 3, 8), dtype=torch.bfloat16)
    assert gm(torch.randn(6, 3, 8)).shape == (6, 3, 4)
    captured = r"captured for inputs \[B, 3, 8\] float32 \(B: any batch size\)"
    with pytest.raises(ValueError, match=rf"{captured} and is called with {got}.*leave example_inputs out"):
        gm(torch.randn(*call))


@pytest.mark.parametrize("bad", [None, 3, {"x": torch.ones(2)}, ("text",)])
def test_example_inputs_must_be_tensors_or_tuples_with_a_tensor(bad):
    with pytest.raises(TypeError, match="example_inputs must"):
        capture_module.capture(nn.Linear(2, 2), bad)


def test_every_submodules_mode_is_restored_after_capture():
    model = ConvNet()
    model.bn.eval()  # a frozen batch norm inside a training model
    capture_module.capture(model, torch.randn(2, 3, 6, 6))
    assert model.training and not model.bn.training and model.drop.training
