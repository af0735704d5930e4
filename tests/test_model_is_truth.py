"""The model's parameters are what users read and write, at every master-weight mode.

Flows people write around their models: loading weights after ``amp.initialize``,
editing weights in place, torch's clipping recipe on ``model.parameters()``, hooks
that read ``p.grad`` after unscaling. Each must act on what is stepped.
"""

from __future__ import annotations

import copy

import pytest
import torch
from real_models import char_batches, gpt2, images, lm_loss, resnet, train_steps
from torch import nn

from mixprec import amp
from mixprec.optim import LossScaleOptimizer
from mixprec.train import Model


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)


def _step(model, opt, seed=0, clip=None):
    x, y = _batch(seed)
    loss = nn.functional.cross_entropy(model(x).float(), y)
    opt.scale_loss(loss).backward()
    norm = None
    if clip is not None:
        opt.unscale_()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return norm


def _distance(model: nn.Module, state: dict) -> float:
    own = model.state_dict()
    return max(float((own[k].float() - v.float()).abs().max()) for k, v in state.items())


MODES = ["fp32", "split"]


@pytest.mark.parametrize("mode", MODES)
def test_weights_loaded_after_initialize_are_trained(mode):
    pretrained = _mlp(seed=1).state_dict()
    model = _mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16, master_weights=mode)
    model.load_state_dict(pretrained)
    _step(model, opt)
    # One AdamW step at lr 1e-4 moves a weight by about 1e-4 (plus bfloat16 rounding).
    assert _distance(model, pretrained) < 0.02
    assert _distance(model, _mlp(seed=0).state_dict()) > 0.1


def test_a_load_after_initialize_trains_like_a_load_before():
    pretrained = {k: v.bfloat16().float() for k, v in _mlp(seed=1).state_dict().items()}
    before = _mlp(seed=0)
    before.load_state_dict(pretrained)
    opt_b = torch.optim.AdamW(before.parameters(), lr=1e-3)
    before, opt_b = amp.initialize(before, opt_b, "O2", torch.bfloat16)
    after = _mlp(seed=0)
    opt_a = torch.optim.AdamW(after.parameters(), lr=1e-3)
    after, opt_a = amp.initialize(after, opt_a, "O2", torch.bfloat16)
    after.load_state_dict(pretrained)
    for seed in range(3):
        _step(before, opt_b, seed)
        _step(after, opt_a, seed)
    for a, b in zip(after.parameters(), before.parameters()):
        assert torch.equal(a, b)


def test_model_network_load_state_dict_after_model_is_built():
    pretrained = _mlp(seed=1).state_dict()
    net = _mlp(seed=0)
    model = Model(net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4), amp_level="O2",
                  dtype=torch.bfloat16, device="cpu")  # fmt: skip
    model.network.load_state_dict(pretrained)
    x, y = _batch()
    model.train(1, [(x, y)])
    assert _distance(model.network, pretrained) < 0.02


def test_in_place_edit_between_steps_is_kept():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16)
    _step(model, opt)
    with torch.no_grad():
        model[0].weight.zero_()
    _step(model, opt, seed=1)
    assert float(model[0].weight.detach().abs().max()) < 0.01  # one small step from zero


def _cnn(seed: int, channels_last: bool) -> nn.Module:
    model = resnet(widths=(4,), classes=5, seed=seed)
    return model.to(memory_format=torch.channels_last) if channels_last else model


