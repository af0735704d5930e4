"""A Transformers Trainer at an amp level: MixprecTrainer on a GPT-2 character model.

The model is built from a GPT2Config (nothing is downloaded) and trained on
``examples/data/text.txt``. Leave ``fp16``/``bf16`` False: the level sets the precision;
``max_grad_norm`` clips the true (unscaled) gradients.

    python examples/hf_trainer_gpt2.py --steps 200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, TrainingArguments

from mixprec.integrations.transformers import MixprecTrainer

TEXT = Path(__file__).parent / "data" / "text.txt"


def windows(length: int, count: int, seed: int = 0) -> tuple[list[dict], int]:
    """``count`` random windows of the text as GPT-2 inputs (labels = inputs: the model
    shifts them), and the vocabulary size."""
    text = TEXT.read_text(encoding="utf-8")
    vocabulary = sorted(set(text))
    ids = torch.tensor([vocabulary.index(c) for c in text])
    starts = torch.randint(
        0, len(ids) - length, (count,), generator=torch.Generator().manual_seed(seed)
    )
    rows = [
        {"input_ids": ids[s : s + length], "labels": ids[s : s + length]} for s in starts.tolist()
    ]
    return rows, len(vocabulary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--level", default="O2")
    parser.add_argument("--out", default="runs/hf_gpt2")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    rows, vocab = windows(length=64, count=max(64, 16 * args.steps))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2,
                                       n_head=2, bos_token_id=0, eos_token_id=0))  # fmt: skip
    training = TrainingArguments(
        args.out, max_steps=args.steps, per_device_train_batch_size=16, learning_rate=3e-3,
        max_grad_norm=1.0, logging_steps=max(1, args.steps // 4), report_to=[],
        save_strategy="no", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = MixprecTrainer(model=model, args=training, train_dataset=rows,
                             level=args.level, dtype=torch.bfloat16)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the summary below says enough
    trainer.train()
    last = [entry for entry in trainer.state.log_history if "loss" in entry][-1]
    print(f"level {args.level}: step {last['step']} loss {last['loss']:.3f}, "
          f"grad norm {last['grad_norm']:.3f}, loss scale {last['mixprec/loss_scale']:g}, "
          f"skipped {last['mixprec/skipped_steps']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
