"""Small classifiers for the training front end: LeNet-5, an MLP and a transformer.

Every model takes a batch shaped ``(N, 1, 8, 8)`` (the digits images) or the same
samples flattened, ``(N, 64)``, so one data loader serves all three. Forward passes
have no data-dependent Python control flow, so ``torch.fx.symbolic_trace`` and
``torch.compile`` see one static graph.

>>> import torch
>>> x = torch.rand(5, 1, 8, 8)
>>> [tuple(build_model(n, 10, (1, 8, 8))(x).shape) for n in MODEL_NAMES]
[(5, 10), (5, 10), (5, 10)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._checks import check_instance, check_number
from mixprec.train import _names

__all__ = ["LeNet5", "MLP", "TransformerClassifier", "MODEL_NAMES", "build_model"]


def _positive_int(name: str, value: Any, example: int) -> int:
    return check_number(name, value, integer=True, minimum=1, hint=f"pass e.g. {name}={example}")


def _lenet_feature_size(input_size: int, padding: int) -> int:
    # Two rounds of conv(k=5, stride 1) then max-pool(2, stride 2, floor).
    size = input_size
    for _ in range(2):
        size = (size + 2 * padding - 4) // 2
    return size


class LeNet5(nn.Module):
    """LeNet-5 as in MindSpore's mixed-precision tutorial, sized for any square input.

    Layers: conv(6, k5) -> relu -> maxpool(2) -> conv(16, k5) -> relu -> maxpool(2)
    -> flatten -> fc(120) -> relu -> fc(84) -> relu -> fc(num_classes). The fully
    connected weights start from Normal(0, 0.02) with zero bias, as in the tutorial.

    Adaptation to small images: the tutorial's 'valid' convolutions need 32x32
    inputs (32 -> 28 -> 14 -> 10 -> 5, so fc1 sees 16*5*5 = 400 features). On the
    8x8 digits they would shrink the image to nothing, so for ``input_size < 32``
    both convolutions use ``padding=2`` ('same'): 8 -> 8 -> 4 -> 4 -> 2, and fc1
    sees 16*2*2 = 64 features. Pass ``padding`` to choose explicitly. Input of
    shape ``(N, num_channels * input_size**2)`` is reshaped to an image first.

    >>> net = LeNet5()
    >>> net.fc1.in_features, tuple(net(torch.rand(3, 64)).shape)
    (64, (3, 10))
    >>> LeNet5(input_size=32).fc1.in_features
    400
    """

    def __init__(
        self,
        num_classes: int = 10,
        num_channels: int = 1,
        input_size: int = 8,
        padding: int | None = None,
    ) -> None:
        super().__init__()
        _positive_int("num_classes", num_classes, 10)
        _positive_int("num_channels", num_channels, 1)
        _positive_int("input_size", input_size, 8)
        if padding is None:
            padding = 0 if input_size >= 32 else 2
        check_number("padding", padding, integer=True, minimum=0, hint="pass e.g. padding=2")
        feature = _lenet_feature_size(input_size, padding)
        if feature < 1:
            raise ValueError(
                f"input_size={input_size} with padding={padding} leaves no pixels after two "
                "conv(k=5) + max-pool(2) stages; use input_size >= 4 with padding=2, or a "
                "larger image"
            )
        self.num_channels = num_channels
        self.input_size = input_size
        self.conv1 = nn.Conv2d(num_channels, 6, 5, padding=padding)
        self.conv2 = nn.Conv2d(6, 16, 5, padding=padding)
        self.fc1 = nn.Linear(16 * feature * feature, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)
        self.relu = nn.ReLU()
        self.max_pool2d = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()
        for fc in (self.fc1, self.fc2, self.fc3):
            nn.init.normal_(fc.weight, mean=0.0, std=0.02)
            nn.init.zeros_(fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``(N, num_classes)`` for images or flattened images ``x``."""
        x = x.reshape(x.shape[0], self.num_channels, self.input_size, self.input_size)
        x = self.max_pool2d(self.relu(self.conv1(x)))
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


