"""A ResNet-style CNN with BatchNorm trained at an amp level on the digits mixprec ships.

BatchNorm layers stay float32 at O2 (the level keeps normalisation layers in float32);
convolutions and the classifier run in bfloat16 (float16 on CUDA devices without
bfloat16), with float32 master weights and a dynamic loss scale.

    python examples/resnet_digits.py --steps 300 --level O2
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch import nn

from mixprec import amp
from mixprec.train.data import train_test_loaders


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection."""

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
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(widths: tuple[int, ...] = (16, 32), classes: int = 10) -> nn.Sequential:
    """A stem, two basic blocks per stage, global pooling and a linear classifier."""
    layers: list[nn.Module] = [nn.Conv2d(1, widths[0], 3, 1, 1, bias=False),
                               nn.BatchNorm2d(widths[0]), nn.ReLU()]  # fmt: skip
    previous = widths[0]
    for i, width in enumerate(widths):
        layers += [BasicBlock(previous, width, 1 if i == 0 else 2), BasicBlock(width, width)]
        previous = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(previous, classes)]
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--level", default="O2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=None, help="default: all")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp16_only = device.type == "cuda" and not torch.cuda.is_bf16_supported()
    dtype = torch.float16 if fp16_only else torch.bfloat16
    torch.manual_seed(args.seed)
    train, test = train_test_loaders(batch_size=32, seed=args.seed)
    model = resnet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, level=args.level, dtype=dtype)

    model.train()
    batches = itertools.islice(itertools.cycle(train), args.steps)
    for step, (x, y) in enumerate(batches, 1):
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.scale_loss(loss).backward()
        optimizer.unscale_()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 100 == 0:
            print(f"step {step}  loss {loss.item():.4f}")

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in itertools.islice(test, args.eval_batches):
            correct += int((model(x.to(device)).argmax(1) == y.to(device)).sum())
            total += len(y)
    print(f"level {args.level}, {dtype}: test accuracy {correct / total:.4f} after "
          f"{args.steps} steps, skipped {int(optimizer.skipped_steps)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
