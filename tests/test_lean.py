"""Lean master-weight modes: kahan-compensated and stochastic-rounding updates."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from real_models import images, resnet, train_steps
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.kernels import (
    add_rounding_noise_,
    join_bits,
    pack_bits,
    split_bits,
    stochastic_round,
    unpack_bits,
)
from mixprec.optim import LossScaleOptimizer
from mixprec.tools import live_tensor_bytes

MODES = ["kahan", "stochastic"]


def _regression(
    seed: int, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(128, 1, generator=gen)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model.to(dtype), x, y


def _train(mode, seed=0, steps=150, lr=2e-4, model=None, opt=None, data=None):
    """Full-batch AdamW on a small regression; returns the final float32-evaluated loss."""
    if model is None:
        dtype = torch.float32 if mode == "float32" else torch.bfloat16
        model, x, y = _regression(seed, dtype)
        wrapped = {"float32": False, "bf16": False}.get(mode, mode)
        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0),
                                 master_weights=wrapped)  # fmt: skip
    else:
        x, y = data
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(copy.deepcopy(model).float()(x), y)
    return float(final), model, opt


@pytest.mark.parametrize("mode", MODES)
def test_lean_modes_track_fp32_masters_where_pure_bfloat16_stalls(mode):
    # lr 2e-4 on weights ~0.3: Adam's ~lr-sized updates are below half a bfloat16 ulp.
    for seed in range(2):
        ref = _train("fp32", seed)[0]
        pure = _train("bf16", seed)[0]
        lean = _train(mode, seed)[0]
        assert abs(pure - ref) > 3 * abs(lean - ref), (seed, ref, pure, lean)
        assert abs(lean - ref) < 0.02 * ref, (seed, ref, lean)


def test_kahan_accumulates_updates_that_round_away():
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1.0), None, master_weights="kahan")
    ref = torch.ones(3, dtype=torch.float64)
    for _ in range(100):
        w.grad = torch.full_like(w, -(2.0**-11))
        ref += 2.0**-11
        opt.step()
    comp = opt._master.compensation[0]
    assert torch.equal(w.double() + comp.double(), ref)  # exact: every step was kept
    assert float(w.detach()[0]) > 1.0


def test_stochastic_round_is_unbiased_and_seeded():
    x = torch.full((20000,), 1.0 + 2.0**-10)  # a quarter of the way to the next bfloat16
    a = stochastic_round(x, torch.Generator().manual_seed(3))
    b = stochastic_round(x, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert set(a.float().unique().tolist()) == {1.0, 1.0078125}
    assert abs(float(a.float().mean()) - float(x[0])) < 2e-4
    exact = torch.tensor([0.5, -3.0, 1e-3]).bfloat16().float()
    assert torch.equal(stochastic_round(exact), exact.bfloat16())


def test_stochastic_round_truncates_the_noisy_values_as_masking_and_converting_does():
    """The weights are the noisy float32 values' high halves, copied: bit for bit what
    masking the low 16 bits and converting gives (NaN payloads aside), for every layout."""
    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-45, 38, (1000,), generator=g).float()
    x = torch.cat([torch.randn(1000, generator=g) * 10.0**exponents,
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3895e38, -1e-45])])  # fmt: skip
    for value in (x, x[::3], x[:8].view(2, 2, 2).permute(2, 0, 1), x[5], x.bfloat16()):
        got = stochastic_round(value, torch.Generator().manual_seed(7))
        noise = torch.randint(0, 2**16, value.shape, dtype=torch.int32,
                              generator=torch.Generator().manual_seed(7))  # fmt: skip
        bits = value.float().view(torch.int32) + noise
        want = (bits & -65536).view(torch.float32).to(torch.bfloat16)
        assert got.shape == value.shape and got.stride() == value.bfloat16().stride()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each op: under it the CPU takes the GPU's ways
    (:func:`mixprec.numerics.cpu_shortcuts`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("masked", [True, False, None, "watched"])
def test_the_rounding_noise_is_randints_on_either_path(masked):
    """The CPU's masked draw (``masked=True``, the CPU's default) and the one-kernel
    ``randint`` draw (``masked=False``, a GPU's, and a CPU's under a dispatch mode) give
    the same noise, element for element, and leave the generator in the same state: a
    run, its checkpoint and the step-cost count (which runs under a dispatch mode) agree."""
    gen, ref_gen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    bits = torch.arange(70001, dtype=torch.int32) * 7919
    expected = bits + torch.randint(0, 2**16, bits.shape, dtype=torch.int32, generator=ref_gen)
    if masked == "watched":  # the default's choice under a dispatch mode: randint's draw
        with _PassThrough():
            assert add_rounding_noise_(bits, gen) is bits
    else:
        assert add_rounding_noise_(bits, gen, masked=masked) is bits
    assert torch.equal(bits, expected)
    assert torch.equal(gen.get_state(), ref_gen.get_state())


def test_stochastic_runs_are_reproducible():
    first = _train("stochastic", seed=1, steps=20)[1]
    second = _train("stochastic", seed=1, steps=20)[1]
    for p, q in zip(first.parameters(), second.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mode", MODES)
def test_skipped_step_leaves_parameters_buffers_and_state_untouched(mode):
    model, x, y = _regression(0, torch.bfloat16)
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                             master_weights=mode, weight_decay=0.1)  # fmt: skip
    _train(mode, steps=3, model=model, opt=opt, data=(x, y))
    before = {
        k: v.clone() if torch.is_tensor(v) else v for k, v in opt._master.state_dict().items()
    }
    params = [p.clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    scale = float(opt.loss_scale)
    loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y) * float("inf")
    opt.scale_loss(loss).backward()
    opt.step()
    opt.zero_grad()
    after = opt._master.state_dict()
    assert int(opt.skipped_steps) == 1 and float(opt.loss_scale) == scale / 2
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    assert all(torch.equal(c, d) for c, d in zip(before["compensation"], after["compensation"]))
    assert all(
        torch.equal(before["generators"][k], after["generators"][k]) for k in before["generators"]
    )
    for s, t in zip(state, opt.state.values()):
        assert all(torch.equal(v, t[k]) for k, v in s.items())


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_resume_is_exact(mode):
    def build():
        model, x, y = _regression(2, torch.bfloat16)
        opt = LossScaleOptimizer(
            torch.optim.AdamW(model.parameters(), lr=3e-4), master_weights=mode
        )
        return model, opt, (x, y)

    model, opt, data = build()
    _train(mode, steps=5, model=model, opt=opt, data=data)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())  # torch hands out references to its state
    assert saved["mixprec"]["master"]["mode"] == mode
    _train(mode, steps=5, model=model, opt=opt, data=data)

    resumed, opt2, _ = build()
    resumed.load_state_dict(saved_model)
    opt2.load_state_dict(saved)
    _train(mode, steps=5, model=resumed, opt=opt2, data=data)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for c, d in zip(opt._master.compensation, opt2._master.compensation):
        assert torch.equal(c, d)


def test_split_masters_train_bit_identically_to_fp32_masters():
    runs = {}
    for mode in ("fp32", "split"):
        model, x, y = _regression(4, torch.bfloat16)
        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 master_weights=mode, weight_decay=0.01)  # fmt: skip
        _train(mode, steps=20, model=model, opt=opt, data=(x, y))
        loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y) * float("inf")
        opt.scale_loss(loss).backward()  # one skipped step in the middle
        opt.step()
        opt.zero_grad()
        _train(mode, steps=20, model=model, opt=opt, data=(x, y))
        runs[mode] = (list(model.parameters()), opt.state_dict())
    (p32, s32), (psplit, ssplit) = runs["fp32"], runs["split"]
    assert all(torch.equal(a, b) for a, b in zip(p32, psplit))
    masters = zip(s32["mixprec"]["master"]["masters"], ssplit["mixprec"]["master"]["masters"])
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in masters)
    for a, b in zip(s32["state"].values(), ssplit["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_bits_pack_eight_to_a_byte_lowest_first_and_unpack_for_every_byte_and_length():
    every_byte = torch.tensor([[(v >> k) & 1 for k in range(8)] for v in range(256)]).flatten()
    assert pack_bits(every_byte).tolist() == list(range(256))
    assert torch.equal(unpack_bits(pack_bits(every_byte), 2048), every_byte.to(torch.uint8))
    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 8, 9, 63, 65):
        bits = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32)
        packed = pack_bits(bits)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
        assert torch.equal(unpack_bits(packed, n), bits.to(torch.uint8))


def test_split_bits_round_trip_every_tie_and_sign():
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (50000,), generator=gen, dtype=torch.int64)
    bits[:4] = torch.tensor([0x3F808000, 0x3F818000, -0x407F8000, 0])  # ties: even, odd, negative
    master = bits.to(torch.int32).view(torch.float32)
    master = master[torch.isfinite(master)]
    weight = master.bfloat16()
    low, ties = split_bits(master, weight)
    assert low.dtype == torch.int16 and ties.numel() >= 1
    assert torch.equal(join_bits(weight, low, ties).view(torch.int32), master.view(torch.int32))
    # Without ties (the usual case) a CPU skips packing and unpacking: the same bits.
    untied = master[(master.view(torch.int32) & 0xFFFF) != 0x8000]
    low, ties = split_bits(untied, untied.bfloat16())
    assert ties.numel() == -(-untied.numel() // 8) and not ties.any()
    back = join_bits(untied.bfloat16(), low, ties)
    assert torch.equal(back.view(torch.int32), untied.view(torch.int32))


def test_split_and_fp32_checkpoints_load_into_each_other():
    model, x, y = _regression(1, torch.bfloat16)
    fp32 = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), master_weights=True)
    _train("fp32", steps=3, model=model, opt=fp32, data=(x, y))
    other, _, _ = _regression(1, torch.bfloat16)
    split = LossScaleOptimizer(torch.optim.AdamW(other.parameters()), master_weights="split")
    split.load_state_dict(copy.deepcopy(fp32.state_dict()))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    back = split.state_dict()["mixprec"]["master"]["masters"]
    assert all(
        torch.equal(a, b) for a, b in zip(fp32.state_dict()["mixprec"]["master"]["masters"], back)
    )


def test_checkpoint_of_another_mode_is_refused():
    model, _, _ = _regression(0, torch.bfloat16)
    kahan = LossScaleOptimizer(torch.optim.AdamW(model.parameters()), master_weights="kahan")
    fp32 = LossScaleOptimizer(torch.optim.AdamW(model.parameters()), master_weights="fp32")
    with pytest.raises(ValueError, match="master_weights='kahan'"):
        fp32.load_state_dict(kahan.state_dict())
    with pytest.raises(ValueError, match="master_weights='fp32'"):
        kahan.load_state_dict(fp32.state_dict())


def test_bad_master_weights_values_are_refused_and_change_nothing():
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="master_weights must be one of"):
        LossScaleOptimizer(torch.optim.AdamW([w]), master_weights="fp64")
    with pytest.raises(TypeError, match="master_weights must be True, False"):
        LossScaleOptimizer(torch.optim.AdamW([w]), master_weights=1)
    sgd = torch.optim.SGD([w], lr=0.1, weight_decay=0.01)
    with pytest.raises(ValueError, match="coupled weight_decay=0.01"):
        LossScaleOptimizer(sgd, master_weights="kahan")
    assert sgd.param_groups[0]["params"][0] is w and not sgd.state
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="master_weights='split' needs plain bfloat16"):
        LossScaleOptimizer(torch.optim.AdamW([half]), master_weights="split")
    with pytest.raises(ValueError, match="use_ema=True needs float32 masters"):
        LossScaleOptimizer(torch.optim.AdamW([w]), master_weights="split", use_ema=True)
    with pytest.raises(ValueError, match="cast the model to bfloat16"):
        LossScaleOptimizer(torch.optim.AdamW([half]), master_weights="stochastic")
    with pytest.raises(ValueError, match="needs float16 or bfloat16"):
        LossScaleOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]),
                           master_weights="kahan")  # fmt: skip
    assert LossScaleOptimizer(torch.optim.AdamW([w]), master_weights="fp32").master_weights is True


def test_weight_decay_is_kept_where_bfloat16_rounds_it_away():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    norm = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))  # a float32 layer beside it
    ref = torch.nn.Parameter(norm.detach().clone())
    opt = LossScaleOptimizer(
        torch.optim.AdamW([w, norm], lr=1e-3, weight_decay=0.1), None, master_weights="kahan"
    )
    torch_adamw = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1)
    for _ in range(200):
        w.grad, norm.grad, ref.grad = torch.zeros(4, dtype=torch.bfloat16), *torch.zeros(2, 4)
        opt.step()
        torch_adamw.step()
    expected = (1 - 1e-4) ** 200  # AdamW's decoupled decay, as float32 masters apply it
    total = w.double() + opt._master.compensation[0].double()
    assert torch.allclose(total, torch.full_like(total, expected), rtol=1e-4)
    assert torch.allclose(norm, ref, rtol=1e-6)  # float32 parameters: decayed as torch does


# split: the weight, its low 16 bits and one packed tie bit (1/8 byte) beside AdamW's 8.
ANALYTIC_BYTES = {"float32": 12, "bf16": 6, "fp32": 14, "split": 12.125, "kahan": 8, "stochastic": 6}


@pytest.mark.parametrize("mode", list(ANALYTIC_BYTES))
def test_bytes_per_parameter_with_adamw(mode):
    """Parameters + optimizer state + masters/compensation, after one step, per parameter."""
    dtype = torch.float32 if mode == "float32" else torch.bfloat16
    baseline = live_tensor_bytes()
    layer = torch.nn.Linear(256, 256, bias=False).to(dtype)
    wrapped = {"float32": False, "bf16": False}.get(mode, mode)
    opt = LossScaleOptimizer(torch.optim.AdamW(layer.parameters(), foreach=False),
                             master_weights=wrapped)  # fmt: skip
    opt.scale_loss(layer(torch.ones(1, 256, dtype=dtype)).float().sum()).backward()
    opt.step()
    opt.zero_grad()
    measured = (live_tensor_bytes() - baseline) / layer.weight.numel()
    assert measured == pytest.approx(ANALYTIC_BYTES[mode], abs=0.05), measured
    assert ANALYTIC_BYTES["kahan"] <= 8 < ANALYTIC_BYTES["float32"] < ANALYTIC_BYTES["fp32"]


@pytest.mark.slow
def test_accuracy_sweep_over_seeds(record_property):
    """600 steps, 5 seeds: the lean modes recover at least 90 % of what pure bfloat16 loses
    against float32 masters (AdamW's moments stay bfloat16 in the lean modes). The mean
    final losses go to ``--junitxml``'s report (the master-weights guide quotes them)."""
    modes = ["float32", "fp32", "bf16", *MODES]
    rows = {m: [_train(m, s, steps=600)[0] for s in range(5)] for m in modes}
    mean = {m: sum(v) / len(v) for m, v in rows.items()}
    record_property("mean_final_loss", {m: round(v, 4) for m, v in mean.items()})
    lost = mean["bf16"] - mean["fp32"]
    assert lost > 0.5 * mean["fp32"]  # the task is one where pure bfloat16 stalls
    for mode in MODES:
        assert abs(mean[mode] - mean["fp32"]) < 0.1 * lost, (mode, mean)


# --- The step with a fixed number of kernels, against the per-parameter step it replaced ---


def _reference_step(self, found_inf, skip, weight_decay=None, step_kwargs=None):
    """LeanUpdates.eager_step one parameter at a time: the bit-exact reference."""
    from mixprec.loss_scale import step_or_skip

    low_ids = {id(p) for p in self._low}
    with torch.no_grad():
        if self.mode == "kahan":
            buffers = self.compensation
        else:
            buffers = [torch.zeros_like(p) for p in self._low]
        kept_by_id = {}
        saved_decay = []
        for group in self.optimizer.param_groups:
            decay = (weight_decay or 0.0) + (group.get("weight_decay") or 0.0)
            if decay:
                shrink = group["lr"] * decay
                kept = (1.0 - shrink) + shrink * found_inf if skip else torch.tensor(1.0 - shrink)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if id(p) in low_ids:
                        kept_by_id[id(p)] = kept
                    else:
                        p.mul_(kept.to(p.device, p.dtype))
            if "weight_decay" in group:
                saved_decay.append((group, group["weight_decay"]))
                group["weight_decay"] = 0.0
        originals = [p.data for p in self._low]
        for p, b in zip(self._low, buffers):
            p.data = b
        try:
            _, skipped = step_or_skip(self.optimizer, found_inf, skip=skip, kwargs=step_kwargs)
        finally:
            for p, data in zip(self._low, originals):
                p.data = data
            for group, decay in saved_decay:
                group["weight_decay"] = decay
        if skipped:
            return True
        for p, b in zip(self._low, buffers):
            if p.grad is None and self.mode == "stochastic":
                continue
            # p * kept + b in float32, as one addcmul (kept 1 without decay)
            kept = kept_by_id.get(id(p), torch.ones(1))
            total = torch.addcmul(b, p, kept.reshape(1).to(p.device)).view(p.shape)
            if self.mode == "kahan":
                p.copy_(total)
                b.copy_(total - p.float())
            else:
                p.copy_(stochastic_round(total, self._generators[str(p.device)]))
    return False


def _mixed_params(mode):
    """Two groups: bfloat16 (float16 for kahan's second) of many shapes, a channels-last
    convolution weight, a 0-d scalar, a large tensor, float32 norms, one never used."""
    gen = torch.Generator().manual_seed(5)
    low2 = torch.bfloat16 if mode == "stochastic" else torch.float16

    def param(shape, dtype, scale=0.5):
        return torch.nn.Parameter((torch.randn(shape, generator=gen) * scale).to(dtype))

    conv = param((4, 3, 3, 3), torch.bfloat16)
    conv.data = conv.data.to(memory_format=torch.channels_last)
    first = [param((7, 5), torch.bfloat16), conv, param((), torch.bfloat16),
             param((3,), torch.float32), param((40000,), torch.bfloat16, 0.01),
             param((6,), torch.bfloat16)]  # fmt: skip
    second = [param((5, 4), low2), param((9,), torch.float32), param((11,), low2),
              param((2, 2), low2)]  # fmt: skip
    unused = {id(first[-1]), id(second[-1])}  # never get a gradient
    return first, second, unused


def _same_bits(a, b):
    """Equal bit for bit (signed zeros and NaN payloads too)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.shape == b.shape and torch.equal(a.view(ints[a.element_size()]),
                                              b.view(ints[b.element_size()]))  # fmt: skip


def _lean_run(mode, reference, optimizer, steps=7):
    first, second, unused = _mixed_params(mode)
    groups = [{"params": first, "lr": 3e-3, "weight_decay": 0.05},
              {"params": second, "lr": 1e-2, "weight_decay": 0.0}]  # fmt: skip
    if optimizer == "adamw-fused":
        inner = torch.optim.AdamW(groups, fused=True)
    else:
        for g in groups:
            g["weight_decay"] = 0.0  # SGD's decay is coupled: LossScaleOptimizer's instead
        inner = torch.optim.SGD(groups, momentum=0.9)
    opt = LossScaleOptimizer(inner, 128.0, master_weights=mode, weight_decay=0.02)
    if reference:
        opt._master.eager_step = _reference_step.__get__(opt._master)
    params = [p for g in inner.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        targets = [torch.randn(p.shape, generator=gen) for p in params]
        loss = sum((p.float() * t).sum() for p, t in zip(params, targets) if id(p) not in unused)
        if step in (2, 5):
            loss = loss * float("inf")  # an overflow: the step is skipped
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    return params, opt


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd"])
@pytest.mark.parametrize("run_elements", [1 << 26, 50])
@pytest.mark.parametrize("mode", MODES)
def test_step_is_bit_identical_to_the_per_parameter_step(mode, run_elements, optimizer,
                                                         monkeypatch):  # fmt: skip
    """Weight decay in one group, skipped steps, parameters without gradients, float32
    parameters between low ones, a channels-last weight, and runs cut short (50 elements:
    many runs, a tensor larger than a run) all step exactly as one parameter at a time."""
    from mixprec.optim.masters import _lean

    monkeypatch.setattr(_lean, "RUN_ELEMENTS", run_elements)
    new_params, new = _lean_run(mode, False, optimizer)
    ref_params, ref = _lean_run(mode, True, optimizer)
    assert int(new.skipped_steps) == int(ref.skipped_steps) == 2
    for p, q in zip(new_params, ref_params):
        assert p.dtype == q.dtype and p.stride() == q.stride() and _same_bits(p, q)
    new_state, ref_state = new._master.state_dict(), ref._master.state_dict()
    assert len(new_state["compensation"]) == len(ref_state["compensation"])
    for c, d in zip(new_state["compensation"], ref_state["compensation"]):
        assert _same_bits(c, d)
    for key in ref_state["generators"]:
        assert torch.equal(new_state["generators"][key], ref_state["generators"][key])
    for s, t in zip(new.state.values(), ref.state.values()):
        assert all(_same_bits(s[k], t[k]) for k in t)
    if mode == "kahan":
        assert any(c.abs().sum() > 0 for c in new._master.compensation)  # the buffers work


def _lean_step_kernels(n_params):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Kernels(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in ("empty", "empty_like"):
                Kernels.count += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, generator=gen).bfloat16()) for _ in range(n_params)]
    opt = LossScaleOptimizer(torch.optim.AdamW(params, fused=True), None, master_weights="kahan")
    counts = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(8, generator=gen).bfloat16()
        lean = opt._master
        found_inf = torch.zeros(())
        Kernels.count = 0
        with Kernels():
            lean.step(found_inf, skip=True)
        counts.append(Kernels.count)
    return counts[-1]


def test_lean_step_dispatches_as_many_ops_for_8_as_for_64_parameters():
    # The run's parameters are views of its storage: no gather or scatter kernels.
    assert _lean_step_kernels(8) == _lean_step_kernels(64) <= 13


def _cnn_with_batchnorm(seed):
    return resnet(widths=(4,), classes=5, seed=seed).bfloat16()


@pytest.mark.parametrize("mode", MODES)
def test_a_run_holds_its_parameters_in_one_storage(mode, tmp_path):
    from safetensors.torch import load_file, save_file

    model = _cnn_with_batchnorm(0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = list(model.parameters())
    opt = LossScaleOptimizer(torch.optim.AdamW(params, lr=1e-3), master_weights=mode)
    assert list(model.parameters()) == params  # the same Parameter objects
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    train_steps(model, opt, 3)
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert all(p.grad is None for p in params)
    # Checkpoints hold each parameter once: torch.save of the state dict, safetensors.
    state = model.state_dict()
    torch.save(state, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    save_file(state, str(tmp_path / "model.safetensors"))
    safe = load_file(str(tmp_path / "model.safetensors"))
    for name, value in state.items():
        assert torch.equal(loaded[name], value) and torch.equal(safe[name], value)
    weights = sum(p.numel() * p.element_size() for p in params)
    assert (tmp_path / "model.safetensors").stat().st_size < weights + 4096


@pytest.mark.parametrize("change", ["cast", "channels_last"])
def test_a_parameter_changed_after_the_optimizer_is_refused_before_anything_changes(change):
    model = _cnn_with_batchnorm(2)
    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                             master_weights="kahan")  # fmt: skip
    train_steps(model, opt, 2)
    x = images(batch=2, size=8, classes=5)[0]
    if change == "cast":
        model.half()
        x = x.half()
    else:
        model.to(memory_format=torch.channels_last)
        x = x.bfloat16()
    opt.scale_loss(model(x).float().square().mean()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    compensation = [c.clone() for c in opt._master.compensation]
    scale = float(opt.loss_scale)
    expected = "torch.float16" if change == "cast" else "with strides (27, 1, 9, 3)"
    with pytest.raises(ValueError, match=rf"changed from torch.bfloat16 .* to .*{re.escape(expected)}.*"
                       "build the optimizer"):  # fmt: skip
        opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # not unscaled
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(c, d) for c, d in zip(opt._master.compensation, compensation))
    assert int(opt.iterations) == 2 and float(opt.loss_scale) == scale
