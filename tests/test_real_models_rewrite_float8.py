"""The graph rewrite and float8 on the models people bring: an LSTM language model, a
default Hugging Face GPT-2 (its output holds a ``DynamicCache``; every projection is a
``Conv1D`` with its weight stored as ``(in, out)``), ``nn.Linear`` subclasses, and the way
back from a float8 model to the plain architecture. Models are tiny (one layer, width 32):
float8 matmuls run on the CPU kernel or the float32 emulation."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import real_models
import torch
from torch import nn

import mixprec.float8 as float8
from mixprec.rewrite import CaptureError, explain, rewrite

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_and_single_threaded():
    # torch.export warns about the LSTM's flat weight list; nothing to act on here. These
    # models are tiny: a second thread only waits on the first (and on a busy machine
    # its spinning costs more than the work).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
    torch.set_num_threads(threads)


def _low_ops(gm):
    return {row.op for row in explain(gm).rows if row.op != "cast" and row.colour == "bfloat16"}


def _train(model, opt, batches, head=lambda out: out):
    losses = []
    for x, y in batches:
        loss = real_models.lm_loss(head(model(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


# -- recurrent layers under the rewrite ---------------------------------------------------


def test_an_lstm_language_model_trains_under_the_rewrite_in_bfloat16():
    """The LSTM op is on the allow list: it runs in bfloat16 with its weights cast in the
    graph, the float32 parameters get the gradients, and training follows float32's."""
    batches = real_models.char_batches(batch=4, length=16, steps=6)
    model, reference = real_models.lstm(), real_models.lstm()
    gm = rewrite(model, (batches[0][0],), dtype=torch.bfloat16)
    assert {"lstm", "linear"} <= _low_ops(gm)
    lstm_node = next(n for n in gm.graph.nodes if n.meta.get("mixprec", {}).get("op") == "lstm")
    assert lstm_node.meta["val"][0].dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    losses = _train(gm, torch.optim.Adam(model.parameters(), lr=1e-2), batches)
    want = _train(reference, torch.optim.Adam(reference.parameters(), lr=1e-2), batches)
    assert losses[-1] < losses[0]
    assert max(abs(a - b) for a, b in zip(losses, want)) < 0.02 * want[0]


@pytest.mark.parametrize("layer", [
    nn.LSTM(8, 16, batch_first=True), nn.GRU(8, 16, batch_first=True), nn.RNN(8, 16, nonlinearity="relu", batch_first=True),
    nn.LSTMCell(8, 16), nn.GRUCell(8, 16), nn.RNNCell(8, 16),
], ids=lambda layer: type(layer).__name__)  # fmt: skip
def test_recurrent_layers_and_cells_run_in_low_precision(layer):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            out = self.layer(x)
            return out[0] if isinstance(out, tuple) else out

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8) if isinstance(layer, nn.RNNBase) else torch.randn(3, 8)
    net = Net()
    gm = rewrite(net, (x,), dtype=torch.bfloat16)
    ops = [row for row in explain(gm).rows if row.list == "allow"]
    assert len(ops) == 1 and ops[0].colour == "bfloat16", explain(gm)
    torch.testing.assert_close(gm(x), net(x), atol=0.03, rtol=0.03)


def test_recurrent_dropout_follows_train_and_eval():
    """A stacked LSTM's inter-layer dropout is baked into the exported op as train=True;
    the rewrite ties it to the module's mode, so evaluation is deterministic."""
    torch.manual_seed(0)
    net = nn.LSTM(8, 8, num_layers=2, dropout=0.5, batch_first=True)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = net

        def forward(self, x):
            return self.lstm(x)[0]

    x = torch.randn(4, 6, 8)
    gm = rewrite(Net(), (x,), dtype=torch.bfloat16)
    gm.eval()
    assert torch.equal(gm(x), gm(x))
    torch.testing.assert_close(gm(x), net.eval()(x)[0], atol=0.03, rtol=0.03)
    gm.train()
    assert not torch.equal(gm(x), gm(x))


# -- a default Hugging Face GPT-2 under the rewrite ---------------------------------------


