"""Small real architectures for tests: what users bring, built from configs, on local data.

Nothing is downloaded: the GPT-2 is built from a ``GPT2Config``, the text is
``tests/data/corpus.txt`` (a copy of part of the project's own porting guide), and
the CNN is a ResNet-style network with BatchNorm written here (torchvision is not a
dependency).

>>> model = gpt2(layers=1, width=32)
>>> inputs, targets = char_batches(batch=2, length=8, steps=1)[0]
>>> model(inputs).logits.shape[-1] == len(vocabulary())
True
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


@functools.lru_cache(maxsize=1)
def vocabulary() -> str:
    """The sorted characters of the corpus."""
    return "".join(sorted(set(CORPUS.read_text(encoding="utf-8"))))


def encoded_corpus() -> torch.Tensor:
    """The corpus as a 1-D tensor of character ids."""
    index = {c: i for i, c in enumerate(vocabulary())}
    return torch.tensor([index[c] for c in CORPUS.read_text(encoding="utf-8")])


def char_batches(batch: int, length: int, steps: int, *, seed: int = 0, split: str = "train"):
    """``steps`` (inputs, targets) pairs of shape (batch, length); targets are the inputs
    shifted by one character. ``split="val"`` draws from the last tenth of the corpus."""
    ids = encoded_corpus()
    cut = len(ids) * 9 // 10
    ids = ids[:cut] if split == "train" else ids[cut:]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
        window = torch.stack([ids[s : s + length + 1] for s in starts.tolist()])
        out.append((window[:, :-1], window[:, 1:]))
    return out


def gpt2(layers: int = 2, width: int = 64, heads: int = 2, context: int = 64, seed: int = 0,
         **config):  # fmt: skip
    """A Hugging Face GPT-2 character model built from a ``GPT2Config`` (float32)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(vocabulary()), n_positions=context, n_embd=width,
                     n_layer=layers, n_head=heads, bos_token_id=0, eos_token_id=0,
                     **config)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of next-character logits, in float32."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm and a residual add."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet(widths: tuple[int, ...] = (8, 16), classes: int = 10, channels: int = 3,
           seed: int = 0) -> nn.Module:  # fmt: skip
    """A ResNet-style CNN (ResNet-18's stem, basic blocks and head, fewer stages)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [
        nn.Conv2d(channels, widths[0], 3, 1, 1, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(),
    ]
    previous = widths[0]
    for i, width in enumerate(widths):
        layers += [BasicBlock(previous, width, 1 if i == 0 else 2), BasicBlock(width, width)]
        previous = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(previous, classes)]
    return nn.Sequential(*layers)


class LSTMLanguageModel(nn.Module):
    """An embedding, an ``nn.LSTM`` and a linear head: a character language model."""

    def __init__(self, vocab: int, width: int = 32, layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, layers, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


def lstm(width: int = 32, layers: int = 1, seed: int = 0) -> LSTMLanguageModel:
    """An LSTM character language model over the corpus's vocabulary."""
    torch.manual_seed(seed)
    return LSTMLanguageModel(len(vocabulary()), width, layers)


def images(batch: int = 4, size: int = 16, classes: int = 10, seed: int = 0):
    """A batch of the package's digits images (read from its ``digits.npz``), upsampled
    to ``size`` and repeated to three channels, with their labels."""
    from mixprec.train.data import load_digits

    x, y = load_digits("train")
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(x), (batch,), generator=gen)
    x = nn.functional.interpolate(x[pick], size=size).repeat(1, 3, 1, 1)
    return x, y[pick] % classes


def train_steps(model: nn.Module, opt, steps: int, *, edit=None, size: int = 8) -> None:
    """``steps`` steps of a mixprec optimizer (``opt.scale_loss``) on batches of
    :func:`images` in the first weight's dtype and memory format (channels-last
    weights get channels-last batches); ``edit(step, model)`` runs before each."""
    for step in range(steps):
        if edit is not None:
            edit(step, model)
        first = next(model.parameters())
        x, y = images(batch=4, size=size, classes=5, seed=step)
        layout = torch.channels_last if first.is_contiguous(memory_format=torch.channels_last) \
            and not first.is_contiguous() else torch.contiguous_format  # fmt: skip
        loss = nn.functional.cross_entropy(model(x.to(first.dtype, memory_format=layout)).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
