"""Lightning with MixprecPrecision: a ResNet-style CNN on the digits mixprec ships.

The plugin applies the amp level, wraps the plain optimizer that
``configure_optimizers`` returns in a LossScaleOptimizer, unscales before Lightning
clips, skips overflowed steps and logs ``mixprec/loss_scale`` and
``mixprec/skipped_steps``.

    python examples/lightning_resnet.py --steps 300
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

from mixprec.integrations.lightning import MixprecPrecision
from mixprec.train.data import train_test_loaders

sys.path.insert(0, str(Path(__file__).parent))
from resnet_digits import resnet  # noqa: E402  (the CNN of the plain-loop example)


class DigitsClassifier(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = resnet()
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)  # self(x): float32 outputs
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_accuracy", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)  # the plain one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--level", default="O2")
    parser.add_argument("--out", default="runs/lightning")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train, test = train_test_loaders(batch_size=32)
    trainer = L.Trainer(
        max_steps=args.steps, limit_val_batches=max(1, min(args.steps // 10, len(test))),
        num_sanity_val_steps=0,
        gradient_clip_val=5.0, accelerator="auto", devices=1, default_root_dir=args.out,
        logger=False, enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=args.steps > 10,
        plugins=[MixprecPrecision(level=args.level, dtype=torch.bfloat16)],
    )  # fmt: skip
    module = DigitsClassifier()
    trainer.fit(module, train)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics = {**logged, **trainer.validate(module, test, verbose=False)[0]}
    print(f"level {args.level}: val accuracy {metrics['val_accuracy']:.4f}, "
          f"loss scale {metrics['mixprec/loss_scale']:g}, "
          f"skipped {metrics['mixprec/skipped_steps']:g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
