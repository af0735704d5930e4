"""Float8 training side by side: mixprec's float8 layers beside torchao's, in one run.

For each model and each recipe, both libraries convert a copy of the same float32
model, and the run records what is deterministic on a CPU:

==========================  =====================================================================
figure                      how it is measured
==========================  =====================================================================
``kernels``                 ``torch._inductor.metrics.generated_kernel_count`` after one
                            ``torch.compile``\\ d forward and backward (Dynamo reset, inductor's
                            FX-graph and AOT caches off, so every kernel is generated anew)
``kernels_per_layer``       ``kernels`` beyond the float32 model's, per float8 layer: what one
                            layer's float8 work costs, comparable where the libraries convert
                            different layers (GPT-2)
``graph_breaks``            Dynamo's graph-break counter over those steps
``recompiles``              graphs compiled after the first step, over five steps
``eager_ops``               aten ops of one eager forward and backward, as a
                            ``TorchDispatchMode`` sees them (the ops a tensor subclass runs
                            inside its own dispatch, as torchao's float8 tensor does, are not
                            seen)
``eager_calls``             aten calls that reach a kernel in the same step, the profiler's
                            aten events with no aten event inside them: the ops inside a
                            subclass's dispatch included, so both libraries count alike
``loss``                    the eager loss after ``--steps`` AdamW steps, from the same weights
                            and batches; ``vs_fp32`` and ``vs_torchao`` are its differences
                            from the float32 run's and torchao's same-recipe run's
``grad_error``              the first step's gradients against float32's, from the same
                            weights and batch: ``|g - g32| / |g32|`` over all parameters (one
                            step's float8 error, free of the drift of ten steps of training)
==========================  =====================================================================

Models: ``stack`` (``Linear(256, 1024) -> GELU -> Linear(1024, 256)``), ``block`` (a
pre-norm transformer block of ``nn.Linear`` projections: attention and MLP) and
``gpt2`` (Hugging Face's GPT-2 built from a small ``GPT2Config``, nothing downloaded;
its attention and MLP projections are ``Conv1D`` layers, which mixprec converts and
torchao does not). On GPT-2 mixprec runs twice: converting every layer it can (library
``mixprec``, the ``Conv1D`` projections too) and only the layers torchao converts
(``mixprec-same-layers``, the like-for-like row its ``vs_torchao`` compares). Recipes,
by mixprec's name and torchao's:
``dynamic``/``tensorwise``, ``rowwise``/``rowwise``,
``rowwise_with_gw_hp``/``rowwise_with_gw_hp``; ``delayed`` is mixprec's alone (torchao
removed delayed scaling). A recipe the installed mixprec does not have is reported as
missing. Wall-clock figures are left to GPU runs: on a CPU ``torch._scaled_mm`` is
not the fast path either library is built for::

    python -m benchmarks.float8_peers --out benchmarks/results/float8_peers_cpu.json \\
        --markdown float8_peers.md
    python -m benchmarks.float8_peers --models stack --recipes dynamic   # one case
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._common import environment, jsonable

__all__ = ["MODELS", "RECIPES", "build_model", "measure", "render", "run"]

#: The models, by name.
MODELS = ("stack", "block", "gpt2")
#: mixprec's recipe name -> torchao's (``None``: torchao has no such recipe).
RECIPES: dict[str, str | None] = {
    "dynamic": "tensorwise",
    "delayed": None,
    "rowwise": "rowwise",
    "rowwise_with_gw_hp": "rowwise_with_gw_hp",
}
STEPS_FOR_RECOMPILES = 5


class Block(nn.Module):
    """A pre-norm transformer block whose four projections are ``nn.Linear`` layers."""

    def __init__(self, d_model: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def build_model(name: str) -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor]]:
    """A float32 model (seeded) and ``loss(model, step)``, its loss on batch ``step``."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "stack":
        model: nn.Module = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        teacher = torch.randn(256, 256, generator=gen) / 16
        xs = [torch.randn(64, 256, generator=gen) for _ in range(4)]

        def loss(m: nn.Module, step: int) -> torch.Tensor:
            x = xs[step % len(xs)]
            return F.mse_loss(m(x), torch.tanh(x @ teacher))

    elif name == "block":
        model = Block()
        xs = [torch.randn(4, 32, 128, generator=gen) for _ in range(4)]

        def loss(m: nn.Module, step: int) -> torch.Tensor:
            x = xs[step % len(xs)]
            return F.mse_loss(m(x), x.flip(1))

    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=32, n_embd=128, n_layer=2, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = GPT2LMHeadModel(config)
        ids = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(4)]

        def loss(m: nn.Module, step: int) -> torch.Tensor:
            batch = ids[step % len(ids)]
            return F.cross_entropy(m(batch).logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    else:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    return model, loss


def _torchao_filter(module: nn.Module, name: str) -> bool:
    # torch._scaled_mm needs both features multiples of 16; mixprec skips the others too.
    return module.in_features % 16 == 0 and module.out_features % 16 == 0  # type: ignore[operator]


def _linear_only(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)  # torchao's reach: Hugging Face's Conv1D is not one


def convert(model: nn.Module, library: str, recipe: str) -> int:
    """Convert ``model`` in place with ``library``'s ``recipe``; the float8 layer count.

    ``library``: ``"float32"`` (nothing), ``"mixprec"``, ``"mixprec-same-layers"`` (only
    the ``nn.Linear`` layers, as torchao) or ``"torchao"``.
    """
    if library == "float32":
        return 0
    if library in ("mixprec", "mixprec-same-layers"):
        from mixprec.float8 import convert_to_float8

        only = _linear_only if library == "mixprec-same-layers" else None
        return len(convert_to_float8(model, recipe, module_filter=only).converted)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear as AoFloat8Linear

    ao_recipe = RECIPES[recipe]
    assert ao_recipe is not None
    config = Float8LinearConfig.from_recipe_name(ao_recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=_torchao_filter)
    return sum(isinstance(m, AoFloat8Linear) for m in model.modules())


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(step: Callable[[], object]) -> int:
    """The aten ops a ``TorchDispatchMode`` sees while ``step()`` runs."""
    counter = _OpCounter()
    with counter:
        step()
    return counter.ops


def kernel_calls(step: Callable[[], object]) -> int:
    """The aten calls that reach a kernel while ``step()`` runs: the profiler's aten events
    with no aten event inside them (what a tensor subclass dispatches inside its own
    ``__torch_dispatch__`` included; a composite op counts by the ops it runs)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(not any(c.name.startswith("aten::") for c in e.cpu_children) for e in aten)


def _compiled_figures(model: nn.Module, loss: Callable[[nn.Module, int], torch.Tensor]
                      ) -> dict[str, int]:  # fmt: skip
    """Kernels of one compiled forward+backward, graph breaks and recompiles over 5 steps."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch._dynamo.reset()
    counters.clear()
    metrics.reset()
    compiled = torch.compile(model)
    graphs_after_first = 0
    with inductor_config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "dynamo_pgo force disabled")  # said once per case
        for step in range(STEPS_FOR_RECOMPILES):
            loss(compiled, step).backward()
            if step == 0:
                kernels = metrics.generated_kernel_count
                graphs_after_first = counters["stats"]["unique_graphs"]
            opt.step()
            opt.zero_grad()
    breaks = sum(counters["graph_break"].values())
    recompiles = counters["stats"]["unique_graphs"] - graphs_after_first
    torch._dynamo.reset()
    return {"kernels": kernels, "graph_breaks": breaks, "recompiles": recompiles}


