"""FSDP2 under torchrun with mixprec: a small transformer language model, sharded.

Every rank holds a shard of each bfloat16 parameter (``fully_shard``);
``LossScaleOptimizer(master_weights=True)`` keeps float32 masters of the shards and
all ranks agree on skipped steps (the found-inf flag is all-reduced), and
``global_clipnorm`` clips by the whole model's norm, not a shard's. CPU processes join
over gloo on 127.0.0.1 (NCCL with one GPU per process when CUDA is there):

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500 \\
        examples/fsdp2_torchrun.py --steps 100
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mixprec import LossScaleOptimizer

TEXT = Path(__file__).parent / "data" / "text.txt"


class CharTransformer(nn.Module):
    """Embedding, a causal transformer encoder and a linear head over characters."""

    def __init__(self, vocab: int, width: int = 64, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(
            ids.shape[1], dtype=self.position.dtype
        )
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            if cuda
            else torch.device("cpu")
        )
        if cuda:
            torch.cuda.set_device(device)
        text = TEXT.read_text(encoding="utf-8")
        vocabulary = sorted(set(text))
        ids = torch.tensor([vocabulary.index(c) for c in text])

        torch.manual_seed(0)  # the same initial weights on every rank
        model = CharTransformer(len(vocabulary), context=args.length).to(device, torch.bfloat16)
        mesh = init_device_mesh(device.type, (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 master_weights=True, global_clipnorm=1.0)  # fmt: skip

        generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
        for step in range(1, args.steps + 1):
            starts = torch.randint(
                0, len(ids) - args.length - 1, (args.batch_size,), generator=generator
            )
            window = torch.stack([ids[s : s + args.length + 1] for s in starts.tolist()]).to(device)
            logits = model(window[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.float().flatten(0, 1), window[:, 1:].flatten()
            )
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            if rank == 0 and (step % 20 == 0 or step == args.steps):
                print(f"step {step}  loss {loss.item():.3f}  loss scale {float(opt.loss_scale):g}")
        if rank == 0:
            print(f"{world} ranks, {args.steps} steps, skipped {int(opt.skipped_steps)}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
