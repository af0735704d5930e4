"""Diagnostics on a model that needs loss scaling: raw sensor counts in float16.

A small conv net with BatchNorm is fed the digits as raw 16-bit counts (0..60000) with a
summed loss: in float16 its first convolution overflows and its gradients need a scale
the other layers cannot take. ``mixprec.diagnose`` finds this in float32 on a few
batches, ``report.suggest()`` turns it into settings, and training in float16 with them
skips no steps.

    python examples/diagnostics_float16.py --steps 100

The report goes to a fresh folder each run (runs/diagnostics_float16, then -2, -3, ...),
never into one that holds another report; ``--out DIR`` names it (refused if it holds a
report, unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec import amp
from mixprec.train.data import train_test_loaders


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def train(batches, steps: int, float32_modules=(), **kwargs) -> int:
    """Train ``steps`` steps at O2 in float16; the number of skipped steps."""
    net = build()
    for name in float32_modules:
        amp.to_float(net.get_submodule(name), torch.float32)
    net, opt = amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-3), "O2",
                              torch.float16, **kwargs)  # fmt: skip
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    try:
        for x, y in itertools.islice(itertools.cycle(batches), steps):
            opt.scale_loss(loss_fn(net(x).float(), y)).backward()
            opt.step()
            opt.zero_grad()
    except mixprec.ScaleCollapseError:
        pass  # every step overflowed until the scale hit its floor: counted below
    return int(opt.skipped_steps)


def fresh_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``... : the first that does not exist yet."""
    n = 1
    while (found := base if n == 1 else base.with_name(f"{base.name}-{n}")).exists():
        n += 1
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the report is saved (default: a fresh folder under runs/)",
    )
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the report in --out")  # fmt: skip
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = fresh_folder(Path("runs/diagnostics_float16"))
    elif (args.out / "precision_report.json").exists() and not args.overwrite:
        parser.error(f"--out {args.out} already holds a report; choose another --out, or "
                     "pass --overwrite to replace it")  # fmt: skip

    loader, _ = train_test_loaders(batch_size=32)
    raw = [(x * 60000, y) for x, y in loader]  # raw sensor counts, not normalised
    report = mixprec.diagnose(build(), nn.CrossEntropyLoss(reduction="sum"), raw[:8])
    print("\n".join(str(report).splitlines()[:4]))
    report.save(args.out)
    suggestion = report.suggest()
    print(f"keep in float32: {suggestion.float32_modules}; start the scale at "
          f"{suggestion.kwargs['loss_scale'].initial_scale:g}")  # fmt: skip
    print(f"skipped in {args.steps} steps: as written {train(raw, args.steps)}, "
          f"with {suggestion.float32_modules} in float32 "
          f"{train(raw, args.steps, suggestion.float32_modules)}, and the scale too "
          f"{train(raw, args.steps, suggestion.float32_modules, **suggestion.kwargs)}")  # fmt: skip
    print(f"report saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