ALL_MODES = ["fp32", "split", "split8", "kahan", "stochastic"]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_weight_given_new_storage_trains_as_an_in_place_edit(mode):
    """``p.data = ...`` keeps a parameter's version counter; every mode still sees it
    (a cast round trip, ``model.float().bfloat16()``, gives every weight new storage),
    and a wrapper that keeps a weight in its own buffer gets every update there."""

    def replace(step, model):
        if step == 1:
            model[0].weight.data = model[0].weight.detach() * 0.5
        if step == 2:
            model.float().bfloat16()

    def in_place(step, model):
        if step == 1:
            with torch.no_grad():
                model[0].weight.mul_(0.5)

    kept = {}

    def managed(step, model):  # a wrapper keeping the weight in its own buffer
        if step == 1:
            kept["buffer"] = model[0].weight.detach().clone()
        if step >= 1:
            model[0].weight.data = kept["buffer"]

    runs = {}
    for edit in (replace, in_place, managed, None):
        model = _cnn(0, channels_last=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        level = "lean" if mode in ("kahan", "stochastic") else "O2"
        model, opt = amp.initialize(model, opt, level, torch.bfloat16, master_weights=mode,
                                    keep_batchnorm_fp32=False)  # fmt: skip
        train_steps(model, opt, 4, edit=edit)
        runs[edit] = [p.detach().clone() for p in model.parameters()]
        if mode in ("split", "split8"):  # one storage while held; released by new storage
            storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
            assert (len(storages) == 1) == (edit in (in_place, None))
    initial = _cnn(0, channels_last=True)[0].weight.detach()
    assert float(runs[in_place][0].abs().max()) < 0.5 * float(initial.abs().max()) + 0.01
    for first, second in ((replace, in_place), (managed, None)):
        for a, b in zip(runs[first], runs[second]):
            assert torch.equal(a, b) and a.stride() == b.stride()
    assert torch.equal(kept["buffer"], runs[None][0])  # the wrapper's buffer was stepped


def test_split_masters_of_a_channels_last_cnn_are_fp32_masters_in_one_storage():
    """The split modes make a group's weights views of one flat tensor (strided as
    before) and train bit for bit as float32 masters do."""
    results = {}
    for mode in ("fp32", "split"):
        model = _cnn(1, channels_last=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        model, opt = amp.initialize(model, opt, "O2", torch.bfloat16, master_weights=mode,
                                    keep_batchnorm_fp32=False)  # fmt: skip
        train_steps(model, opt, 4)
        params = list(model.parameters())
        assert params[0].is_contiguous(memory_format=torch.channels_last)
        storages = {p.untyped_storage().data_ptr() for p in params}
        assert len(storages) == (1 if mode == "split" else len(params))
        results[mode] = params, opt.state_dict()
    (p32, s32), (psplit, ssplit) = results["fp32"], results["split"]
    assert all(torch.equal(a, b) for a, b in zip(p32, psplit))
    masters = zip(s32["mixprec"]["master"]["masters"], ssplit["mixprec"]["master"]["masters"])
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in masters)


@pytest.mark.parametrize("mode", ["split", "split8"])
def test_a_split_weight_converted_after_initialize_is_refused_before_anything_changes(mode):
    model = _cnn(2, channels_last=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16, master_weights=mode,
                                keep_batchnorm_fp32=False)  # fmt: skip
    train_steps(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    model.to(memory_format=torch.channels_last)
    x = images(batch=2, size=8, classes=5)[0].bfloat16()
    opt.scale_loss(model(x).float().square().mean()).backward()
    with pytest.raises(ValueError, match="changed from torch.bfloat16 .* strides .*build the"):
        opt.step()
    model.to(memory_format=torch.contiguous_format)  # back as it was: accepted again
    key = "corrections" if mode == "split8" else "masters"
    again = opt.state_dict()
    for a, b in zip(saved["mixprec"]["master"][key], again["mixprec"]["master"][key]):
        assert torch.equal(a, b)
    assert int(opt.iterations) == 2
    train_steps(model, opt, 1)
    assert int(opt.iterations) == 3


def test_reloading_the_models_own_state_keeps_the_masters_bits():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16)
    _step(model, opt)
    saved = opt.state_dict()["mixprec"]["master"]["masters"]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in saved)  # bits beyond bf16
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # a resume in either order
    again = opt.state_dict()["mixprec"]["master"]["masters"]
    assert all(torch.equal(a, b) for a, b in zip(saved, again))