def test_a_default_gpt2_is_captured_with_its_cache_and_trains():
    """``use_cache`` stays at its default: the output's DynamicCache is taken apart into
    its tensors for the graph and rebuilt, fresh, on every call."""
    batches = real_models.char_batches(batch=4, length=16, steps=4)
    model = real_models.gpt2(layers=1, width=32).eval()
    eager = copy.deepcopy(model)
    x = batches[0][0]
    gm = rewrite(model, (x,), dtype=torch.bfloat16)
    out, want = gm(x), eager(x)
    assert type(out) is type(want) and isinstance(out.past_key_values, DynamicCache)
    assert out.past_key_values.get_seq_length() == 16
    torch.testing.assert_close(out.logits, want.logits, atol=0.05, rtol=0.05)
    keys, want_keys = out.past_key_values.layers[0].keys, want.past_key_values.layers[0].keys
    assert keys.dtype == torch.float32
    torch.testing.assert_close(keys, want_keys, atol=0.05, rtol=0.05)
    again = gm(torch.cat([x, x]))  # another batch size, a new cache
    assert again.logits.shape[0] == 8 and again.past_key_values is not out.past_key_values
    gm.train()
    losses = _train(gm, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                    head=lambda out: out.logits)  # fmt: skip
    assert losses[-1] < losses[0]
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@dataclasses.dataclass
class _Result:
    logits: torch.Tensor
    state: object
    note: str = "kept"


class _State:
    def __init__(self, hidden):
        self.hidden = [hidden]
        self.steps = 1


