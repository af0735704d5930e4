"""``AdamW8bit``: AdamW whose two moments are stored in 8 bits per element.

The moments are dequantised to float32, updated, used, and quantised again in every
step; the arithmetic is AdamW's in float32. The storage format (per parameter, its
elements flattened and cut into blocks of ``block_size``, the last block zero-padded):

* first moment ``m``: per block the absolute maximum ``s`` (float32); each element
  ``x = m / s`` in ``[-1, 1]`` is companded ``c = 2x / (1 + |x|)`` (twice the
  resolution near zero, where most of a block's values lie) and stored as the int8
  ``round(127 c)``. Decoded: ``x = c / (2 - |c|)``, ``m = s x``.
* second moment ``v``: per block the maximum ``t`` of ``sqrt(v)`` (float32); each
  element is stored as the uint8 ``round(255 sqrt(v) / t)``, at least 1 where
  ``v > 0``. The square root halves the dynamic range a code must span (the step
  divides by ``sqrt(v)``, so its relative error is what matters), and the floor of
  1 keeps a small nonzero ``v`` from decoding as 0, which would turn ``m / sqrt(v)``
  into ``m / eps``: a small ``v`` may be overestimated (a smaller step), never zeroed.

Codes are rounded stochastically by default (``floor(x + uniform)``: unbiased, to ``2**-15`` of a code), from a
seeded generator saved in the checkpoint. Round-to-nearest (``rounding="nearest"``)
is biased where it matters: an 8-bit code cannot follow a moment that changes by less
than half a code per step (the second moment's ``beta2 = 0.999`` moves it by 0.1 %), so
such elements stay where they were and follow their block's scale instead. Measured on
the lean regression (``benchmarks/lean.py``, float32 AdamW at 2e-4, 600 steps): the
final loss with nearest rounding is 14 % away from AdamW's (the second moment alone:
18 %), with stochastic rounding 1 %.

The step's elementwise math (decode both moments, AdamW's update with its bias
corrections and weight decay, encode both moments, the skip on ``found_inf``) is one
pure function of a chunk's gathered tensors, :func:`~mixprec.kernels.adamw.update_chunk`; the stochastic
rounding's noise is drawn before it, from the optimizer's checkpointed generator, and
passed in (one int32 draw per element carries both moments' noise:
:func:`~mixprec.kernels.moments8.noise_from_bits`), so a resumed run draws the same noise whichever way the step
runs.
``AdamW8bit(fused=True)`` runs that function through ``torch.compile``
(:func:`~mixprec.kernels.compiled.update_chunk_fused`: its ~45 ops become a few fused loops), ``fused=False`` as
it is, and ``fused=None`` (the default) compiles it on CUDA and runs it as it is
elsewhere. The eager function is the reference; the compiled one does the same operations on the same inputs
(the hyperparameters as tensors: two of them multiply where torch's ``alpha``/``value``
take only numbers), but inductor may fuse a multiply and an add into one FMA, compute a power with another
routine or reorder, so a float32 result can be a few units in the last place off the
reference. A code is a floor (or round) of such a value: it differs only where the
value lies within that distance of a code boundary, which is rare, and then by one.
The skip, the step counts and the noise are exact either way, and a checkpoint of
one loads into the other.

Bytes per parameter: 1 + 1 for the codes, plus ``8 / block_size`` for the two float32
block scales (0.03125 at the default 256). ``step`` is one float32 per parameter tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch

from mixprec._checks import check_bool, check_choice, check_number
from mixprec.kernels.adamw import bias_corrections, update_chunk
from mixprec.kernels.compiled import compile_unsupported, update_chunk_fused

_STATE_KEYS = ("step", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")


def _padded(numel: int, block: int) -> int:
    return -(-numel // block) * block


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with 8-bit moments: 2 bytes of state per parameter.

    AdamW whose moments are int8/uint8 with per-block scales (the module docstring has
    the format). Each step decodes the moments to float32, does AdamW's update in
    float32 (the parameters are read and written in float32, rounded once into a
    low-precision parameter), and encodes the new moments; the update uses the
    float32 moments of this step, before they are encoded.

    Arguments as :class:`torch.optim.AdamW`'s (``lr``, ``betas``, ``eps``,
    ``weight_decay``), plus ``block_size`` (elements per scale), ``rounding`` of the
    codes (``"stochastic"``, the default, or ``"nearest"``: the module docstring says
    why), ``seed`` (of the rounding's generator, one per device, checkpointed under
    ``"rng"``) and ``chunk_size`` (elements processed at once: the step gathers up to
    that many elements of a group, over any number of tensors, and updates them with a
    fixed number of kernels, so the launches per step grow with the group's size over
    ``chunk_size``, not with its tensor count; the float32 scratch is about 32 bytes per
    element of a chunk). ``fused`` picks how a chunk's math runs: ``True`` through
    ``torch.compile`` (refused at construction where torch.compile cannot run),
    ``False`` eagerly, ``None`` compiled on CUDA and eager elsewhere; the module
    docstring says how the two agree. The first fused step compiles (seconds; again for
    the other rounding mode, a zero or nonzero ``weight_decay`` and another device,
    never for another chunk size or hyperparameter value). Measured on a CPU (a shared
    2-core Intel Xeon with AVX-512, torch 2.13, one thread, medians of 31 rounds): a
    step of one 1M-element parameter takes 42 ms eager and 12 ms fused (3.6x), of a 4M
    one 140 and 60 ms (2.3x); the noise for stochastic rounding, drawn outside the
    compiled math, is about a sixth of a fused step. ``torch.optim.AdamW`` (float32
    moments, its per-tensor CPU loop) takes 2.5 and 14 ms.

    It speaks torch's fused-optimizer protocol (``_step_supports_amp_scaling``): given
    ``found_inf`` it skips on the device (parameters, codes, scales and ``step``
    unchanged, no host sync), given ``grad_scale`` it unscales the gradients, so
    :class:`~mixprec.LossScaleOptimizer` and ``GradScaler`` step it without a sync. As
    the inner optimizer of ``LossScaleOptimizer(master_weights="split8")`` the stepped
    parameters are the rebuilt float32 masters: weight 2 + correction 1 + moments 2 +
    scales = about 5 bytes per parameter between steps, 7 with bfloat16 gradients.
    There the masters' fused step (``Split8MasterWeights.fused``: on a GPU unless
    ``fused=False``) replaces both steps with one compiled loop per parameter over the
    weight, correction, codes and scales, with no float32 master, master gradient or
    moment in memory; its codes' noise is hashed from one seed a step drawn from this
    optimizer's generator.

    Against float32 AdamW each step's encoding moves the first moment by at most
    ``1/127`` of its block's absolute maximum (one code; half a code when rounding to
    nearest) and the second's square root by at most ``t/255`` (one code), the smallest
    nonzero ones only upwards; stochastic rounding makes these errors zero-mean, so they
    average out over steps instead of piling up.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    >>> opt = AdamW8bit([w], lr=0.1, weight_decay=0.0)
    >>> w.grad = torch.tensor([1.0, -1.0, 0.5])
    >>> opt.step()  # the first Adam step is lr * sign(grad)
    >>> [round(v, 4) for v in w.tolist()]
    [0.9, -1.9, 2.9]
    >>> sorted(opt.state[w]), opt.state[w]["exp_avg_q"].dtype, opt.state[w]["exp_avg_q"].numel()
    (['exp_avg_q', 'exp_avg_scale', 'exp_avg_sq_q', 'exp_avg_sq_scale', 'step'], torch.int8, 256)
    """

    _step_supports_amp_scaling = True

    #: Its weight decay is AdamW's, apart from the gradient update (the lean master-weight
    #: modes fold it into their buffer).
    decoupled_weight_decay = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        chunk_size: int = 1 << 22,
        rounding: str = "stochastic",
        seed: int = 0,
        fused: bool | None = None,
    ) -> None:
        check_number("lr", lr, minimum=0)
        check_number("eps", eps, minimum=0)
        check_number("weight_decay", weight_decay, minimum=0)
        if (
            not isinstance(betas, (tuple, list))
            or len(betas) != 2
            or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in betas)
            or not all(0.0 <= b < 1.0 for b in betas)
        ):
            raise ValueError(
                f"betas must be two numbers in [0, 1), got {betas!r}; e.g. betas=(0.9, 0.999)"
            )
        check_number("block_size", block_size, integer=True, minimum=1,
                     hint="e.g. block_size=256")  # fmt: skip
        check_number("chunk_size", chunk_size, integer=True, minimum=block_size,
                     hint=f"it must hold at least one block of block_size={block_size}")  # fmt: skip
        check_choice("rounding", rounding, ("stochastic", "nearest"))
        check_number("seed", seed, integer=True, minimum=0)
        if fused is not None:
            check_bool("fused", fused, hint="or None (compiled on CUDA, eager elsewhere)")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "block_size": block_size}  # fmt: skip
        self.chunk_size = chunk_size
        self.rounding, self.seed, self.fused = rounding, seed, fused
        self._generators: dict[str, torch.Generator] = {}
        super().__init__(params, defaults)
        kinds = sorted({p.device.type for g in self.param_groups for p in g["params"]})
        reasons = [r for r in map(compile_unsupported, kinds) if r] if fused else []
        if reasons:
            raise RuntimeError(f"fused=True: {reasons[0]}; pass fused=False (the eager step)")

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def _fused_on(self, device: torch.device) -> bool:
        if self.fused is not None:
            return self.fused
        return device.type == "cuda" and compile_unsupported("cuda") is None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters must be real floating-point tensors."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if not p.is_floating_point() or p.is_complex():
                raise ValueError(
                    f"AdamW8bit steps real floating-point parameters, got a {p.dtype} one; "
                    "leave it out of the optimizer (or use torch.optim.AdamW for it)"
                )
        block = param_group.get("block_size", self.defaults["block_size"])
        if block != self.defaults["block_size"]:
            raise ValueError(
                f"block_size={block!r} in a parameter group: every group uses the "
                f"optimizer's block_size={self.defaults['block_size']}; build another "
                "AdamW8bit for another block size"
            )
        super().add_param_group(param_group)

    def _fresh_state(self, numel: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The zero state of a parameter of ``numel`` elements on ``device``."""
        block = self.defaults["block_size"]
        n = _padded(numel, block)
        return {
            "step": torch.zeros((), dtype=torch.float32, device=device),
            "exp_avg_q": torch.zeros(n, dtype=torch.int8, device=device),
            "exp_avg_scale": torch.zeros(n // block, dtype=torch.float32, device=device),
            "exp_avg_sq_q": torch.zeros(n, dtype=torch.uint8, device=device),
            "exp_avg_sq_scale": torch.zeros(n // block, dtype=torch.float32, device=device),
        }

    def _check_state_size(self, state: dict[str, torch.Tensor], numel: int) -> None:
        """Raise ``RuntimeError`` unless ``state`` holds the codes of ``numel`` elements."""
        if state["exp_avg_q"].numel() != _padded(numel, self.defaults["block_size"]):
            raise RuntimeError(
                f"AdamW8bit state of {state['exp_avg_q'].numel()} codes for a parameter of "
                f"{numel} elements: the loaded checkpoint was saved from another model"
            )

    def _step_seed(self, device: torch.device) -> torch.Tensor | None:
        """One int64 seed (a 1-element tensor on ``device``) from the device's generator
        for a fused step's hashed rounding noise; ``None`` with ``rounding="nearest"``."""
        if self.rounding != "stochastic":
            return None
        generator = self._generator(device)
        return torch.randint(0, 1 << 31, (1,), generator=generator, device=device)

    def _chunks(self, params: list[torch.Tensor], block: int) -> list[list[torch.Tensor]]:
        chunks: list[list[torch.Tensor]] = []
        size = 0
        for p in params:
            n = _padded(p.numel(), block)
            if chunks and size + n <= self.chunk_size and chunks[-1][0].device == p.device:
                chunks[-1].append(p)
                size += n
            else:
                chunks.append([p])
                size = n
        return chunks

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step on the parameters that have gradients (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "AdamW8bit does not support sparse gradients; use torch.optim.SparseAdam"
                    )
            block = group["block_size"]
            for p in params:
                if not self.state[p]:
                    self.state[p] = self._fresh_state(p.numel(), p.device)
                else:
                    self._check_state_size(self.state[p], p.numel())
            for chunk in self._chunks(params, block):
                self._step_chunk(group, chunk, block, grad_scale, found_inf)
        return loss

    def _step_chunk(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        block: int,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        device = params[0].device
        beta1, beta2 = group["betas"]
        found_inf = None if found_inf is None else found_inf.to(device, torch.float32)
        states = [self.state[p] for p in params]
        sizes = [_padded(p.numel(), block) for p in params]
        block_counts = [n // block for n in sizes]
        total = sum(sizes)
        # Gather gradients and parameters into flat float32 buffers (one fused copy
        # each); the zero padding ends every tensor on a block boundary.
        grads = torch.empty(total, dtype=torch.float32, device=device)
        weights = torch.empty(total, dtype=torch.float32, device=device)
        grad_views = [v[: p.numel()].view(p.shape) for v, p in zip(grads.split(sizes), params)]
        weight_views = [v[: p.numel()].view(p.shape) for v, p in zip(weights.split(sizes), params)]
        torch._foreach_copy_(grad_views, [p.grad for p in params if p.grad is not None])
        torch._foreach_copy_(weight_views, list(params))
        # Only the padding is zeroed (its gradients must not reach the block scales).
        tails = [v[p.numel():] for b in (grads, weights) for v, p in zip(b.split(sizes), params)
                 if p.numel() < v.numel()]  # fmt: skip
        if tails:
            torch._foreach_zero_(tails)
        # Where each tensor's blocks end, built on the host and copied in one go, from
        # pinned memory on CUDA so that the copy does not wait for the GPU.
        block_ends = torch.tensor(list(itertools.accumulate(block_counts)))
        if device.type == "cuda":
            block_ends = block_ends.pin_memory()
        block_ends = block_ends.to(device, non_blocking=True)
        noise_bits = None
        if self.rounding == "stochastic":  # drawn here: the generator is checkpointed
            noise_bits = torch.empty((total // block, block), dtype=torch.int32, device=device)
            noise_bits.random_(generator=self._generator(device))
        steps, step_size, correction2_sqrt = bias_corrections(
            torch.stack([s["step"] for s in states]), block_ends, total // block,
            found_inf, lr=group["lr"], beta1=beta1, beta2=beta2)  # fmt: skip
        update = update_chunk_fused if self._fused_on(device) else update_chunk
        new_weights, m_codes, m_scales, v_codes, v_scales = update(
            grads.view(-1, block),
            weights.view(-1, block),
            torch.cat([s["exp_avg_q"] for s in states]).view(-1, block),
            torch.cat([s["exp_avg_scale"] for s in states]),
            torch.cat([s["exp_avg_sq_q"] for s in states]).view(-1, block),
            torch.cat([s["exp_avg_sq_scale"] for s in states]),
            step_size,
            correction2_sqrt,
            noise_bits,
            None if grad_scale is None else grad_scale.to(device, torch.float32),
            found_inf,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            decay=group["weight_decay"],
        )  # fmt: skip
        new_views = new_weights.view(-1).split(sizes)
        torch._foreach_copy_(list(params), [v[: p.numel()].view(p.shape)
                                            for v, p in zip(new_views, params)])  # fmt: skip
        torch._foreach_copy_([s["exp_avg_q"] for s in states], m_codes.view(-1).split(sizes))
        torch._foreach_copy_([s["exp_avg_scale"] for s in states], m_scales.split(block_counts))
        torch._foreach_copy_([s["exp_avg_sq_q"] for s in states], v_codes.view(-1).split(sizes))
        torch._foreach_copy_([s["exp_avg_sq_scale"] for s in states], v_scales.split(block_counts))
        torch._foreach_copy_([s["step"] for s in states], list(steps.unbind()))

    # -- checkpoints: torch's format; loads are checked first and keep float32 scales --

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus ``"rng"``: the stochastic-rounding generators' states."""
        state = super().state_dict()
        state["rng"] = {k: g.get_state() for k, g in self._generators.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, after checking every saved moment's codes and
        scales against this optimizer's parameters (nothing changes on a mismatch); every
        state tensor loads with its saved (checked) dtype whatever the parameters' dtype:
        int8/uint8 codes, float32 scales and steps (bit-exact)."""
        ids = self.check_state_dict(state_dict)
        rng = state_dict.get("rng", {})
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "rng"})
        self._generators = {}
        for key, value in rng.items():
            self._generators[key] = torch.Generator(device=key)
            self._generators[key].set_state(value.cpu())  # map_location may have moved it
        for i, entry in state_dict["state"].items():
            state = self.state[ids[i]]
            # torch casts floating-point parameters' state to their dtype: codes included,
            # which would then take 4 bytes each (and give the fused step other dtypes).
            for key in _STATE_KEYS:
                state[key] = entry[key].to(ids[i].device, copy=True)

    def check_state_dict(self, state_dict: Any) -> dict[Any, torch.Tensor]:
        """Raise ``ValueError`` unless ``state_dict`` loads into this optimizer (its groups,
        block size, and every code and scale tensor's dtype and shape); change nothing.
        Returns the saved parameter ids mapped to this optimizer's parameters."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("not an optimizer state dict: expected 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "the saved parameter groups do not match this optimizer's (group count or "
                "sizes differ): was it saved from another model?"
            )
        ids = {i: p for s, g in zip(saved_groups, self.param_groups)
               for i, p in zip(s["params"], g["params"])}  # fmt: skip
        for s, g in zip(saved_groups, self.param_groups):
            if s.get("block_size") != g["block_size"]:
                raise ValueError(
                    f"the checkpoint's block_size is {s.get('block_size')!r}, this "
                    f"optimizer's is {g['block_size']}; build it with "
                    f"block_size={s.get('block_size')!r}"
                )
        rng = state_dict.get("rng", {})
        if not isinstance(rng, dict) or not all(
            isinstance(k, str) and torch.is_tensor(v) and v.dtype == torch.uint8
            for k, v in rng.items()
        ):
            raise ValueError("state_dict['rng'] must map device names to generator states (uint8)")
        for i, entry in state_dict["state"].items():
            p = ids.get(i)
            if p is None:
                raise ValueError(f"the checkpoint has state for parameter {i!r}, which no group holds")
            self._check_entry(i, entry, p, self.defaults["block_size"])
        return ids

    @staticmethod
    def _check_entry(index: Any, entry: Any, p: torch.Tensor, block: int) -> None:
        if not isinstance(entry, dict) or set(entry) != set(_STATE_KEYS):
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(
                f"state[{index!r}] must have keys {sorted(_STATE_KEYS)} (an AdamW8bit "
                f"checkpoint), got {got}"
            )
        codes = entry["exp_avg_q"]
        # A released master (master_weights="split"/"split8") is empty between steps:
        # its size is then the codes', checked against the parameter at the next step.
        n = _padded(p.numel(), block) if p.numel() else (
            codes.numel() if torch.is_tensor(codes) and codes.numel() % block == 0 else -1)
        expected = {"step": ((), torch.float32), "exp_avg_q": ((n,), torch.int8),
                    "exp_avg_scale": ((n // block,), torch.float32),
                    "exp_avg_sq_q": ((n,), torch.uint8),
                    "exp_avg_sq_scale": ((n // block,), torch.float32)}  # fmt: skip
        for key, (shape, dtype) in expected.items():
            value = entry[key]
            if not torch.is_tensor(value) or tuple(value.shape) != shape or value.dtype != dtype:
                got = (f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value)
                       else type(value).__name__)  # fmt: skip
                raise ValueError(
                    f"state[{index!r}][{key!r}] must be a {dtype} tensor of shape {shape}, "
                    f"got {got}: was it saved from another model or block_size?"
                )
