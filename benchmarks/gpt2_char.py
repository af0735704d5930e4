"""GPT-2 character model: validation loss, bytes and step time of every precision recipe.

A GPT-2 (``GPT2Config``: 4 layers, ``n_embd`` 256, 4 heads, context 64, no dropout)
trained as a character model on the tests' local corpus (``tests/data/corpus.txt``,
the first nine tenths; validation on the last tenth) for 300 steps of AdamW (lr 1e-3,
weight decay 0.01, batch 16) with torch's clipping recipe as written at every recipe::

    loss.backward()            # or opt.scale_loss(loss).backward() for mixprec
    opt.unscale_()             # mixprec; torch's GradScaler recipe at autocast (none in bf16)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()

Recipes (bfloat16 throughout): ``float32``; ``autocast`` (``torch.autocast``, float32
parameters, no scaler: bfloat16 needs none); mixprec ``O1``; ``O2`` (float32
masters); ``O3`` (bfloat16 parameters, no masters); ``rewrite`` (the graph rewrite of
the model, float32 parameters); ``O2-split`` (``master_weights="split"``); ``lean-kahan`` and
``lean-stochastic`` (the lean level); ``split8`` (O2's casts with
:class:`~mixprec.optim.Split8MasterWeights` around torch's AdamW) and ``split8-8bit``
(the same around :class:`~mixprec.optim.AdamW8bit`). Each recipe is trained from the
same float32 weights and batches per seed.

Reported per recipe: the final validation loss per seed, mean and spread (sample
standard deviation), the gap of the mean to float32's (percent), bytes per parameter
held between steps (live tensor storage: weights, masters or corrections, optimizer
state) and with the gradients (after a backward), and the median training-step time
as a ratio to float32's in the same run::

    python -m benchmarks.gpt2_char                          # 300 steps, seeds 0-2
    python -m benchmarks.gpt2_char --steps 40 --seeds 1 --layers 2 --width 64   # quick
    python -m benchmarks.gpt2_char --recipes float32,O2,split8-8bit --out gpt2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mixprec import amp
from mixprec.optim import AdamW8bit, LossScaleOptimizer, Split8MasterWeights
from mixprec.rewrite import rewrite
from mixprec.tools._memory import live_tensor_bytes

__all__ = ["RECIPES", "measure", "run"]

RECIPES = ("float32", "autocast", "O1", "O2", "O3", "rewrite", "O2-split", "lean-kahan",
           "lean-stochastic", "split8", "split8-8bit")  # fmt: skip

_TESTS = Path(__file__).resolve().parent.parent / "tests"


def _real_models() -> Any:
    if str(_TESTS) not in sys.path:  # the tests' model builders and corpus
        sys.path.insert(0, str(_TESTS))
    import real_models

    return real_models


def _with_split8(opt: LossScaleOptimizer) -> LossScaleOptimizer:
    """Give an O2 optimizer built without masters the ``"split8"`` ones."""
    opt._master = Split8MasterWeights(opt.inner_optimizer)
    return opt


def build(
    recipe: str, model: torch.nn.Module, lr: float, weight_decay: float, example: torch.Tensor
) -> Any:
    """(model, optimizer) for ``recipe``; the model is changed in place."""
    bf16 = torch.bfloat16
    if recipe in ("float32", "autocast"):
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if recipe == "rewrite":  # the graph holds the model's float32 parameters
        inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        return rewrite(model, (example,), dtype=bf16), LossScaleOptimizer(inner, "none")
    if recipe in ("split8", "split8-8bit"):
        cls: Any = AdamW8bit if recipe == "split8-8bit" else torch.optim.AdamW
        inner = cls(model.parameters(), lr=lr, weight_decay=weight_decay)
        model, opt = amp.initialize(model, inner, "O2", bf16, master_weights=False)
        return model, _with_split8(opt)
    level, masters = {
        "O1": ("O1", None), "O2": ("O2", None), "O3": ("O3", None), "O2-split": ("O2", "split"),
        "lean-kahan": ("lean", "kahan"), "lean-stochastic": ("lean", "stochastic"),
    }[recipe]  # fmt: skip
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    return amp.initialize(model, inner, level, bf16, master_weights=masters)


def measure(recipe: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one (recipe, seed); return validation loss, bytes per parameter, step time."""
    rm = _real_models()
    batches = rm.char_batches(args.batch, args.context, args.steps, seed=seed)
    val = rm.char_batches(args.batch, args.context, args.val_batches, seed=10_000, split="val")
    baseline = live_tensor_bytes()
    model = rm.gpt2(layers=args.layers, width=args.width, heads=args.heads,
                    context=args.context, seed=seed, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0)  # fmt: skip
    model, opt = build(recipe, model, args.lr, args.weight_decay, batches[0][0])
    mixprec = isinstance(opt, LossScaleOptimizer)
    n = sum(p.numel() for p in model.parameters())
    times, with_grads = [], 0.0
    for i, (x, y) in enumerate(batches):
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=recipe == "autocast"):
            logits = model(x).logits
        loss = rm.lm_loss(logits, y)
        (opt.scale_loss(loss) if mixprec else loss).backward()
        del logits, loss
        if i == len(batches) - 1:  # bytes with the gradients, once (a gc scan)
            grads = [p.grad for p in model.parameters()]  # Python objects the scan sees
            with_grads = (live_tensor_bytes() - baseline) / n
            del grads
        if mixprec:
            opt.unscale_()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i != len(batches) - 1:
            times.append(time.perf_counter() - start)
    held = (live_tensor_bytes() - baseline) / n
    with torch.no_grad():
        model.eval()
        losses = []
        for x, y in val:
            with torch.autocast("cpu", torch.bfloat16, enabled=recipe == "autocast"):
                losses.append(float(rm.lm_loss(model(x).logits, y)))
    return {"seed": seed, "val_loss": statistics.fmean(losses), "bytes_per_param": held,
            "bytes_per_param_with_grads": with_grads, "params": n,
            "step_s": statistics.median(times) if times else float("nan")}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    recipes = args.recipes.split(",")
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)}")
    rows: dict[str, Any] = {}
    for recipe in recipes:
        runs = [measure(recipe, seed, args) for seed in range(args.seeds)]
        losses = [r["val_loss"] for r in runs]
        rows[recipe] = {
            "val_loss_per_seed": losses,
            "val_loss_mean": statistics.fmean(losses),
            "val_loss_stdev": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "bytes_per_param": round(runs[0]["bytes_per_param"], 3),
            "bytes_per_param_with_grads": round(runs[0]["bytes_per_param_with_grads"], 3),
            "step_s": statistics.median(r["step_s"] for r in runs),
            "params": runs[0]["params"],
        }
        print(f"{recipe:16} val {rows[recipe]['val_loss_mean']:.4f} "
              f"({rows[recipe]['val_loss_stdev']:.4f}) per seed {losses}", flush=True)  # fmt: skip
        if args.out:  # what is done so far survives an interrupted run
            Path(args.out).write_text(json.dumps({"partial": True, "recipes": rows}, indent=2))
    anchor = rows.get("float32")
    for row in rows.values():
        if anchor is not None:
            row["gap_vs_float32_pct"] = 100 * (row["val_loss_mean"] / anchor["val_loss_mean"] - 1)
            row["step_time_vs_float32"] = row["step_s"] / anchor["step_s"]
    config = {k: v for k, v in vars(args).items() if k not in ("out", "recipes")}
    return {"config": config, "recipes": rows}


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = ["| recipe | val loss mean (stdev) | per seed | vs float32 | B/param | "
             "B/param with grads | step time vs float32 |",
             "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, row in result["recipes"].items():
        seeds = " ".join(f"{v:.4f}" for v in row["val_loss_per_seed"])
        gap = row.get("gap_vs_float32_pct")
        ratio = row.get("step_time_vs_float32")
        lines.append(
            f"| {name} | {row['val_loss_mean']:.4f} ({row['val_loss_stdev']:.4f}) | {seeds} | "
            f"{'' if gap is None else f'{gap:+.2f} %'} | {row['bytes_per_param']:.2f} | "
            f"{row['bytes_per_param_with_grads']:.2f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    args = parser.parse_args(argv)
    result = run(args)
    print(markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
