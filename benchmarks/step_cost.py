"""Step cost: aten ops, estimated CUDA kernel launches and bytes moved per training step.

::

    python -m benchmarks step_cost                        # counts on a small transformer (CPU)
    python -m benchmarks step_cost --gpu-shapes           # the GPU benchmark's 151M transformer
    python -m benchmarks step_cost --markdown BENCHMARKS.md --out results/step_cost.json

Every recipe (torch's autocast with fused AdamW as the anchor, the amp levels, the
master-weight modes, lean, rewrite, the GradScaler drop-in; float16 variants beside
the bfloat16 ones) takes steady-state steps on the same model; one step, after the
warm-up steps, runs under a ``TorchDispatchMode`` that sees every aten op, split into
three phases: forward (model and loss), backward (``backward()`` of the loss, scaled
or not) and optimizer (``step()``, the scaler's ``update()``, ``zero_grad()``).

**The launch model** (:func:`op_cost`; every tensor is priced as if it lived on one GPU):

- views and metadata ops (``view``, ``t``, ``detach``, ``split``, ``as_strided``,
  ``empty*``, ``set_``, ``_unsafe_view``, ...) and ops over zero elements: 0 launches;
- a plain op: 1 launch (``cat``: one per 128 inputs, CUDA's ``CAT_ARRAY_BATCH_SIZE``,
  when all inputs share the output's dtype and are contiguous, else one per input;
  ``split_with_sizes_copy.out``: 1 when every operand is contiguous in one dtype, CUDA's
  fast path, else one per output);
- a ``_foreach_*`` op or a fused optimizer (``_fused_adamw_``, ...): the launches of
  CUDA's ``multi_tensor_apply`` loop, emulated exactly by :func:`mta_launches`: tensors
  are cut into chunks of 65,536 elements (``kChunkSize``), one thread block per chunk,
  and a kernel is launched whenever 320 blocks are queued (``depth_to_max_blocks``) or
  the tensors queued reach ``depth_to_max_tensors[depth - 1]`` = 110, 64, 48, 36, 30
  for depth 1-5 (96, 64, 48, 36, 30 with a scalar list), where the depth is the number
  of tensor lists the kernel walks (inputs, plus the output list of an out-of-place op;
  a fused optimizer's step counters excluded). These are the limits of CUDA builds
  before 13.0 (4 KB of kernel arguments); CUDA 13 builds (``--cuda13``) queue up to
  2240 blocks and 770, 448, 336, 252, 210 tensors. ``_foreach_norm`` and
  ``_foreach_max`` add one clean-up launch. A foreach op that misses CUDA's fast path
  (devices, dtypes, layouts or strides that differ across its lists; ``_foreach_copy_``
  may change dtype) runs one kernel per tensor;
- ``_local_scalar_dense`` (``.item()``): 1 (a device-to-host copy that also syncs).
- the compiled master-weight steps (``"lean fused"``, ``"O2 fused"`` and ``"split8 fused"`` rows:
  :func:`mixprec.kernels.compiled.lean_adamw_fused_`, the default with
  ``AdamW(fused=True)`` on a GPU) are priced as the kernels inductor generates for
  them (:func:`fused_lean_cost`): one loop per
  parameter, read and written once, put side by side in launches of up to
  :data:`COMBO_NODES` loops (the ``combo_kernel_max_num_nodes`` it asks inductor
  for). Its eager reference runs for the count, unpriced (and its temporaries are not
  in the peak): under a ``TorchDispatchMode`` the step runs its eager math, as
  ``torch.compile`` itself would.

**Bytes moved** by an op: the storage bytes of its tensor inputs (read) plus its tensor
outputs (written; an in-place op's ``self`` counts both ways, foreach and fused
optimizers' lists included, as the op's schema marks them written, except for ops that
only write it: ``copy_``, ``fill_``, ``zero_``, random fills, ``_foreach_copy_``; a
fused optimizer writes its gradients back only when it unscales them). A view whose
densest dimension steps over elements (the high int16 halves of float32 values) is
priced at the span it covers, up to a 32-byte sector per element. Matrix products and
convolutions (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``convolution*``, attention
kernels) are listed separately: their launches are in the launch count, their bytes
are not in "bytes moved".

**What the model cannot see**: fusion inside a kernel (a fused kernel that reads a
tensor once is priced like every op that touches it), the caching allocator (the
``empty*`` calls cost nothing here, and cudaMalloc never happens in steady state),
kernels that an op launches beyond one (reductions in two passes, cuBLAS workspace
set-up, softmax splits), launches CUDA would skip or add for a device choice the CPU
run does not make (autocast's cast lists and the attention and LSTM kernels follow the
CPU here), host-side work on CPU tensors in a GPU run (a non-capturable optimizer's
step counters), and caches: a bandwidth-bound op reading a tensor another op just
wrote may hit L2.

**Memory**: bytes per parameter at rest (live tensor storages after ``zero_grad``:
weights, buffers, optimizer state, masters, lean buffers) and at the optimizer-step
peak (the storages live when ``step()`` starts, gradients included, plus every
storage an op creates during the step, minus those freed, at its highest), both
after the batch's own bytes are taken out.

**Host time** per step (tiny tensors, so the time is Python and dispatch, not
arithmetic): every recipe stepped in one interleaved loop (:func:`benchmarks._common.
interleaved`), medians and quartiles of the per-round ratio to the anchor. The same
runs on real architectures (a Hugging Face GPT-2 from a config, a ResNet-style CNN
with BatchNorm, ``nn.TransformerEncoder`` in mixprec's ``TransformerClassifier``, an
LSTM language model) as CPU wall-clock ratios.

Counting is deterministic: the same op sequence and prices on any CPU. ``--small``
(the default) counts on a 2-layer ``TransformerClassifier`` in seconds; ``--gpu-shapes``
counts on the GPU benchmark's model (d_model 1024, 12 layers, 151 parameter tensors,
152M parameters) at ``--batch`` 1 (the optimizer phase depends on the parameter
shapes only; forward and backward bytes grow with the batch), which takes minutes on a
CPU. Counting runs real CPU arithmetic, not the meta device, since the recipes read
values on the host (the loss scale's skip decisions).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._common import (
    Case,
    environment,
    interleaved,
    jsonable,
    paired_quartiles,
    paired_ratio,
)
from benchmarks.recipes import build_recipe, make_optimizer
from mixprec.kernels import adamw
from mixprec.kernels import compiled as compiled_steps
from mixprec.kernels.compiled import register_watch_hook
from mixprec.optim._flat_params import is_dense
from mixprec.optim.masters import LeanUpdates, MasterWeights
from mixprec.tools._memory import live_plain_tensors, live_tensor_bytes

__all__ = [
    "MTA_CHUNK",
    "OpCost",
    "StepCounter",
    "VARIANTS",
    "Variant",
    "count_step",
    "main",
    "mta_launches",
    "op_cost",
]

# ----------------------------------------------------------------------------- launch model

#: Elements per thread block in CUDA's ``multi_tensor_apply`` (``kChunkSize``).
MTA_CHUNK = 65536
#: (blocks per launch, tensors per launch by depth 1-5, the same with a scalar list).
MTA_LIMITS = {
    "cuda12": (320, (110, 64, 48, 36, 30), (96, 64, 48, 36, 30)),
    "cuda13": (2240, (770, 448, 336, 252, 210), (672, 448, 336, 252, 210)),
}
#: Inputs per launch of CUDA's batched ``cat`` kernel.
CAT_BATCH = 128

_ZERO_COST = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
    "set_", "lift_fresh", "resize_", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_same_size", "_has_same_storage_numel", "record_stream",
}  # fmt: skip
_MATMUL = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "_scaled_mm",
    "convolution", "convolution_backward", "_convolution", "mkldnn_convolution",
    "cudnn_convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_flash_attention_forward",
    "_flash_attention_backward", "_efficient_attention_forward", "_efficient_attention_backward",
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "_cudnn_rnn", "_cudnn_rnn_backward",
}  # fmt: skip
#: In-place ops that write ``self`` without reading it.
_WRITE_ONLY_SELF = {
    "copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "_foreach_copy_", "_foreach_zero_",
}  # fmt: skip
_CLEANUP_LAUNCH = {"_foreach_norm", "_foreach_max"}


def mta_launches(
    numels: Sequence[int], depth: int, limits: str = "cuda12", scalar_list: bool = False
) -> int:
    """Kernel launches of CUDA's ``multi_tensor_apply`` over tensors of ``numels`` elements.

    Walks the tensors and their 65,536-element chunks as the CUDA loop does, launching
    when the queued blocks or the queued tensors reach the limits for ``depth``.

    >>> mta_launches([10] * 110, depth=1), mta_launches([10] * 111, depth=1)
    (1, 2)
    >>> mta_launches([320 * MTA_CHUNK + 1], depth=2)  # 321 chunks: one launch is full
    2
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}; count the tensor lists walked")
    max_blocks, tensors_by_depth, scalar_tensors = MTA_LIMITS[limits]
    max_tensors = (scalar_tensors if scalar_list else tensors_by_depth)[min(depth, 5) - 1]
    launches = blocks = tensors = 0
    for numel in numels:
        if numel == 0:
            continue
        tensors += 1
        chunks = -(-numel // MTA_CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if (tensors == max_tensors and last) or blocks == max_blocks:
                launches += 1
                blocks = 0
                tensors = 0 if last else 1  # an unfinished tensor carries on
    return launches + (1 if blocks else 0)


@dataclasses.dataclass
class OpCost:
    """One op's estimated price: kernel launches, bytes moved, and whether it is a matmul."""

    launches: int
    nbytes: int
    matmul: bool = False


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel moves for ``t``: its elements' bytes, or, where even its densest
    dimension steps over elements (every other int16 of a tensor), the span it covers,
    up to a 32-byte memory sector per element: a GPU reads and writes whole sectors.

    >>> _nbytes(torch.ones(8, dtype=torch.int16)), _nbytes(torch.ones(8, dtype=torch.int16)[::2])
    (16, 16)
    """
    step = min((abs(s) for s, n in zip(t.stride(), t.shape) if n > 1), default=1)
    return t.numel() * t.element_size() * max(1, min(step, 32 // t.element_size()))


def _tensor_lists(args: Sequence[Any], kwargs: dict[str, Any]) -> list[list[torch.Tensor]]:
    found = []
    for value in (*args, *kwargs.values()):
        if (
            isinstance(value, list | tuple)
            and value
            and all(isinstance(v, torch.Tensor) for v in value)
        ):
            found.append(list(value))
    return found


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return all(s == 1 or x == y for s, x, y in zip(a.shape, a.stride(), b.stride()))


def _foreach_launches(name: str, lists: list[list[torch.Tensor]], out: Any, limits: str,
                      scalar_list: bool) -> int:  # fmt: skip
    first = lists[0]
    numels = [t.numel() for t in first]
    walked = [lst for lst in lists if [t.numel() for t in lst] == numels]
    out_list = [t for t in _tensors(out)]
    if out_list and [t.numel() for t in out_list] == numels and not name.endswith("_"):
        walked.append(out_list)
    if name.startswith("_fused_"):  # no slow path: the optimizer groups by device and dtype
        return mta_launches(numels, len(walked), limits)
    device, dtype = first[0].device, first[0].dtype
    cross_dtype_ok = name == "_foreach_copy_"
    fast = all(
        t.device == device and is_dense(t) and t.dtype == lst[0].dtype
        and (cross_dtype_ok or t.dtype == dtype)
        for lst in walked for t in lst
    ) and all(_same_strides(a, b) for lst in walked[1:] for a, b in zip(first, lst))  # fmt: skip
    if not fast:
        return sum(1 for n in numels if n)
    launches = mta_launches(numels, len(walked), limits, scalar_list)
    return launches + (1 if name in _CLEANUP_LAUNCH and launches else 0)


def _written_in_place(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op's schema marks as written (``Tensor(a!)``), out= arguments
    aside: in-place foreach and fused-optimizer ops return none of them. A fused
    optimizer writes its gradients back only when it unscales them (``grad_scale``)."""
    fused = func.overloadpacket.__name__.startswith("_fused_")
    written: list[torch.Tensor] = []
    for index, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write or arg.name.startswith("out"):
            continue
        if fused and arg.name == "grads" and kwargs.get("grad_scale") is None:
            continue
        value = args[index] if not arg.kwarg_only and index < len(args) else kwargs.get(arg.name)
        written += _tensors(value)
    return written


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats of the same memory (an in-place op returns ``self``)."""
    seen, kept = set(), []
    for t in tensors:
        pointer = t.untyped_storage().data_ptr()  # 0 on the meta device: tell them apart
        key = (pointer, t.storage_offset(), tuple(t.shape), t.dtype) if pointer else id(t)
        if key not in seen:
            seen.add(key)
            kept.append(t)
    return kept


def op_cost(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
            limits: str = "cuda12") -> OpCost:  # fmt: skip
    """Price one aten op (see the module docstring for the model).

    >>> aten = torch.ops.aten
    >>> x = torch.ones(4, 4)
    >>> op_cost(aten.view.default, (x, [16]), {}, x.view(16)).launches
    0
    >>> cost = op_cost(aten.add.Tensor, (x, x), {}, x + x)
    >>> cost.launches, cost.nbytes  # reads 2 x 64 bytes, writes 64
    (1, 192)
    >>> xs = [torch.ones(3) for _ in range(200)]
    >>> cost = op_cost(aten._foreach_mul_.Scalar, (xs, 2.0), {}, None)  # 110 per launch
    >>> cost.launches, cost.nbytes  # each tensor read and written: 200 x 12 bytes twice
    (2, 4800)
    """
    name = func.overloadpacket.__name__
    schema_name = func._schema.name.split("::")[-1]
    if getattr(func, "is_view", False) or name in _ZERO_COST or schema_name in _ZERO_COST:
        return OpCost(0, 0)
    out_tensors = list(_tensors(out))
    outs_kw = {k for k in kwargs if k == "out" or k.startswith("out")}
    reads = [t for t in _tensors([v for k, v in kwargs.items() if k not in outs_kw])]
    positional = list(args)
    if name in _WRITE_ONLY_SELF and positional and list(_tensors(positional[0])):
        positional = positional[1:]  # a tensor, or a foreach op's list
    reads = list(_tensors(positional)) + reads
    if outs_kw:
        out_tensors = list(_tensors([kwargs[k] for k in outs_kw]))
    out_tensors = _unique([*out_tensors, *_written_in_place(func, args, kwargs)])
    nbytes = sum(map(_nbytes, reads)) + sum(map(_nbytes, out_tensors))
    if all(t.numel() == 0 for t in (*reads, *out_tensors)) and name != "_local_scalar_dense":
        return OpCost(0, 0)
    if (
        name.startswith("_foreach_")
        or name.startswith("_fused_")
        or name.startswith("_amp_foreach")
    ):
        lists = _tensor_lists(args, kwargs)
        if not lists or not lists[0]:
            return OpCost(0, 0)
        scalar_list = "ScalarList" in str(func._overloadname)
        return OpCost(_foreach_launches(name, lists, out, limits, scalar_list), nbytes)
    if name == "cat":
        inputs = [t for t in _tensors(args[0]) if t.numel()]
        result = out_tensors[0] if out_tensors else None
        batched = result is not None and all(
            t.dtype == result.dtype and t.is_contiguous() for t in inputs
        )
        return OpCost(-(-len(inputs) // CAT_BATCH) if batched else len(inputs), nbytes)
    if name == "split_with_sizes_copy" and outs_kw:
        source = args[0]
        fast = source.is_contiguous() and all(
            t.is_contiguous() and t.dtype == source.dtype for t in out_tensors
        )
        return OpCost(1 if fast else sum(1 for t in out_tensors if t.numel()), nbytes)
    return OpCost(1, nbytes, matmul=name in _MATMUL)


# ----------------------------------------------------------------------------- the counter

PHASES = ("forward", "backward", "optimizer")


@dataclasses.dataclass
class PhaseTally:
    """What one phase of a step dispatched and what it is estimated to cost."""

    ops: int = 0
    launches: int = 0
    nbytes: int = 0
    matmul_ops: int = 0
    matmul_launches: int = 0
    matmul_nbytes: int = 0
    by_op: Counter[str] = dataclasses.field(default_factory=Counter)  # launches per op name

    def add(self, name: str, cost: OpCost) -> None:
        self.ops += 1
        self.launches += cost.launches
        if cost.matmul:
            self.matmul_ops += 1
            self.matmul_launches += cost.launches
            self.matmul_nbytes += cost.nbytes
        else:
            self.nbytes += cost.nbytes
        if cost.launches:
            self.by_op[name] += cost.launches


class _LiveStorages:
    """Bytes of live tensor storages, followed op by op: a running total and its peak."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._finalizers: list[weakref.finalize] = []

    def start(self, extra: Sequence[torch.Tensor] = ()) -> None:
        for t in (*live_plain_tensors(), *extra):
            self.see(t)
        self.peak = self.current


    def see(self, t: torch.Tensor) -> None:
        if type(t) not in (torch.Tensor, nn.Parameter) or t.is_meta:
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if not size or key in self._live:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        # Storages keep their Python object while alive, so this fires when the memory goes.
        self._finalizers.append(weakref.finalize(storage, self._freed, key))

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def stop(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._live.clear()


class StepCounter(TorchDispatchMode):
    """Tallies every aten op by phase (``counter.phase = "forward"``, ...).

    >>> with StepCounter() as counter:
    ...     counter.phase = "forward"
    ...     y = torch.ones(3) * 2
    >>> counter.tallies["forward"].launches
    2
    """

    def __init__(self, limits: str = "cuda12") -> None:
        super().__init__()
        self.limits = limits
        self.phase = "forward"
        self.tallies = {p: PhaseTally() for p in PHASES}
        self.memory: _LiveStorages | None = None
        self.priced_apart = False  # inside a compiled region, priced as a whole

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.priced_apart:
            return out
        cost = op_cost(func, args, kwargs, out, self.limits)
        self.tallies[self.phase].add(func.overloadpacket.__name__, cost)
        if self.memory is not None:
            # What an op writes in place is live too: a storage may have grown without
            # an op (O2's kept master-gradient buffer, regrown with ``resize_``).
            for t in (*_tensors(out), *_written_in_place(func, args, kwargs)):
                self.memory.see(t)
        return out


#: Loops per launch of the compiled lean step's combo kernels, as it asks inductor.
COMBO_NODES = compiled_steps.COMBO_NODES


def fused_lean_cost(args: Sequence[Any]) -> OpCost:
    """The price of one call of the compiled lean step's elementwise math
    (:func:`mixprec.kernels.adamw.masters_adamw_math_`, positional ``args``): every
    tensor it is given read once, the weights, compensations or corrections and
    moments written once, in one loop per parameter and :data:`COMBO_NODES` loops per
    launch. Float32 masters' model weights (their extras) are written only;
    stochastic rounding's seed (its extras) is read only; 8 low bits with 8-bit
    moments have extras
    are (correction, seed) pairs and its moments (codes, block scales) pairs. A
    ``found_inf`` of ``None`` (the step checks the gradients itself) reads every
    gradient once more, in a reduction per parameter before the loops, grouped as they
    are, plus one launch that combines the maxima and writes the verdict.

    >>> w = [torch.ones(4, dtype=torch.bfloat16)]
    >>> cost = fused_lean_cost((adamw.COMPENSATED, w, w, w, w, w, [torch.zeros(())], [torch.ones(1)],
    ...                         [torch.ones(4, dtype=torch.float64)], torch.zeros(())))
    >>> cost.launches, cost.nbytes  # 8 + 4 + 4 + 32 + 4 bytes read, 8 written: w repeats
    (1, 60)
    """
    weights, extras, _, exp_avgs, exp_avg_sqs = args[1:6]
    write_only = {id(e) for e in extras if e is not None} if args[0] == adamw.FLOAT32_MASTERS else set()
    read = [t for t in _unique(list(_tensors(list(args[1:10])))) if id(t) not in write_only]
    stepped: list[Any] = [c for c in extras if c is not None]
    if args[0] == adamw.STOCHASTIC_ROUNDING:
        stepped = []
    elif args[0] == adamw.LOW_BITS8_MOMENTS8:
        stepped = [correction for correction, _ in extras]
    written = _unique(list(_tensors([weights, stepped, exp_avgs, exp_avg_sqs])))
    launches = -(-len(weights) // COMBO_NODES)
    nbytes = sum(map(_nbytes, read)) + sum(map(_nbytes, written))
    if args[9] is None:  # the finite check: the gradients read again, the verdict written
        launches += launches + 1
        nbytes += sum(map(_nbytes, args[3])) + 4
    return OpCost(launches, nbytes)


# ----------------------------------------------------------------------------- the recipes


@dataclasses.dataclass(frozen=True)
class Variant:
    """One recipe in one dtype: torch's autocast (``level=None``) or a mixprec level."""

    label: str
    dtype: torch.dtype
    level: str | None = None  # "O1", "O2", "O3", "lean", "rewrite"; None: torch.autocast
    scaler: str | None = None  # with autocast: "torch" or "mixprec" GradScaler
    master_weights: str | None = None
    adamw8bit: bool = False  # mixprec.optim.AdamW8bit instead of torch's fused AdamW
    fused: bool = False  # kahan, split8: the compiled step, as on a GPU with AdamW(fused=True)

    @property
    def anchor(self) -> str:
        """The label of the row this one is compared with."""
        return "autocast bf16" if self.dtype == torch.bfloat16 else "autocast+GradScaler fp16"


_BF16, _FP16 = torch.bfloat16, torch.float16
VARIANTS: tuple[Variant, ...] = (
    Variant("autocast bf16", _BF16),
    Variant("autocast+mixprec.GradScaler bf16", _BF16, scaler="mixprec"),
    Variant("O1 bf16", _BF16, "O1"),
    Variant("O2 bf16", _BF16, "O2"),
    Variant("O2 fused bf16", _BF16, "O2", fused=True),
    Variant("O2 split bf16", _BF16, "O2", master_weights="split"),
    Variant("O3 bf16", _BF16, "O3"),
    Variant("lean bf16", _BF16, "lean"),
    Variant("lean fused bf16", _BF16, "lean", fused=True),
    Variant("lean stochastic bf16", _BF16, "lean", master_weights="stochastic"),
    Variant("lean stochastic fused bf16", _BF16, "lean", master_weights="stochastic",
            fused=True),
    Variant("O2 split8 bf16", _BF16, "O2", master_weights="split8"),
    Variant("O2 split8 fused bf16", _BF16, "O2", master_weights="split8", fused=True),
    Variant("O2 split8+AdamW8bit bf16", _BF16, "O2", master_weights="split8", adamw8bit=True),
    Variant("O2 split8+AdamW8bit fused bf16", _BF16, "O2", master_weights="split8",
            adamw8bit=True, fused=True),
    Variant("rewrite bf16", _BF16, "rewrite"),
    Variant("autocast+GradScaler fp16", _FP16, scaler="torch"),
    Variant("autocast+mixprec.GradScaler fp16", _FP16, scaler="mixprec"),
    Variant("O1 fp16", _FP16, "O1"),
    Variant("O2 fp16", _FP16, "O2"),
    Variant("O3 fp16", _FP16, "O3"),
    Variant("lean fp16", _FP16, "lean"),
    Variant("lean fused fp16", _FP16, "lean", fused=True),
    Variant("rewrite fp16", _FP16, "rewrite"),
)


@dataclasses.dataclass
class Prepared:
    """A recipe's model and optimizer, and its step split into phases."""

    variant: Variant
    model: nn.Module
    optimizer: Any
    scaler: Any = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        v = self.variant
        with torch.autocast(x.device.type, dtype=v.dtype, enabled=v.level is None):
            out = self.model(x)
        return F.cross_entropy(out.float(), y)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        elif self.variant.level is not None:
            loss = self.optimizer.scale_loss(loss)
        loss.backward()

    def step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.backward(self.forward(x, y))
        self.step()

    def inner_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "inner_optimizer", self.optimizer)


def prepare(variant: Variant, factory: Callable[[], nn.Module], example_x: torch.Tensor,
            seed: int = 0) -> Prepared:  # fmt: skip
    """Build ``variant`` on ``example_x``'s device from ``factory()`` (seeded), AdamW(fused=True)."""
    device = str(example_x.device)
    if variant.level == "rewrite":
        r = build_recipe("rewrite", factory, example_x, device, variant.dtype, seed=seed)
        return Prepared(variant, r.model, r.optimizer)
    torch.manual_seed(seed)
    model = factory().to(device)
    model.train()
    if variant.adamw8bit:
        from mixprec.optim import AdamW8bit

        inner: torch.optim.Optimizer = AdamW8bit(model.parameters(), lr=1e-3)
    else:
        inner = make_optimizer(model.parameters(), device)
    if variant.level is None:
        scaler: Any = None
        if variant.scaler == "torch":
            scaler = torch.amp.GradScaler(example_x.device.type)
        elif variant.scaler == "mixprec":
            from mixprec import GradScaler

            scaler = GradScaler(example_x.device.type)
        return Prepared(variant, model, inner, scaler)
    from mixprec import amp

    if variant.level in ("O3", "lean") and variant.dtype == torch.float16:
        for group in inner.param_groups:
            group["eps"] = 1e-4  # float16 moments: eps=1e-8 underflows (see recipes.py)
    kwargs: dict[str, Any] = {}
    if variant.master_weights is not None:
        kwargs["master_weights"] = variant.master_weights
    model, opt = amp.initialize(model, inner, level=variant.level, dtype=variant.dtype, **kwargs)
    if variant.fused:  # the GPU's default for a fused AdamW, asked for on any device
        assert isinstance(opt._master, LeanUpdates | MasterWeights)
        opt._master.fused = True
    return Prepared(variant, model, opt)


# ----------------------------------------------------------------------------- the models


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model factory and one fixed batch."""

    name: str
    factory: Callable[[], nn.Module]
    x: torch.Tensor
    y: torch.Tensor


def transformer_workload(gpu_shapes: bool, batch: int) -> Workload:
    """The GPU benchmark's transformer (``gpu_shapes``) or a small one of the same design."""
    from mixprec.train.models import TransformerClassifier

    if gpu_shapes:
        dims = dict(seq_len=1024, token_dim=64, d_model=1024, nhead=16, num_layers=12,
                    dim_feedforward=4096)  # fmt: skip
    else:
        dims = dict(seq_len=16, token_dim=8, d_model=64, nhead=4, num_layers=2,
                    dim_feedforward=128)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, dims["seq_len"], dims["token_dim"], generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    name = "transformer (GPU shapes)" if gpu_shapes else "transformer (small)"
    return Workload(name, lambda: TransformerClassifier(num_classes=10, dropout=0.0, **dims), x, y)


class _FlatLogits(nn.Module):
    """A language model's (batch, length, vocabulary) logits as (batch * length, vocabulary)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.inner(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return logits.flatten(0, 1)


def architecture_workloads() -> list[Workload]:
    """Small real architectures from ``tests/real_models.py`` (no downloads)."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import real_models

    from mixprec.train.models import TransformerClassifier

    ids, targets = real_models.char_batches(batch=4, length=32, steps=1)[0]
    images, labels = real_models.images(batch=8, size=16)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(8, 16, 8, generator=g)
    classes = torch.randint(0, 10, (8,), generator=g)
    return [
        Workload(
            "GPT-2 (HF, 2 layers, width 64)",
            lambda: _FlatLogits(real_models.gpt2(layers=2, width=64, heads=2, context=64)),
            ids,
            targets.flatten(),
        ),  # fmt: skip
        Workload("ResNet-style CNN with BatchNorm", lambda: real_models.resnet(), images, labels),
        Workload(
            "nn.TransformerEncoder (2 layers, d 64)",
            lambda: TransformerClassifier(
                num_classes=10,
                seq_len=16,
                token_dim=8,
                d_model=64,
                nhead=4,
                num_layers=2,
                dim_feedforward=128,
                dropout=0.0,
            ),
            tokens,
            classes,
        ),  # fmt: skip
        Workload(
            "LSTM language model", lambda: _FlatLogits(real_models.lstm()), ids, targets.flatten()
        ),  # fmt: skip
    ]


# ----------------------------------------------------------------------------- measuring


class _Watched(TorchDispatchMode):
    """Runs every op as it is: the warm-up steps run under it, as the counted step runs
    under :class:`StepCounter`, so they step as the counted one does."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:  # fmt: skip
        return func(*args, **(kwargs or {}))


def count_step(prepared: Prepared, x: torch.Tensor, y: torch.Tensor, warmup: int = 2,
               limits: str = "cuda12", baseline: int = 0) -> dict[str, Any]:  # fmt: skip
    """Take ``warmup`` steps, then count one; return the phase tallies and bytes/param.

    Every step runs under a ``TorchDispatchMode`` (the warm-up steps under one that
    only runs the ops, the counted one under :class:`StepCounter`), so the CPU takes
    the ways a GPU takes to the same bits (the finite check, rounding noise, the fused
    steps' check and step counts: :func:`mixprec.numerics.cpu_shortcuts`), and the
    compiled master-weight steps run their eager math: counting needs the ops, not
    the speed, and nothing compiles."""
    with _Watched():
        for _ in range(warmup):
            prepared.train_step(x, y)
    n_params = sum(p.numel() for p in prepared.model.parameters())
    counter = StepCounter(limits)
    with counter:
        counter.phase = "forward"
        loss = prepared.forward(x, y)
        counter.phase = "backward"
        prepared.backward(loss)
        counter.phase = "optimizer"
        grads = [p.grad for p in prepared.model.parameters() if p.grad is not None]
        grads += [
            p.grad for g in prepared.inner_optimizer().param_groups for p in g["params"]
            if p.grad is not None
        ]  # fmt: skip
        counter.memory = _LiveStorages()
        counter.memory.start(grads)
        del grads
        with _priced_as_compiled(counter):
            prepared.step()
        peak = counter.memory.peak
        counter.memory.stop()
        counter.memory = None
    del loss
    at_rest = live_tensor_bytes() - baseline
    phases = {}
    for phase, tally in counter.tallies.items():
        phases[phase] = {
            "ops": tally.ops,
            "launches": tally.launches,
            "bytes": tally.nbytes,
            "matmul_ops": tally.matmul_ops,
            "matmul_launches": tally.matmul_launches,
            "matmul_bytes": tally.matmul_nbytes,
            "top_launches": tally.by_op.most_common(8),
        }
    total = {k: sum(p[k] for p in phases.values()) for k in ("ops", "launches", "bytes",
             "matmul_ops", "matmul_launches", "matmul_bytes")}  # fmt: skip
    return {
        "phases": phases,
        "total": total,
        "params": n_params,
        "bytes_per_param_at_rest": at_rest / n_params,
        "bytes_per_param_step_peak": (peak - baseline) / n_params,
    }


@contextlib.contextmanager
def _priced_as_compiled(counter: StepCounter) -> Iterator[None]:
    """Price each call of the compiled lean step's math as :func:`fused_lean_cost`, through
    the library's hook around the watched step bodies (:func:`register_watch_hook`)."""

    @contextlib.contextmanager
    def priced(mode: str, args: tuple) -> Iterator[None]:
        counter.priced_apart = True
        try:
            yield
        finally:
            counter.priced_apart = False
        counter.tallies[counter.phase].add(f"{mode}_adamw (compiled)", fused_lean_cost((mode, *args)))

    handle = register_watch_hook(priced)
    try:
        yield
    finally:
        handle.remove()


def count_all(workload: Workload, variants: Sequence[Variant], warmup: int, limits: str,
              log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Count every variant, one at a time (each freed before the next is built)."""
    rows: dict[str, Any] = {}
    for v in variants:
        start = time.perf_counter()
        baseline = live_tensor_bytes()  # (it collects garbage first)
        try:
            prepared = prepare(v, workload.factory, workload.x)
            rows[v.label] = count_step(prepared, workload.x, workload.y, warmup, limits, baseline)
        except Exception as err:  # a recipe that cannot run is a row, not a crash
            rows[v.label] = {"error": f"{type(err).__name__}: {err}"}
        prepared = None  # noqa: F841  (freed before the next recipe's baseline)
        log(f"  counted {v.label} in {time.perf_counter() - start:.1f} s")
    return rows


def _quartiles(samples: Sequence[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 4], s[(3 * len(s)) // 4]


def time_all(workload: Workload, variants: Sequence[Variant], warmup: int, repeats: int,
             log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Host time per step of every variant, interleaved; ratios to each row's anchor."""
    cases, errors = [], {}
    for v in variants:
        try:
            p = prepare(v, workload.factory, workload.x)
            p.train_step(workload.x, workload.y)  # fails here, not inside the timed loop
        except Exception as err:
            errors[v.label] = f"{type(err).__name__}: {err}"
            continue
        cases.append(Case(v.label, (lambda p=p: p.train_step(workload.x, workload.y))))
    start = time.perf_counter()
    times = interleaved(cases, warmup, repeats) if cases else {}
    log(f"  timed {workload.name}: {len(cases)} recipes in {time.perf_counter() - start:.1f} s")
    rows: dict[str, Any] = {label: {"error": e} for label, e in errors.items()}
    for v in variants:
        if v.label not in times:
            continue
        samples = times[v.label]
        row: dict[str, Any] = {
            "median_ms": 1e3 * statistics.median(samples),
            "quartiles_ms": [1e3 * q for q in _quartiles(samples)],
            "n": len(samples),
        }
        if v.anchor in times:
            row["ratio"] = paired_ratio(samples, times[v.anchor])
            row["ratio_quartiles"] = list(paired_quartiles(samples, times[v.anchor]))
        rows[v.label] = row
    return rows


# ----------------------------------------------------------------------------- the report

SECTION_TITLE = "## 11. Step cost: ops, launches and bytes per step, by phase"


def _unit(rows: dict[str, Any]) -> tuple[str, float]:
    """GB for a table whose largest step moves a gigabyte or more, else MB."""
    biggest = max((r["total"]["bytes"] for r in rows.values() if "error" not in r), default=0)
    return ("GB", 1e9) if biggest >= 1e9 else ("MB", 1e6)


def _ratio(value: float, anchor: float) -> str:
    return f"{value / anchor:.2f}" if anchor else "n/a"


def render(doc: dict[str, Any]) -> str:
    """The Markdown section for BENCHMARKS.md."""
    env = doc["environment"]
    lines = [
        SECTION_TITLE,
        "",
        f"Produced by `{doc['command']}` at commit `{env.get('git_commit')}` "
        f"(torch {env['torch']}, {doc['started']}, {doc['duration_s']:.0f} s). "
        "The launch and bytes model is in `benchmarks/step_cost.py`'s docstring: views 0, "
        "a plain op 1, foreach and fused-optimizer ops as CUDA's `multi_tensor_apply` "
        f"launches them (65,536-element chunks, {doc['limits']} limits: "
        f"{'2240 blocks' if doc['limits'] == 'cuda13' else '320 blocks'} per launch, "
        "110/64/48/36/30 tensors at depth 1-5); bytes = tensor inputs read + outputs "
        "written, matmuls apart. Every tensor is priced as if on one GPU; the op "
        "sequence is the CPU's (autocast's cast lists, attention and LSTM kernels). "
        "It cannot see fusion inside a kernel, the caching allocator, extra kernels "
        "inside one op, or cache hits.",
        "",
    ]
    for count in doc["counts"].values():
        anchor_rows = {r: v for r, v in count["rows"].items() if "error" not in v}
        lines += [f"### Counts: {count['workload']}, batch {count['batch']}", ""]
        unit, scale = _unit(count["rows"])
        header = ["recipe", "ops f/b/o", "launches f/b/o", "launches", "x anchor",
                  f"{unit} moved f/b/o", f"{unit} moved", "x anchor", f"matmuls ({unit})",
                  "B/param rest", "B/param step peak"]  # fmt: skip
        lines += ["| " + " | ".join(header) + " |",
                  "|" + "|".join(["---"] + ["--:"] * (len(header) - 1)) + "|"]  # fmt: skip
        for label, row in count["rows"].items():
            if "error" in row:
                lines.append(f"| {label} | failed: `{row['error'][:120]}` |" + " |" * 9)
                continue
            ph, tot = row["phases"], row["total"]
            anchor_row = anchor_rows.get(_anchor_of(label))
            anchor = anchor_row["total"] if anchor_row else {"launches": 0, "bytes": 0}
            lines.append(
                f"| {label} | "
                + "/".join(str(ph[p]["ops"]) for p in PHASES)
                + " | "
                + "/".join(str(ph[p]["launches"]) for p in PHASES)
                + f" | {tot['launches']} | {_ratio(tot['launches'], anchor['launches'])} | "
                + "/".join(f"{ph[p]['bytes'] / scale:.2f}" for p in PHASES)
                + f" | {tot['bytes'] / scale:.2f} | {_ratio(tot['bytes'], anchor['bytes'])} | "
                f"{tot['matmul_ops']} ({tot['matmul_bytes'] / scale:.2f}) | "
                f"{row['bytes_per_param_at_rest']:.2f} | {row['bytes_per_param_step_peak']:.2f} |"
            )
        lines.append("")
    if doc.get("timing"):
        t = doc["timing"]
        lines += [
            f"### Host time per step: CPU, interleaved ({t['repeats']} rounds, medians; "
            "ratio = median of per-round ratios to the anchor, [quartiles])",
            "",
        ]
        names = list(t["workloads"])
        lines += ["| recipe | " + " | ".join(names) + " |",
                  "|---|" + "|".join(["--:"] * len(names)) + "|"]  # fmt: skip
        labels: list[str] = []
        for rows in t["workloads"].values():
            labels += [label for label in rows if label not in labels]
        for label in labels:
            cells = []
            for name in names:
                row = t["workloads"][name].get(label)
                if row is None:
                    cells.append("")
                elif "error" in row:
                    cells.append(f"failed: `{row['error'][:60]}`")
                elif "ratio" in row:
                    q1, q3 = row["ratio_quartiles"]
                    cells.append(
                        f"{row['ratio']:.2f} [{q1:.2f}, {q3:.2f}] ({row['median_ms']:.1f} ms)"
                    )
                else:
                    cells.append(f"{row['median_ms']:.1f} ms")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _anchor_of(label: str) -> str:
    return "autocast+GradScaler fp16" if label.endswith("fp16") else "autocast bf16"


#: In the step-cost section, text from this line to the next ``## `` heading is written
#: by hand and kept when ``--markdown`` rewrites the section.
NOTES_MARKER = "<!-- step cost notes: kept when the section is regenerated -->"


def replace_section(path: str, section: str) -> None:
    """Put ``section`` in ``path`` in place of the one with the same title (or at the end),
    keeping the old section's hand-written notes (from :data:`NOTES_MARKER` on)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    start = text.find(SECTION_TITLE)
    if start < 0:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    else:
        end = text.find("\n## ", start + len(SECTION_TITLE))
        old = text[start:end] if end >= 0 else text[start:]
        tail = text[end + 1 :] if end >= 0 else ""
        notes = old.find(NOTES_MARKER)
        kept = "\n" + old[notes:].rstrip() + "\n" if notes >= 0 else ""
        text = text[:start] + section.rstrip() + "\n" + kept + ("\n" + tail if tail else "")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks step_cost",
        description="Count ops, estimated CUDA launches and bytes per training step, by phase.",
    )
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--small", action="store_true", help="a small transformer (default)")
    shapes.add_argument("--gpu-shapes", action="store_true",
                        help="the GPU benchmark's 152M-parameter transformer (minutes on a CPU)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=None,
                        help="batch of the counted step (default: 4 small, 1 GPU shapes)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2, help="steps before the counted one")
    parser.add_argument("--cuda13", action="store_true",
                        help="multi_tensor_apply limits of CUDA 13 builds")  # fmt: skip
    parser.add_argument("--only", metavar="LABELS",
                        help="comma-separated recipe labels (default: all)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=31, help="timed rounds (0: no timing)")
    parser.add_argument("--no-architectures", action="store_true",
                        help="time the transformer only, not GPT-2, ResNet, LSTM")  # fmt: skip
    parser.add_argument("--out", metavar="JSON", help="write every number here")
    parser.add_argument("--markdown", metavar="PATH",
                        help="replace this report's step-cost section")  # fmt: skip
    args = parser.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if args.warmup < 1:
        parser.error(f"--warmup must be >= 1 (a steady-state step), got {args.warmup}")
    if args.repeats < 0:
        parser.error(f"--repeats must be >= 0, got {args.repeats}")
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        known = [v.label for v in VARIANTS]
        unknown = [w for w in wanted if w not in known]
        if unknown or not wanted:
            parser.error(f"--only: unknown recipe(s) {unknown}; choose from {', '.join(known)}")
        args.variants = [v for v in VARIANTS if v.label in wanted]
    else:
        args.variants = list(VARIANTS)
    return args


def main(argv: list[str] | None = None) -> int:
    """Count (and time) every recipe; print the Markdown section; exit status 0."""
    import datetime
    import shlex

    args = _parse(argv)
    raw = sys.argv[1:] if argv is None else list(argv)
    if "--out" in raw:  # where the JSON went is this machine's business, not the report's
        at = raw.index("--out")
        raw = raw[:at] + raw[at + 2 :]

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    limits = "cuda13" if args.cuda13 else "cuda12"
    batch = args.batch or (1 if args.gpu_shapes else 4)
    workload = transformer_workload(args.gpu_shapes, batch)
    log(f"counting on {workload.name}, batch {batch}")
    counts = {
        "transformer": {
            "workload": workload.name,
            "batch": batch,
            "rows": count_all(workload, args.variants, args.warmup, limits, log),
        }
    }
    timing = None
    if args.repeats:
        timed = [v for v in args.variants if v.dtype == torch.bfloat16]  # CPU: no fp16 units
        small = transformer_workload(False, 4)
        workloads = [small] + ([] if args.no_architectures else architecture_workloads())
        timing = {"repeats": args.repeats, "workloads": {}}
        for w in workloads:
            timing["workloads"][w.name] = time_all(w, timed, 2, args.repeats, log)
    doc = {
        "command": " ".join(["python -m benchmarks step_cost", *map(shlex.quote, raw)]),
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": time.perf_counter() - t0,
        "environment": environment(),
        "limits": limits,
        "counts": counts,
        "timing": timing,
    }
    doc = jsonable(doc)
    section = render(doc)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.markdown:
        replace_section(args.markdown, section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