@pytest.mark.parametrize("mode", MODES)
def test_torch_clipping_recipe_clips_the_step_exactly(mode):
    """clip_grad_norm_(model.parameters()) after unscale_() clips what is stepped: it
    returns the float32 masters' norm and the step equals clipping the masters."""
    results = []
    for clip_model in (True, False):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, "O2", torch.bfloat16, loss_scale=1024.0,
                                    master_weights=mode)  # fmt: skip
        x, y = _batch()
        opt.scale_loss(nn.functional.cross_entropy(model(x).float(), y)).backward()
        opt.unscale_()
        targets = model.parameters() if clip_model else opt.param_groups[0]["params"]
        norm = torch.nn.utils.clip_grad_norm_(list(targets), 0.05)
        opt.step()
        results.append((norm, [p.detach().clone() for p in model.parameters()]))
    (norm_model, weights_model), (norm_master, weights_master) = results
    assert norm_model.dtype == torch.float32 and torch.equal(norm_model, norm_master)
    assert float(norm_model) > 0.05  # the clip did act
    assert all(torch.equal(a, b) for a, b in zip(weights_model, weights_master))


def test_hooks_after_unscale_see_unscaled_gradients_and_dtypes_come_back():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16, loss_scale=2.0**15)
    x, y = _batch()
    opt.scale_loss(nn.functional.cross_entropy(model(x).float(), y)).backward()
    scaled = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    opt.unscale_()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads.items():  # what a hook or logger reads now
        assert grad.dtype == torch.float32
        assert torch.equal(grad, scaled[name] / 2.0**15), name
    opt.step()
    low = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert len(low) == 4 and all(p.grad.dtype == torch.bfloat16 for p in low)
    assert all(torch.equal(p.grad.float(), grads[n]) for n, p in model.named_parameters()
               if p.dtype == torch.bfloat16)  # fmt: skip
    assert all(p.dtype == torch.bfloat16 for p in model[0].parameters())


def test_zero_grad_after_unscale_gives_the_model_its_dtype_back():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16)
    x, y = _batch()
    opt.scale_loss(nn.functional.cross_entropy(model(x).float(), y)).backward()
    opt.unscale_()
    assert model[0].weight.dtype == torch.float32
    opt.zero_grad()
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.grad is None


def test_float16_clipping_recipe_skips_overflow_and_clips():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, "O2", torch.float16, loss_scale="dynamic")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch()
    opt.scale_loss(nn.functional.cross_entropy(model(x).float(), y) * float("inf")).backward()
    opt.unscale_()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    assert int(opt.skipped_steps) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    norm = _step(model, opt, clip=0.01)
    assert float(norm) > 0.01 and int(opt.iterations) == 1


def test_replacing_or_dropping_a_gradient_after_unscale_is_what_steps():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16, loss_scale=8.0)
    x, y = _batch()
    opt.scale_loss(nn.functional.cross_entropy(model(x).float(), y)).backward()
    opt.unscale_()
    w0, w3 = model[0].weight.detach().clone(), model[3].weight.detach().clone()
    model[0].weight.grad = None  # this layer sits the step out
    model[3].weight.grad = torch.full_like(model[3].weight, 0.5)
    opt.step()
    assert torch.equal(model[0].weight.float(), w0.bfloat16().float())
    assert torch.equal(model[3].weight, (w3 - 0.5).bfloat16())


def test_gpt2_clipping_recipe_at_o2_matches_float32_closely():
    """A real model: GPT-2 from a config, torch's clipping recipe as written, O2."""
    batches = char_batches(batch=4, length=16, steps=6)
    reference = gpt2(layers=1, width=32, context=16)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = amp.initialize(model, opt, "O2", torch.bfloat16)
    norms = []
    for inputs, targets in batches:
        loss = lm_loss(reference(inputs).logits, targets)
        loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.scale_loss(lm_loss(model(inputs).logits, targets)).backward()
        opt.unscale_()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        norms.append((float(norm), float(ref_norm)))
    # Without the fix the recipe reported the scaled norm (x32768) and clipped nothing.
    for got, want in norms:
        assert abs(got - want) / want < 0.1


def test_lean_modes_clip_the_model_gradients_they_step():
    for mode in ("kahan", "stochastic"):
        model = _mlp().bfloat16()
        opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 64.0,
                                 master_weights=mode)  # fmt: skip
        x, y = _batch()
        opt.scale_loss(nn.functional.cross_entropy(model(x.bfloat16()).float(), y)).backward()
        opt.unscale_()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        assert float(norm) < 100  # unscaled: not 64 times the true norm
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in model.parameters()])
        )
        assert float(total) <= 1.01e-3
        opt.step()