class MLP(nn.Module):
    """A multilayer perceptron: flatten -> (linear -> relu) per hidden size -> linear.

    >>> net = MLP(in_features=64, hidden=(32,), num_classes=10)
    >>> [type(m).__name__ for m in net.layers]
    ['Flatten', 'Linear', 'ReLU', 'Linear']
    >>> tuple(net(torch.rand(4, 1, 8, 8)).shape)
    (4, 10)
    """

    def __init__(
        self, in_features: int = 64, hidden: Sequence[int] = (128, 128), num_classes: int = 10
    ) -> None:
        super().__init__()
        _positive_int("in_features", in_features, 64)
        _positive_int("num_classes", num_classes, 10)
        hint = "pass e.g. hidden=(128, 128), or hidden=() for a linear model"
        if isinstance(hidden, (str, bytes)):
            raise TypeError(
                f"hidden must be a sequence of layer widths, got {type(hidden).__name__} "
                f"{hidden!r}; {hint}"
            )
        check_instance("hidden", hidden, Sequence, "a sequence of layer widths", hint=hint)
        for i, width in enumerate(hidden):
            check_number(f"hidden[{i}]", width, integer=True, minimum=1, hint=hint)
        layers: list[nn.Module] = [nn.Flatten()]
        width_in = in_features
        for width in hidden:
            layers += [nn.Linear(width_in, width), nn.ReLU()]
            width_in = width
        layers.append(nn.Linear(width_in, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``(N, num_classes)``; ``x`` is flattened after the batch axis."""
        return self.layers(x)


class TransformerClassifier(nn.Module):
    """A small transformer encoder classifier that reads an image as rows of tokens.

    Each sample is flattened and cut into ``seq_len`` tokens of ``token_dim``
    values; for a 1x8x8 digit that is one token per image row. Pseudo-code::

        tokens = x.reshape(N, seq_len, token_dim)
        h = Linear(token_dim -> d_model)(tokens) + learned position embedding
        h = num_layers x TransformerEncoderLayer(pre-norm, batch_first)(h)
        logits = Linear(d_model -> num_classes)(LayerNorm(mean over tokens of h))

    >>> net = TransformerClassifier(num_classes=10, seq_len=8, token_dim=8)
    >>> tuple(net(torch.rand(2, 1, 8, 8)).shape)
    (2, 10)
    """

    def __init__(
        self,
        num_classes: int = 10,
        seq_len: int = 8,
        token_dim: int = 8,
        d_model: int = 64,
        nhead: int = 4,
        num_layers: int = 2,
        dim_feedforward: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        for name, value, example in (
            ("num_classes", num_classes, 10),
            ("seq_len", seq_len, 8),
            ("token_dim", token_dim, 8),
            ("d_model", d_model, 64),
            ("nhead", nhead, 4),
            ("num_layers", num_layers, 2),
            ("dim_feedforward", dim_feedforward, 128),
        ):
            _positive_int(name, value, example)
        if d_model % nhead != 0:
            raise ValueError(
                f"d_model must be divisible by nhead, got d_model={d_model}, nhead={nhead}; "
                f"pick e.g. nhead={math.gcd(d_model, 4)}"
            )
        hint = "pass e.g. dropout=0.1"
        if not 0.0 <= check_number("dropout", dropout, hint=hint) < 1.0:  # [0, 1): open at 1
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}; {hint}")
        self.seq_len = seq_len
        self.token_dim = token_dim
        self.embed = nn.Linear(token_dim, d_model)
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_len, d_model))
        nn.init.normal_(self.pos_embedding, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model,
            nhead,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            batch_first=True,
            # Pre-norm trains stably at a fixed learning rate without warm-up.
            norm_first=True,
        )
        # Nested tensors only help with padding masks, which fixed-size images never have.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``(N, num_classes)`` for ``x`` with ``seq_len * token_dim`` values per sample."""
        tokens = x.reshape(x.shape[0], self.seq_len, self.token_dim)
        h = self.embed(tokens) + self.pos_embedding
        h = self.encoder(h)
        return self.head(self.norm(h.mean(dim=1)))


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    # (F,) with F a perfect square is read as one square channel, so flat data such as
    # a 64-column CSV still fits the image models.
    if len(input_shape) == 3:
        return input_shape[0], input_shape[1], input_shape[2]
    if len(input_shape) == 2:
        return 1, input_shape[0], input_shape[1]
    side = math.isqrt(input_shape[0])
    if side * side != input_shape[0]:
        raise ValueError(
            f"model {name!r} needs an image, but input_shape={input_shape} is flat and "
            f"{input_shape[0]} is not a perfect square; pass input_shape=(C, H, W) or use 'mlp'"
        )
    return 1, side, side


def _build_lenet5(num_classes: int, input_shape: tuple[int, ...], **kwargs: Any) -> nn.Module:
    channels, height, width = _image_shape("lenet5", input_shape)
    if height != width:
        raise ValueError(
            f"model 'lenet5' needs square images, got input_shape={input_shape}; "
            "resize the images or use 'mlp' or 'transformer'"
        )
    return LeNet5(num_classes=num_classes, num_channels=channels, input_size=height, **kwargs)


def _build_mlp(num_classes: int, input_shape: tuple[int, ...], **kwargs: Any) -> nn.Module:
    return MLP(in_features=math.prod(input_shape), num_classes=num_classes, **kwargs)


def _build_transformer(num_classes: int, input_shape: tuple[int, ...], **kwargs: Any) -> nn.Module:
    if len(input_shape) == 1:
        side = math.isqrt(input_shape[0])
        # A square flat vector is read as image rows; any other length as one
        # token per feature.
        seq_len, token_dim = (side, side) if side * side == input_shape[0] else (input_shape[0], 1)
    else:
        channels, height, width = _image_shape("transformer", input_shape)
        # One token per row of each channel: this matches the channel-major order
        # in which reshape walks an (N, C, H, W) batch.
        seq_len, token_dim = channels * height, width
    return TransformerClassifier(
        num_classes=num_classes, seq_len=seq_len, token_dim=token_dim, **kwargs
    )


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "lenet5": _build_lenet5,
    "mlp": _build_mlp,
    "transformer": _build_transformer,
}

#: Names accepted by :func:`build_model` (also in :mod:`mixprec.train._names`, which the
#: command line reads without importing torch).
MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)
if MODEL_NAMES != _names.MODEL_NAMES:  # one list changed without the other
    raise ImportError(f"mixprec.train._names.MODEL_NAMES must be {MODEL_NAMES}")