def _eager_figures(model: nn.Module, loss: Callable[[nn.Module, int], torch.Tensor],
                   steps: int) -> dict[str, Any]:  # fmt: skip
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    figures: dict[str, Any] = {}
    losses = []
    values: list[torch.Tensor] = []

    def forward_backward(step: int) -> None:
        values.append(loss(model, step))
        values[-1].backward()

    for step in range(steps):
        if step == 0:
            forward_backward(0)
            figures["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None}  # fmt: skip
            opt.step()
            opt.zero_grad()
            losses.append(float(values[-1].detach()))
            continue
        # Counted after a first step (lazy state exists, as in training): the dispatched
        # ops of the second, the kernel calls of the third.
        if step == 1:
            figures["eager_ops"] = dispatched_ops(lambda: forward_backward(1))
        elif step == 2:
            figures["eager_calls"] = kernel_calls(lambda: forward_backward(2))
        else:
            forward_backward(step)
        opt.step()
        opt.zero_grad()
        losses.append(float(values[-1].detach()))
    with torch.no_grad():
        final = float(loss(model, steps))
    return {**figures, "loss": final, "first_loss": losses[0]}


def measure(model_name: str, library: str, recipe: str, steps: int, compiled: bool = True,
            reference: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:  # fmt: skip
    """One row: the figures of ``library``'s ``recipe`` on ``model_name``; ``reference``:
    the float32 model's first gradients, by name (without it, the row keeps its own as
    ``grads``)."""
    row: dict[str, Any] = {"model": model_name, "library": library, "recipe": recipe}
    model, loss = build_model(model_name)
    try:
        row["float8_layers"] = convert(model, library, recipe)
    except (ValueError, TypeError) as e:  # a recipe this mixprec does not have
        row["missing"] = str(e).splitlines()[0]
        return row
    start = time.perf_counter()
    row.update(_eager_figures(model, loss, steps))
    grads = row.pop("grads")
    if reference is not None:
        error = sum(float((grads[n].float() - g).square().sum()) for n, g in reference.items())
        row["grad_error"] = (error / sum(float(g.square().sum()) for g in reference.values())) ** 0.5
    else:
        row["grads"] = grads  # the float32 reference, taken off by run()
    if compiled:
        row.update(_compiled_figures(model, loss))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def run(models: list[str], recipes: list[str], steps: int, compiled: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Every row of the comparison, with the differences filled in."""
    rows = []
    for model_name in models:
        fp32 = measure(model_name, "float32", "float32", steps, compiled)
        reference = fp32.pop("grads")
        rows.append(fp32)
        log(_line(fp32))
        for recipe in recipes:
            libraries = ["mixprec"]
            if model_name == "gpt2":  # the like-for-like row: torchao's layers only
                libraries.append("mixprec-same-layers")
            if RECIPES[recipe] is not None:
                libraries.append("torchao")
            group = {}
            for library in libraries:
                row = measure(model_name, library, recipe, steps, compiled, reference)
                if "loss" in row:
                    row["vs_fp32"] = row["loss"] - fp32["loss"]
                for key in ("kernels", "eager_ops", "eager_calls"):
                    if key in row and key in fp32 and row["float8_layers"]:
                        extra = row[key] - fp32[key]
                        row[f"{key}_per_layer"] = round(extra / row["float8_layers"], 1)
                group[library] = row
            ours = group.get("mixprec-same-layers", group["mixprec"])
            if "loss" in group.get("torchao", {}) and "loss" in ours:
                ours["vs_torchao"] = ours["loss"] - group["torchao"]["loss"]
            for row in group.values():
                rows.append(row)
                log(_line(row))
    return {
        "environment": environment(),
        "config": {"models": models, "recipes": recipes, "steps": steps,
                   "steps_for_recompiles": STEPS_FOR_RECOMPILES},  # fmt: skip
        "rows": rows,
    }


def _line(row: dict[str, Any]) -> str:
    keys = ("float8_layers", "kernels", "kernels_per_layer", "graph_breaks", "recompiles",
            "eager_ops", "eager_calls", "grad_error", "loss", "seconds", "missing")  # fmt: skip
    shown = " ".join(f"{k}={row[k]}" for k in keys if k in row)
    return f"{row['model']:6} {row['recipe']:18} {row['library']:19} {shown}"


def _cell(row: dict[str, Any], key: str, fmt: str = "{}") -> str:
    return fmt.format(row[key]) if key in row else "-"


def _with_per_layer(row: dict[str, Any], key: str) -> str:
    per_layer = f" ({row[key + '_per_layer']})" if key + "_per_layer" in row else ""
    return f"{_cell(row, key)}{per_layer}"


def render(doc: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| model | recipe | library | float8 layers | kernels (per float8 layer) "
        "| graph breaks | recompiles | eager aten ops (per layer) "
        "| eager kernel calls (per layer) | first gradients vs float32 | loss | vs float32 "
        "| vs torchao |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        if "missing" in row:
            lines.append(f"| {row['model']} | {row['recipe']} | {row['library']} | "
                         f"not in this version: {row['missing']} ||||||||||")  # fmt: skip
            continue
        layers = str(row["float8_layers"])
        if row["model"] == "gpt2" and row["library"] != "float32":
            layers += " (Conv1D too)" if row["library"] == "mixprec" else " (no Conv1D)"

        lines.append(
            f"| {row['model']} | {row['recipe']} | {row['library']} | {layers} | "
            f"{_with_per_layer(row, 'kernels')} | {_cell(row, 'graph_breaks')} | "
            f"{_cell(row, 'recompiles')} | {_with_per_layer(row, 'eager_ops')} | "
            f"{_with_per_layer(row, 'eager_calls')} | {_cell(row, 'grad_error', '{:.4e}')} | "
            f"{row['loss']:.4f} | "
            f"{_cell(row, 'vs_fp32', '{:+.4f}')} | {_cell(row, 'vs_torchao', '{:+.4f}')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps before the loss")
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled figures")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, help="write the Markdown table here")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    recipes = [r for r in args.recipes.split(",") if r]
    for name, given, known in (("--models", models, MODELS), ("--recipes", recipes, RECIPES)):
        unknown = [v for v in given if v not in known]
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    doc = run(models, recipes, args.steps, compiled=not args.eager_only)
    table = render(doc)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(jsonable(doc), f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
