"""Tests for mixprec.train.models: shapes, the LeNet-5 layout, the registry, and training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.train.data import train_test_loaders
from mixprec.train.models import MLP, MODEL_NAMES, LeNet5, TransformerClassifier, build_model


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("shape", [(6, 1, 8, 8), (6, 64)])
def test_every_model_maps_images_or_flat_rows_to_logits(name, shape):
    model = build_model(name, num_classes=7, input_shape=(1, 8, 8))
    x = torch.rand(shape)
    out = model(x)
    assert out.shape == (6, 7) and out.dtype == torch.float32
    # Same samples, either layout: same logits.
    model.eval()
    torch.testing.assert_close(model(x.reshape(6, 1, 8, 8)), model(x.reshape(6, 64)))


def test_lenet5_layers_match_the_tutorial_and_adapt_to_8x8():
    net = LeNet5()
    assert (net.conv1.in_channels, net.conv1.out_channels, net.conv1.kernel_size) == (1, 6, (5, 5))
    assert (net.conv2.out_channels, net.conv2.kernel_size) == (16, (5, 5))
    assert net.conv1.padding == (2, 2) and net.conv2.padding == (2, 2)
    assert [(m.in_features, m.out_features) for m in (net.fc1, net.fc2, net.fc3)] == [
        (16 * 2 * 2, 120),
        (120, 84),
        (84, 10),
    ]
    assert net.max_pool2d.kernel_size == 2 and net.max_pool2d.stride == 2


def test_lenet5_on_32x32_is_the_tutorial_network():
    net = LeNet5(num_classes=10, num_channels=1, input_size=32)
    assert net.conv1.padding == (0, 0) and net.fc1.in_features == 16 * 5 * 5
    assert net(torch.rand(2, 1, 32, 32)).shape == (2, 10)
    assert LeNet5(num_channels=3, input_size=28, padding=2).fc1.in_features == 16 * 7 * 7


def test_lenet5_fully_connected_init_is_normal_002_with_zero_bias():
    net = LeNet5()
    for fc in (net.fc1, net.fc2, net.fc3):
        assert torch.count_nonzero(fc.bias) == 0
    # 10,080 draws: the sample std of N(0, 0.02) is within 5% of 0.02 with near certainty.
    std = float(net.fc2.weight.detach().std())
    assert 0.019 < std < 0.021
    assert abs(float(net.fc2.weight.detach().mean())) < 0.002


def test_lenet5_rejects_images_too_small_and_bad_arguments():
    with pytest.raises(ValueError, match="input_size=2 with padding=2 leaves no pixels"):
        LeNet5(input_size=2)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 1, got 0"):
        LeNet5(num_classes=0)
    with pytest.raises(TypeError, match=r"num_channels must be an integer >= 1, got 1.0 \(float\)"):
        LeNet5(num_channels=1.0)
    with pytest.raises(ValueError, match="padding must be an integer >= 0, got -1"):
        LeNet5(padding=-1)


def test_mlp_layers_and_linear_special_case():
    net = MLP(in_features=64, hidden=(32, 16), num_classes=3)
    linears = [m for m in net.layers if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16), (16, 3)]
    assert sum(isinstance(m, nn.ReLU) for m in net.layers) == 2
    linear = MLP(hidden=())
    assert [type(m) for m in linear.layers] == [nn.Flatten, nn.Linear]
    with pytest.raises(TypeError, match="hidden must be a sequence"):
        MLP(hidden=128)
    with pytest.raises(ValueError, match=r"hidden\[1\] must be an integer >= 1, got 0"):
        MLP(hidden=(8, 0))


def test_transformer_structure_and_checks():
    net = TransformerClassifier(
        num_classes=10, seq_len=8, token_dim=8, d_model=32, nhead=4, num_layers=3
    )
    layers = [m for m in net.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    assert len(layers) == 3 and all(layer.self_attn.batch_first for layer in layers)
    assert net.pos_embedding.shape == (1, 8, 32) and net.pos_embedding.requires_grad
    assert isinstance(net.norm, nn.LayerNorm) and net.head.in_features == 32
    with pytest.raises(
        ValueError, match="d_model must be divisible by nhead, got d_model=30, nhead=4"
    ):
        TransformerClassifier(d_model=30, nhead=4)
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\), got 1.0"):
        TransformerClassifier(dropout=1.0)


def test_transformer_position_embedding_makes_row_order_matter():
    net = TransformerClassifier(dropout=0.0).eval()
    with torch.no_grad():
        net.pos_embedding.normal_(std=1.0)
    x = torch.rand(4, 1, 8, 8)
    flipped = x.flip(dims=[2])
    assert not torch.allclose(net(x), net(flipped))
    # Without positions, mean pooling makes the model blind to row order.
    with torch.no_grad():
        net.pos_embedding.zero_()
    torch.testing.assert_close(net(x), net(flipped), rtol=1e-4, atol=1e-5)


def test_build_model_registry():
    assert MODEL_NAMES == ("lenet5", "mlp", "transformer")
    with pytest.raises(
        ValueError, match="unknown model name 'vgg'; choose one of: lenet5, mlp, transformer"
    ):
        build_model("vgg", 10, (1, 8, 8))
    assert isinstance(build_model(" LeNet5 ", 10, (64,)), LeNet5)
    mlp = build_model("mlp", 4, (3, 5, 5), hidden=(8,))
    assert mlp.layers[1].in_features == 75 and mlp.layers[-1].out_features == 4
    tr = build_model("transformer", 10, (3, 4, 4), d_model=16, nhead=2)
    assert (tr.seq_len, tr.token_dim) == (12, 4)
    assert (
        build_model("transformer", 2, (10,)).seq_len,
        build_model("transformer", 2, (16,)).seq_len,
    ) == (10, 4)
    with pytest.raises(ValueError, match="10 is not a perfect square"):
        build_model("lenet5", 10, (10,))
    with pytest.raises(ValueError, match="needs square images"):
        build_model("lenet5", 10, (1, 8, 6))
    with pytest.raises(ValueError, match="input_shape must be 1 to 3 positive ints"):
        build_model("mlp", 10, (1, 0, 8))
    with pytest.raises(TypeError, match="input_shape must be a sequence of ints, got int"):
        build_model("mlp", 10, 64)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_trace_with_torch_fx(name):
    model = build_model(name, 10, (1, 8, 8)).eval()
    traced = torch.fx.symbolic_trace(model)
    x = torch.rand(3, 1, 8, 8)
    torch.testing.assert_close(traced(x), model(x))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_run_and_backprop_under_bfloat16_autocast(name):
    model = build_model(name, 10, (1, 8, 8))
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float(), y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def _train_and_test(name, epochs, lr):
    torch.manual_seed(0)
    train, test = train_test_loaders(batch_size=32, seed=0)
    model = build_model(name, 10, (1, 8, 8))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        model.train()
        for x, y in train:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in test)
    return correct / len(test.dataset)


def test_lenet5_learns_the_digits_in_float32():
    # About one second on one CPU core; 10% is chance level.
    assert _train_and_test("lenet5", epochs=15, lr=1e-2) > 0.90


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_mlp_and_transformer_learn_the_digits_in_float32(name):
    assert _train_and_test(name, epochs=15, lr=3e-3) > 0.95
