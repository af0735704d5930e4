"""Accelerate with mixprec: ``prepare_amp`` before ``accelerator.prepare``.

An MLP on the digits mixprec ships, in an Accelerator with ``mixed_precision="no"``
(the amp level sets the precision). ``accelerator.backward`` scales the loss,
``clip_grad_norm_`` unscales first, ``optimizer.step()`` skips overflowed steps, and
``save_state`` keeps the loss scale, counters and master weights.

    python examples/accelerate_digits.py --steps 300
"""

from __future__ import annotations

import argparse
import itertools

import torch
from accelerate import Accelerator
from torch import nn

from mixprec.integrations.accelerate import prepare_amp
from mixprec.train.data import train_test_loaders
from mixprec.train.models import MLP


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--level", default="O2")
    parser.add_argument("--out", default="runs/accelerate")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train, test = train_test_loaders(batch_size=32, image=False)
    model = MLP(in_features=64, hidden=(128, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, optimizer = prepare_amp(accelerator, model, optimizer, level=args.level,
                                   dtype=torch.bfloat16)  # fmt: skip
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)

    for x, y in itertools.islice(itertools.cycle(train), args.steps):
        accelerator.backward(nn.functional.cross_entropy(model(x), y))  # loss * scale
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscales first
        optimizer.step()  # skipped if a gradient is inf/NaN
        optimizer.zero_grad()
    accelerator.save_state(args.out)

    correct = total = 0
    with torch.no_grad():
        for x, y in test:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    print(f"level {args.level}: test accuracy {correct / total:.4f} after {args.steps} steps; "
          f"state saved to {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