def build_model(
    name: str,
    num_classes: int = 10,
    input_shape: Sequence[int] = (1, 8, 8),
    **kwargs: Any,
) -> nn.Module:
    """Build a model by name for samples of ``input_shape`` and ``num_classes`` classes.

    ``name`` is one of :data:`MODEL_NAMES` (case-insensitive). ``input_shape`` is one
    sample's shape without the batch axis: ``(C, H, W)``, ``(H, W)`` or ``(F,)``.
    Extra keyword arguments go to the model's constructor (e.g. ``hidden=(64,)`` for
    ``"mlp"``, ``d_model=32`` for ``"transformer"``).

    >>> build_model("mlp", 10, (64,), hidden=(32,)).layers[1]
    Linear(in_features=64, out_features=32, bias=True)
    >>> build_model("resnet", 10, (1, 8, 8))
    Traceback (most recent call last):
    ...
    ValueError: unknown model name 'resnet'; choose one of: lenet5, mlp, transformer
    """
    check_instance("name", name, str, "a str", hint=f"choose one of: {', '.join(MODEL_NAMES)}")
    key = name.strip().lower()
    if key not in _BUILDERS:
        raise ValueError(f"unknown model name {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    _positive_int("num_classes", num_classes, 10)
    if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Sequence):
        raise TypeError(
            f"input_shape must be a sequence of ints, got {type(input_shape).__name__} "
            f"{input_shape!r}; pass e.g. input_shape=(1, 8, 8)"
        )
    shape = tuple(input_shape)
    if not 1 <= len(shape) <= 3 or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape
    ):
        raise ValueError(
            f"input_shape must be 1 to 3 positive ints (one sample, no batch axis), got "
            f"{input_shape!r}; pass e.g. input_shape=(1, 8, 8) or (64,)"
        )
    return _BUILDERS[key](num_classes, shape, **kwargs)