class _ReturnsObjects(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        state = _State(h.relu())
        return _Result(h, state), {"same": state}


def test_dataclass_and_plain_object_outputs_are_rebuilt_on_every_call():
    torch.manual_seed(0)
    net = _ReturnsObjects()
    x = torch.randn(3, 8)
    gm = rewrite(net, (x,), dtype=torch.bfloat16)
    (result, extra), (want, _) = gm(x), net(x)
    assert isinstance(result, _Result) and result.note == "kept"
    assert isinstance(result.state, _State) and result.state.steps == 1
    assert extra["same"] is result.state  # shared as in the model's output
    torch.testing.assert_close(result.logits, want.logits, atol=0.03, rtol=0.03)
    torch.testing.assert_close(result.state.hidden[0], want.state.hidden[0], atol=0.03, rtol=0.03)
    assert gm(x)[0].state is not result.state


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -x


class _ReturnsGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        y = self.fc(x)
        return {"y": y, "rows": (row for row in y)}


def test_a_capture_error_names_data_dependent_control_flow_and_its_fix():
    with pytest.raises(CaptureError) as info:
        rewrite(_DataDependent(), torch.randn(2, 3))
    message = str(info.value)
    assert "Cause: data-dependent Python control flow in forward()" in message
    assert "`if x.sum() > 0:`" in message and "torch.where, torch.cond" in message
    assert "mixprec.amp.initialize(model, level='O1')" in message


def test_a_capture_error_names_an_output_that_cannot_be_rebuilt():
    with pytest.raises(CaptureError) as info:
        rewrite(_ReturnsGenerator(), torch.randn(2, 3))
    message = str(info.value)
    assert "Cause: the model's output holds a builtins.generator at output['rows']" in message
    assert "cannot pickle 'generator' object" in message
    assert "wrap the model in an nn.Module whose forward returns" in message
    assert "data-dependent" not in message


# -- float8: Conv1D, nn.Linear subclasses, the report, and back --------------------------


@pytest.mark.parametrize("kernel", ["native", "emulated"])
def test_float8_conv1d_is_the_float8_linear_of_the_transposed_weight(kernel, monkeypatch):
    """Same scales, same float8 values, same matmuls: a Float8Conv1D and a Float8Linear
    holding W^T give identical outputs and gradients (W's gradient in its own layout),
    on the float8 kernel and on its float32 emulation."""
    from mixprec.float8 import _matmul

    if kernel == "emulated":
        monkeypatch.setitem(_matmul._PROBED, "cpu", False)  # as on a device without the kernel
    elif not float8.native_scaled_mm("cpu"):
        pytest.skip("no float8 kernel on this CPU")
    torch.manual_seed(0)
    conv = Conv1D(32, 16)
    nn.init.normal_(conv.bias)
    f8_conv = float8.Float8Conv1D.from_conv1d(copy.deepcopy(conv), recipe="delayed")
    f8_lin = float8.Float8Linear(16, 32, recipe="delayed")
    with torch.no_grad():
        f8_lin.weight.copy_(conv.weight.t())
        f8_lin.bias.copy_(conv.bias)
    x = torch.randn(2, 5, 16)
    grad = torch.randn(2, 5, 32)
    outs = []
    for layer in (f8_conv, f8_lin):
        xi = x.clone().requires_grad_()
        for _ in range(2):  # the second step scales from the history
            xi.grad = None
            y = layer(xi)
            y.backward(grad)
        outs.append((y, xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(f8_conv.weight.grad, f8_lin.weight.grad.t())
    assert f8_conv.weight.grad.shape == conv.weight.shape
    assert torch.equal(f8_conv.bias.grad, f8_lin.bias.grad)
    for name in ("input_scaling", "weight_scaling", "grad_scaling"):
        assert torch.equal(getattr(f8_conv, name).scale, getattr(f8_lin, name).scale)
    torch.testing.assert_close(outs[0][0], conv(x), atol=0.1, rtol=0.1)


class _Scaled(nn.Linear):
    """A subclass that keeps nn.Linear.forward and adds an attribute and a buffer."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.tag = "scaled"
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))


class _Gated(nn.Linear):
    def forward(self, x):
        return super().forward(x) * torch.sigmoid(x.sum(-1, keepdim=True))


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = _Scaled(16, 32)
        self.gated = _Gated(32, 32)
        self.conv = nn.Conv1d(32, 16, 1)
        self.rnn = nn.LSTM(16, 16)
        self.bilinear = nn.Bilinear(16, 16, 16)


def test_convert_covers_gpt2_conv1d_and_linear_subclasses_and_names_what_it_leaves():
    gpt = real_models.gpt2(layers=1, width=32)
    report = float8.convert_to_float8(gpt, "dynamic")
    projections = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                   "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]  # fmt: skip
    vocab = len(real_models.vocabulary())
    assert report.converted == projections + (["lm_head"] if vocab % 16 == 0 else [])
    assert all(isinstance(gpt.get_submodule(name), float8.Float8Conv1D) for name in projections)
    assert {d.name: d.kind for d in report.decisions}["transformer.h.0.attn.c_attn"] == "Conv1D"
    if vocab % 16:
        assert report.skipped == {"lm_head": f"out_features={vocab} is not a multiple of 16"}
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # the tie survives

    mixed = _Mixed()
    report = float8.convert_to_float8(mixed)
    assert report.converted == ["sub"]
    assert isinstance(mixed.sub, float8.Float8Linear) and mixed.sub.tag == "scaled"
    assert "sub.calls" in mixed.state_dict()
    assert report.skipped == {
        "gated": "_Gated overrides Linear.forward, which may compute more than the matmul and "
                 "bias a float8 layer computes",
        "conv": "not supported: float8 covers nn.Linear and Conv1D layers, not convolutions",
        "rnn": "not supported: float8 covers nn.Linear and Conv1D layers; a recurrent layer "
               "runs its matmuls inside one fused kernel",
        "bilinear": "not supported: float8 covers nn.Linear and Conv1D layers, not bilinear "
                    "forms",
    }  # fmt: skip
    text = str(report)
    assert text.splitlines()[0] == "float8 (recipe 'dynamic'): 1 of 5 matmul layers converted"
    assert all(name in text for name in ("gated", "conv", "rnn", "bilinear", "Conv1d", "LSTM"))


def test_a_gpt2_trains_in_float8():
    batches = real_models.char_batches(batch=4, length=16, steps=4) * 2
    model = real_models.gpt2(layers=1, width=32, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0)  # fmt: skip
    reference = copy.deepcopy(model)
    float8.convert_to_float8(model, "delayed")
    losses = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                    head=lambda out: out.logits)  # fmt: skip
    want = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches,
                  head=lambda out: out.logits)  # fmt: skip
    assert losses[-1] < losses[0]
    assert max(abs(a - b) for a, b in zip(losses, want)) < 0.05 * want[0]
    stats = float8.read_float8_stats(model)
    assert stats["transformer.h.0.mlp.c_fc"]["amax_grad"] > 0


def test_a_float8_model_converts_back_and_loads_strictly_into_the_original():
    torch.manual_seed(0)
    model = real_models.gpt2(layers=1, width=32)
    model.add_module("extra", _Scaled(32, 32))
    float8.convert_to_float8(model, "delayed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, real_models.char_batches(batch=2, length=8, steps=1),
           head=lambda out: out.logits)  # fmt: skip
    assert any("_scaling." in key for key in model.state_dict())
    fresh = real_models.gpt2(layers=1, width=32, seed=1)
    fresh.add_module("extra", _Scaled(32, 32))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fresh.load_state_dict(model.state_dict(), strict=True)
    params = dict(model.named_parameters())
    plain = float8.convert_from_float8(model)
    assert plain is model
    assert type(model.transformer.h[0].attn.c_attn) is Conv1D
    assert type(model.extra) is _Scaled and model.extra.tag == "scaled"
    assert all(p is params[name] for name, p in model.named_parameters())
    fresh.load_state_dict(model.state_dict(), strict=True)
    x = real_models.char_batches(batch=2, length=8, steps=1)[0][0]
    assert torch.equal(fresh.eval()(x).logits, model.eval()(x).logits)
    layer = float8.Float8Linear(16, 16)
    assert type(float8.convert_from_float8(layer)) is nn.Linear
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        float8.convert_from_float8("model")


def test_a_float8_gpt2_resumes_its_scaling_state_exactly():
    batches = real_models.char_batches(batch=2, length=8, steps=4)

    def build():
        model = real_models.gpt2(layers=1, width=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                 attn_pdrop=0.0)  # fmt: skip
        float8.convert_to_float8(model, "delayed", history_len=4)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    head = lambda out: out.logits  # noqa: E731
    _train(model, opt, batches[:2], head)
    checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, batches[2:], head)
    resumed, resumed_opt = build()
    resumed.load_state_dict(checkpoint[0], strict=True)
    resumed_opt.load_state_dict(checkpoint[1])
    _train(resumed, resumed_opt, batches[2:], head)
    want = model.state_dict()
    assert any(key.endswith("amax_history") for key in want)
    for key, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, want[key]), key


def test_a_plain_checkpoint_loads_strictly_into_a_float8_model_keeping_its_scaling_state():
    """Pretrained plain weights into an already converted model: every weight loads,
    the scalings keep their state; a float8 checkpoint missing one scaling entry is
    still refused."""
    pretrained = real_models.gpt2(layers=1, width=32, seed=1).state_dict()
    model = real_models.gpt2(layers=1, width=32)
    float8.convert_to_float8(model, "delayed", history_len=4)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1),
           real_models.char_batches(batch=2, length=8, steps=1), head=lambda out: out.logits)  # fmt: skip
    scaling = {k: v.clone() for k, v in model.state_dict().items() if "_scaling." in k}
    assert any(v.abs().sum() > 0 for k, v in scaling.items() if k.endswith("amax_history"))
    model.load_state_dict(pretrained, strict=True)
    state = model.state_dict()
    for key, tensor in pretrained.items():
        assert torch.equal(state[key], tensor), key
    for key, tensor in scaling.items():
        assert torch.equal(state[key], tensor), key
    damaged = dict(state)
    del damaged["transformer.h.0.mlp.c_fc.grad_scaling.amax_history"]
    with pytest.raises(RuntimeError, match=r"Missing key.*c_fc\.grad_scaling\.amax_history"):
        model.load_state_dict(damaged, strict=True)
