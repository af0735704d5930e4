"""The specialists' recipes beside mixprec's in the GPU benchmark: FlashOptim and torchao float8.

============================  =================================================================
recipe                        one training step
============================  =================================================================
``flashoptim``                FlashOptim's own recipe: ``cast_model(model, torch.bfloat16)``,
                              ``FlashAdamW`` with its default 24-bit master weights (bfloat16
                              weights, 8-bit error-correction bits, 8-bit moments); the batch
                              cast to bfloat16, a float32 loss, plain backward and step
``flashoptim32``              the same with ``master_weight_bits=32`` (16-bit correction bits:
                              float32 weights' precision, as mixprec's lean level keeps)
``torchao-fp8-tensorwise``    float32 weights, ``convert_to_float8_training`` with torchao's
                              ``"tensorwise"`` recipe, the step under ``torch.autocast``
                              bfloat16 (torchao's single-GPU recipe), fused AdamW
``torchao-fp8-rowwise``       the same with the ``"rowwise"`` recipe
============================  =================================================================

torchao converts the same layers mixprec's ``fp8=True`` converts (``nn.Linear`` with in
and out features multiples of 16, not the output projection that ``nn.MultiheadAttention``
reads by weight), so the float8 rows compare kernels, not coverage. Every recipe starts
from the same float32 weights as :func:`benchmarks.recipes.build_recipe`'s, uses the
same learning rate and weight decay (AdamW's defaults: 1e-3, 0.01), and returns the same
:class:`~benchmarks.recipes.Recipe`. The libraries are imported when a recipe is built:
a machine without them gets an ``ImportError`` naming the package, and the benchmark
records that row as failed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from benchmarks.recipes import Recipe, _logits, _plain_step, make_optimizer

__all__ = ["PEER_RECIPES", "build_peer", "float8_layer_filter"]

PEER_RECIPES: tuple[str, ...] = (
    "flashoptim",
    "flashoptim32",
    "torchao-fp8-tensorwise",
    "torchao-fp8-rowwise",
)


def float8_layer_filter(module: nn.Module, name: str) -> bool:
    """The layers mixprec's ``fp8=True`` converts, as a torchao ``module_filter_fn``.

    >>> float8_layer_filter(nn.Linear(32, 64), "0"), float8_layer_filter(nn.Linear(32, 10), "2")
    (True, False)
    >>> float8_layer_filter(nn.MultiheadAttention(32, 2).out_proj, "attn.out_proj")
    False
    """
    if not isinstance(module, nn.Linear) or name.endswith("out_proj"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def build_peer(
    name: str,
    model_factory: Callable[[], nn.Module],
    device: str,
    lr: float = 1e-3,
    seed: int = 0,
    compile_model: bool = False,
) -> Recipe:
    """Build peer recipe ``name`` (:data:`PEER_RECIPES`) on ``device``, seeded like mixprec's."""
    if name not in PEER_RECIPES:
        raise ValueError(f"unknown peer recipe {name!r}; choose one of {', '.join(PEER_RECIPES)}")
    torch.manual_seed(seed)
    model = model_factory().to(device)
    model.train()
    device_type = torch.device(device).type
    if name.startswith("flashoptim"):
        from flashoptim import FlashAdamW, cast_model

        cast_model(model, dtype=torch.bfloat16)
        # FlashOptim's recipe feeds the bfloat16 model a bfloat16 batch.
        model.register_forward_pre_hook(lambda _, args: tuple(a.to(torch.bfloat16) for a in args))
        bits = 32 if name == "flashoptim32" else 24
        opt: torch.optim.Optimizer = FlashAdamW(model.parameters(), lr=lr, master_weight_bits=bits)
        autocast_dtype = None
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(name.rsplit("-", 1)[1])
        convert_to_float8_training(model, module_filter_fn=float8_layer_filter, config=config)
        opt = make_optimizer(model.parameters(), device, lr)
        autocast_dtype = torch.bfloat16
    runner = torch.compile(model) if compile_model else model
    step = _plain_step(runner, opt, device_type, autocast_dtype, None)
    return Recipe(name, torch.bfloat16, model, opt, step, _logits(runner, device_type, autocast_dtype))
