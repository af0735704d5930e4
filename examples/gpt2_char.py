"""A Hugging Face GPT-2 character model, built from a GPT2Config, trained with mixprec.

The text is ``examples/data/text.txt`` (nothing is downloaded). The loop is the common
case: ``amp.initialize``, ``scale_loss(loss).backward()``, clip the true gradients,
``step()``. On a CUDA device it trains in float16 with dynamic loss scaling (or
bfloat16 where supported); on a CPU in bfloat16.

    python examples/gpt2_char.py --steps 200
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from mixprec import amp

TEXT = Path(__file__).parent / "data" / "text.txt"


def batches(ids: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    """Endless (inputs, targets) windows; the targets are the inputs shifted by one."""
    while True:
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=generator)
        window = torch.stack([ids[s : s + length + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--level", default="O2", help="O0, O1, O2, O3, lean or auto")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        dtype = torch.float16
    else:
        dtype = torch.bfloat16

    text = TEXT.read_text(encoding="utf-8")
    vocabulary = sorted(set(text))
    ids = torch.tensor([vocabulary.index(c) for c in text])
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=len(vocabulary), n_positions=args.length, n_embd=64,
                        n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, level=args.level, dtype=dtype)

    data = batches(ids, args.batch_size, args.length, torch.Generator().manual_seed(args.seed))
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = (t.to(device) for t in next(data))
        logits = model(inputs).logits
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        optimizer.scale_loss(loss).backward()
        optimizer.unscale_()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == args.steps:
            print(
                f"step {step}  loss {loss.item():.3f}  loss scale {float(optimizer.loss_scale):g}"
            )
    print(f"level {args.level}, {dtype}, {device.type}: {args.steps} steps in "
          f"{time.perf_counter() - started:.1f} s, skipped {int(optimizer.skipped_steps)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
