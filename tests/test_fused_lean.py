"""The compiled lean kahan step (``mixprec.kernels.compiled``) and its use by
``LeanUpdates``: the eager reference against float64 AdamW, compiled against eager,
the skip, checkpoints shared with the eager lean step, and when it is (not) taken."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import re
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import LossScaleOptimizer
from mixprec.kernels import compiled as compiled_steps
from mixprec.kernels import join8_bits, kahan_adamw_
from mixprec.kernels.adamw import (
    COMPENSATED,
    FLOAT32_MASTERS,
    LOW_BITS8,
    LOW_BITS8_MOMENTS8,
    STOCHASTIC_ROUNDING,
    masters_adamw_math_,
)
from mixprec.kernels.compiled import lean_adamw_fused_
from mixprec.optim import AdamW8bit
from mixprec.optim.masters import LeanUpdates
from mixprec.optim.masters._fused import fused_adamw_unsupported

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _model(seed: int = 0) -> torch.nn.Module:
    """bfloat16 linears around a float32 LayerNorm (kept in float32, as O3 keeps it).
    Four tensors, three shapes of block (whole, partial, a 4-element bias): each is a
    loop of the compiled steps, several seconds of compiling on a CPU for the 8-bit one."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False),
                                torch.nn.LayerNorm(32, bias=False), torch.nn.Linear(32, 4))  # fmt: skip
    model[0].bfloat16()
    model[2].bfloat16()
    return model


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = model[1](model[0](x.to(model[0].weight.dtype)).float())
    return ((model[2](h.to(model[2].weight.dtype)).float() - y) ** 2).mean()


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g))
            for _ in range(steps)]  # fmt: skip


def _train(model, lean, opt, data, found_inf=None):
    for x, y in data:
        opt.zero_grad()
        _loss(model, x, y).backward()
        lean.eager_step(torch.zeros(()) if found_inf is None else found_inf, True, None)


def _lean(model, fused):
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    return opt, LeanUpdates(opt, "kahan", fused=fused)


@pytest.fixture(scope="module")
def trained():
    """The same 25 steps three ways: the fused (compiled) lean step, the eager lean
    step, and float32 AdamW on a float32 copy of the model."""
    data = _data(25)
    fused_model, eager_model = _model(), _model()
    reference = copy.deepcopy(fused_model).float()
    fused_opt, fused = _lean(fused_model, True)
    eager_opt, eager = _lean(eager_model, False)
    _train(fused_model, fused, fused_opt, data)
    _train(eager_model, eager, eager_opt, data)
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)
    for x, y in data:
        ref_opt.zero_grad()
        _loss(reference, x, y).backward()
        ref_opt.step()
    return {"fused": (fused_model, fused_opt, fused), "eager": (eager_model, eager_opt, eager),
            "reference": reference, "data": data}  # fmt: skip


def _masters(model, lean):
    comp = dict(zip(map(id, lean._low), lean.compensation))
    return [p.detach().float() + (comp[id(p)].float() if id(p) in comp else 0)
            for p in model.parameters()]  # fmt: skip


def test_eager_reference_keeps_updates_that_bfloat16_rounds_away():
    """Against float64 AdamW on the same gradients: the compensated weight follows it
    to float32-like accuracy, where plain bfloat16 AdamW stalls."""
    torch.manual_seed(0)
    start = torch.randn(256) + 4.0  # bfloat16 ulp 2**-5 here: AdamW's 1e-3 steps round away
    w = start.bfloat16()
    c, m, v, step = torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    exact = w.double()
    em, ev = torch.zeros_like(exact), torch.zeros_like(exact)
    plain = w.clone()
    plain_opt = torch.optim.AdamW([plain], lr=1e-3, weight_decay=0.0)
    hyper = torch.tensor([1e-3, 0.9, 0.999, 1e-8], dtype=torch.float64)
    for t in range(1, 101):
        g = torch.randn(256).bfloat16()
        kahan_adamw_([w], [c], [g], [m], [v], [step], [torch.ones(1)], [hyper], torch.zeros(()))
        em = 0.9 * em + 0.1 * g.double()
        ev = 0.999 * ev + 0.001 * g.double() ** 2
        exact -= 1e-3 / (1 - 0.9**t) * em / (ev.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8)
        plain.grad = g
        plain_opt.step()
    assert float(step) == 100
    kahan_error = (w.double() + c.double() - exact).abs().max()
    plain_error = (plain.double() - exact).abs().max()
    assert kahan_error < 2e-3 < plain_error  # bfloat16 moments bound the former
    assert kahan_error < plain_error / 10


def test_an_input_with_other_strides_compiles_again_and_steps_right(trained):
    # The generated code checks no sizes or strides (dynamo's guards did): a gradient
    # laid out otherwise (same shape, transposed strides) must get a graph of its own,
    # not the one the fixture's steps compiled for contiguous gradients.
    model, opt, _ = trained["fused"]
    lists = _step_lists(model, opt)
    lists[2][0] = lists[2][0].t().contiguous().t()
    assert not lists[2][0].is_contiguous()
    _assert_compiled_steps_as_eager(lists)


def test_compiled_step_matches_its_eager_reference(trained):
    model, opt, _ = trained["fused"]
    _assert_compiled_steps_as_eager(_step_lists(model, opt))


def _assert_compiled_steps_as_eager(lists):
    """One compiled kahan step of ``lists`` against :func:`kahan_adamw_` on a copy:
    every tensor within its dtype's epsilon times its largest magnitude (at least 1)."""
    eager = copy.deepcopy(lists)
    found = torch.zeros(())
    kahan_adamw_(*eager, found)
    lean_adamw_fused_(COMPENSATED, *lists, found)
    for got, want in zip(lists, eager):
        for a, b in zip(got, want):
            if a is not None:
                assert torch.allclose(a.float(), b.float(), rtol=0, atol=float(
                    torch.finfo(b.dtype).eps * b.float().abs().max().clamp(min=1)))  # fmt: skip


def _step_lists(model, opt):
    """Inputs of one fused step: each parameter's tensors, cloned."""
    weights = [p.detach().clone() for p in model.parameters()]
    comps = [w.clone().zero_().add_(1e-4) if w.dtype == torch.bfloat16 else None for w in weights]
    torch.manual_seed(3)
    grads = [torch.randn_like(w) for w in weights]
    states = [opt.state[p] for p in model.parameters()]
    return ([weights, comps, grads, [s["exp_avg"].clone() for s in states],
             [s["exp_avg_sq"].clone() for s in states], [s["step"].clone() for s in states],
             [torch.full((1,), 0.999) for _ in weights],
             [torch.tensor([1e-3, 0.9, 0.999, 1e-8], dtype=torch.float64)] * len(weights)])


def test_fused_lean_trains_like_the_eager_lean_step_and_float32(trained):
    fused, eager = _masters(*trained["fused"][::2]), _masters(*trained["eager"][::2])
    reference = [p.detach() for p in trained["reference"].parameters()]
    for f, e, r in zip(fused, eager, reference):
        scale = r.abs().max()
        # One rounding fewer than the eager lean step: at least as close to float32.
        assert (f - r).abs().max() <= 1.5 * (e - r).abs().max() + 1e-6 * scale
        assert (f - r).abs().max() < 0.01 * scale


def test_state_is_torch_adamw_state_and_checkpoints_move_between_paths(trained):
    model, opt, lean = trained["fused"]
    eager_model, eager_opt, eager = trained["eager"]
    for p, q in zip(model.parameters(), eager_model.parameters()):
        got, want = opt.state[p], eager_opt.state[q]
        assert set(got) == set(want) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(got[k].dtype == want[k].dtype and got[k].shape == want[k].shape for k in got)
        assert float(got["step"]) == 25.0
    # The fused run's checkpoint continues on the eager path, and the other way round.
    clone = _model()
    clone.load_state_dict(model.state_dict())
    clone_opt, clone_lean = _lean(clone, False)
    clone_opt.load_state_dict(opt.state_dict())
    clone_lean.load_state_dict(lean.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(clone_lean.compensation, lean.compensation))
    _train(clone, clone_lean, clone_opt, _data(2))
    assert float(clone_opt.state[clone[0].weight]["step"]) == 27.0


def test_a_skipped_step_changes_nothing_and_a_skipped_first_step_creates_no_state(trained):
    model, opt, lean = trained["fused"]
    before = copy.deepcopy((model.state_dict(), opt.state_dict(), lean.state_dict()))
    x, y = trained["data"][0]
    opt.zero_grad()
    _loss(model, x, y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    assert lean.eager_step(torch.ones(()), True, None) is False  # no host sync
    after = (model.state_dict(), opt.state_dict(), lean.state_dict())
    assert _equal(before, after)

    fresh = _model()
    fresh_opt, fresh_lean = _lean(fresh, True)
    _loss(fresh, x, y).backward()
    assert fresh_lean.eager_step(torch.ones(()), True, None) is True  # the host saw the skip
    assert not fresh_opt.state


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_a_new_learning_rate_does_not_compile_again(trained):
    model, opt, lean = trained["fused"]
    compiled = compiled_steps._compiled("kahan")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for lr in (2e-3, 5e-4):
        for group in opt.param_groups:
            group["lr"] = lr
        _train(model, lean, opt, trained["data"][:1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    assert compiled_steps._compiled("kahan") is compiled


def test_a_process_stepping_more_models_than_dynamos_recompile_limit_still_steps():
    """Each model layout is a graph; past dynamo's recompile limit (8, here 1) a new
    one compiles under mixprec's own limit instead of failing (fullgraph=True)."""
    hyper = [torch.tensor([1e-3, 0.9, 0.999, 1e-8], dtype=torch.float64)]
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (3, 5):  # two layouts: the second is past the limit
            w = torch.ones(n)
            m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
            lean_adamw_fused_(COMPENSATED, [w], [None], [torch.ones(n)], [m], [v], [step],
                              [torch.ones(1)], hyper, torch.zeros(()))  # fmt: skip
            assert float(step) == 1 and bool(w.lt(1).all())


def test_under_a_dispatch_mode_the_eager_math_runs_and_the_mode_sees_it(trained, monkeypatch):
    model, opt, lean = trained["fused"]

    class Ops(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    before = [float(state["step"]) for state in opt.state.values()]
    with Ops() as mode:
        _train(model, lean, opt, trained["data"][:1])
    assert "sqrt" in mode.seen
    # Under a dispatch mode the CPU takes a GPU's ways (mixprec.numerics.cpu_shortcuts):
    # the step counts advance apart from the math, in one foreach op ...
    assert [float(state["step"]) for state in opt.state.values()] == [b + 1 for b in before]
    assert "_foreach_add_" in mode.seen
    # ... where, unwatched, the CPU's compiled math advances them itself: no foreach op.
    adds = []
    real_add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a, **k: adds.append(a) or real_add(*a, **k))
    _train(model, lean, opt, trained["data"][:1])
    assert [float(state["step"]) for state in opt.state.values()] == [b + 2 for b in before]
    assert adds == []


def test_a_profiler_sees_the_step_as_one_named_range():
    # The range is opened only while a profiler records (it costs microseconds a step).
    # Under a dispatch mode the eager math runs, so nothing compiles here.
    class Quiet(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    args = step_arguments("kahan", ((4, 3),))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with Quiet():
            lean_adamw_fused_(COMPENSATED, *args)
    assert "mixprec.lean_adamw" in [event.name for event in prof.events()]


def test_when_the_fused_step_is_taken():
    model = _model()
    opt, lean = _lean(model, None)
    assert not lean._fuses(None)  # fused=None: a GPU's default, eager on a CPU
    lean.fused = True
    assert lean._fuses(None)
    assert not lean._fuses({"closure": None})  # step() keyword arguments: the inner step
    handle = opt.register_step_post_hook(lambda *_: None)
    assert not lean._fuses(None)  # the inner optimizer's hooks must run: its own step
    handle.remove()
    assert lean._fuses(None)


@pytest.mark.parametrize(
    ("make", "mode", "match"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "kahan", "SGD is not torch.optim.AdamW"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "kahan", "amsgrad"),
        (lambda ps: torch.optim.Adagrad(ps), "stochastic", "Adagrad is not torch.optim.AdamW"),
        (lambda ps: AdamW8bit(ps), "kahan", "AdamW8bit steps fused only under master_weights='split8'"),
    ],
)
def test_fused_true_refuses_what_it_cannot_run(make, mode, match):
    model = _model()
    opt = make(model.parameters())
    with pytest.raises(ValueError, match=match):
        LeanUpdates(opt, mode, fused=True)
    with pytest.raises(TypeError, match="fused"):
        LeanUpdates(torch.optim.AdamW(model.parameters()), "kahan", fused="yes")  # type: ignore[arg-type]


def test_an_lr_scheduler_on_the_inner_optimizer_sees_its_step(trained):
    model, opt, lean = trained["fused"]
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, lean, opt, trained["data"][:1])
        scheduler.step()


def test_loss_scale_optimizer_takes_the_fused_step_with_its_options(trained, monkeypatch):
    """Through LossScaleOptimizer: decoupled decay and skip on a non-finite gradient,
    which the step finds itself (no norm of the gradients apart from it)."""
    norms = []
    real_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: norms.append(a) or real_norm(*a, **k))
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    opt = LossScaleOptimizer(inner, loss_scale=None, master_weights="kahan", weight_decay=0.01)
    opt._master.fused = True
    for x, y in trained["data"][:3]:
        opt.zero_grad()
        opt.scale_loss(_loss(model, x, y)).backward()
        opt.step()
    assert int(opt.iterations) == 3 and float(inner.state[model[0].weight]["step"]) == 3
    assert norms  # the first step's check, which must know before it creates state
    norms.clear()
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    opt.scale_loss(_loss(model, *trained["data"][0]) * float("inf")).backward()
    opt.step()
    assert int(opt.skipped_steps) == 1 and _equal(before, model.state_dict())
    assert norms == []


# ----------------------------------------------------------------------------- stochastic


def test_the_fused_stochastic_rounding_is_unbiased_and_compiles_to_its_eager_bits():
    """A first AdamW step of ``lr`` moves every weight by ``lr`` (``m / sqrt(v)`` is 1):
    0.3 of a bfloat16 ulp at 1.0, so about 30 % of the weights round up, 70 % stay."""
    n, ulp = 1 << 16, 2.0**-7
    seed, found = torch.tensor([11]), torch.zeros(())
    hyper = torch.tensor([0.3 * ulp, 0.9, 0.999, 1e-12], dtype=torch.float64)

    def step(math):
        w = torch.ones(n, dtype=torch.bfloat16)
        m, v, count = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
        g = torch.full_like(w, -1.0)
        math(STOCHASTIC_ROUNDING, [w], [seed], [g], [m], [v], [count], [torch.ones(1)], [hyper], found)
        return w

    eager, compiled = step(masters_adamw_math_), step(compiled_steps._compiled(STOCHASTIC_ROUNDING))
    up = float((eager.float() - 1).div(ulp).mean())
    assert set((eager.float() - 1).div(ulp).unique().tolist()) == {0.0, 1.0}
    assert abs(up - 0.3) < 0.01  # ~5 standard deviations of the mean over 65536 draws
    assert torch.equal(eager, compiled)  # the same noise: hashed, not drawn


def _stochastic(model, fused, seed=0):
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    return opt, LeanUpdates(opt, "stochastic", seed=seed, fused=fused)


def test_fused_stochastic_trains_as_the_eager_step_does_and_resumes_exactly(trained):
    """Against float32 AdamW: as close as the eager stochastic step (another random
    stream). A checkpoint of the generator continues with the same noise."""
    data, reference = trained["data"], [p.detach() for p in trained["reference"].parameters()]
    runs = {}
    for fused in (True, False):
        model = _model()
        opt, lean = _stochastic(model, fused)
        _train(model, lean, opt, data)
        runs[fused] = (model, opt, lean)
    # The mean error over every weight: per tensor, a 4-element bias is a coin toss.
    errors = {fused: torch.cat([(p.detach().float() - r).abs().flatten()
                                for p, r in zip(runs[fused][0].parameters(), reference)]).mean()
              for fused in runs}  # fmt: skip
    assert errors[True] <= 2 * errors[False]
    model, opt, lean = runs[True]
    clone = _model()
    clone.load_state_dict(model.state_dict())
    clone_opt, clone_lean = _stochastic(clone, True)
    # Copies, as from a file: torch's AdamW loads a live state's tensors without copying.
    clone_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    clone_lean.load_state_dict(copy.deepcopy(lean.state_dict()))
    _train(model, lean, opt, data[:2])
    _train(clone, clone_lean, clone_opt, data[:2])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters()))


def test_a_skipped_fused_stochastic_step_changes_no_weight_or_moment(trained):
    model = _model()
    opt, lean = _stochastic(model, True)
    _train(model, lean, opt, trained["data"][:2])
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    opt.zero_grad()
    _loss(model, *trained["data"][0]).backward()
    assert lean.eager_step(torch.ones(()), True, None) is False  # skipped on the device
    assert _equal(before, (model.state_dict(), opt.state_dict()))


# ------------------------------------------------------- split8 and float32 masters (O2)

#: "split8-8bit": split8 masters around AdamW8bit (its default stochastic codes).
MASTER_MODES = ("split8", "fp32", "split8-8bit")


def _masters_opt(model, fused, mode="split8", **options):
    if mode == "split8-8bit":
        inner = AdamW8bit(model.parameters(), **HYPER)
    else:
        inner = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    master_weights = mode.removesuffix("-8bit")
    opt = LossScaleOptimizer(inner, loss_scale=None, master_weights=master_weights, **options)
    opt._master.fused = fused
    return opt


class _Eager(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it the fused step runs its eager math."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _train_masters(model, opt, data, clip=False, eager_math=False):
    for x, y in data:
        opt.zero_grad()
        opt.scale_loss(_loss(model, x, y)).backward()
        if clip:  # torch's clipping recipe: the masters are shown, so the step is eager
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with _Eager() if eager_math else contextlib.nullcontext():
            opt.step()


def _float32_masters(opt) -> list[torch.Tensor]:
    """The masters as float32 values: split8's rebuilt from weight and correction."""
    master = opt._master
    if getattr(master, "mode", "fp32") == "split8":
        return [join8_bits(p.detach(), q) for (p, _), q in zip(master._low, master.corrections)]
    return [m.detach().clone() for _, m in master._low]


#: split8-8bit's fused step compiles for about a minute of CPU with a cold cache (the
#: 8-bit codes' loops): its training runs with ``-m slow``; its compiled code is checked
#: by ``test_compiled_steps_keep_no_parameter_sized_buffer_and_no_power_in_their_loops``.
@pytest.fixture(scope="module", params=[
    pytest.param(mode, marks=[pytest.mark.slow] if mode == "split8-8bit" else [])
    for mode in MASTER_MODES])  # fmt: skip
def masters_trained(request):
    """20 steps fused (compiled), eager, and (split8-8bit) the fused step's own eager
    math: AdamW8bit's eager step draws its rounding noise otherwise."""
    data = _data(20)
    runs = {}
    for run in (True, False, "reference"):
        if run == "reference" and request.param != "split8-8bit":
            continue
        model = _model()
        opt = _masters_opt(model, run is not False, request.param)
        taken = []
        for x, y in data:
            opt.zero_grad()
            opt.scale_loss(_loss(model, x, y)).backward()
            taken.append(opt._fuses(None))
            if run == "reference":
                with _Eager():
                    opt.step()
            else:
                opt.step()
        runs[run] = (model, opt, taken)
    return runs, data, request.param


def test_fused_masters_step_as_the_eager_masters_do(masters_trained):
    runs, data, mode = masters_trained
    (fused, fused_opt, taken), (eager, eager_opt, not_taken) = runs[True], runs[False]
    assert all(taken) and not any(not_taken)
    if mode == "split8-8bit":  # the same training; the reference is the eager math
        with torch.no_grad():
            losses = [float(_loss(m, *data[0])) for m in (fused, eager, _model())]
        assert abs(losses[0] - losses[1]) < 0.01 * losses[1] and losses[0] < losses[2] - 0.05
        eager, eager_opt, _ = runs["reference"]
    for p, q in zip(fused.parameters(), eager.parameters()):
        if p.dtype == torch.bfloat16:  # the same rounded weights (FMA may move a tie)
            assert (p.float() - q.float()).abs().le(p.float().abs() * 2**-7).all()
        else:
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    for a, b in zip(_float32_masters(fused_opt), _float32_masters(eager_opt)):
        # split8: within 2 codes of the correction (1/254 of an ulp each); float32: rounding
        assert torch.allclose(a, b, rtol=2**-14 if mode != "fp32" else 1e-5, atol=1e-7)
    # The model's weights are the masters rounded, and no float32 master gradient was
    # made (split8: no master either; the masters stay released).
    for (p, _), m in zip(fused_opt._master._low, _float32_masters(fused_opt)):
        assert torch.equal(p.detach(), m.to(p.dtype))
    low = [m for _, m in fused_opt._master._low]
    assert all(m.grad is None for m in low)
    if mode != "fp32":
        assert all(m.numel() == 0 for m in low)
    if mode == "split8-8bit":  # the codes: a float32 FMA may move one across a boundary
        for key in ("exp_avg_q", "exp_avg_sq_q"):
            codes = [(fused_opt.inner_optimizer.state[m][key], eager_opt.inner_optimizer.state[n][key])
                     for m, n in zip(low, (m for _, m in eager_opt._master._low))]  # fmt: skip
            same = sum(int(a.eq(b).sum()) for a, b in codes)
            assert same >= 0.999 * sum(a.numel() for a, _ in codes)
            assert all((a.int() - b.int()).abs().max() <= 1 for a, b in codes)


def test_fused_masters_checkpoints_load_into_the_eager_step_and_back(masters_trained):
    runs, data, mode = masters_trained
    model, opt, _ = runs[True]
    for fused in (False, True):
        clone = _model()
        clone.load_state_dict(model.state_dict())
        clone_opt = _masters_opt(clone, fused, mode)
        clone_opt.load_state_dict(opt.state_dict())
        assert all(torch.equal(a, b) for a, b in
                   zip(_float32_masters(clone_opt), _float32_masters(opt)))  # fmt: skip
        _train_masters(clone, clone_opt, data[:2])
        assert int(clone_opt.iterations) == int(opt.iterations) + 2


@pytest.mark.parametrize("mode", [  # split8-8bit compiles for a minute (``masters_trained``)
    pytest.param(mode, marks=[pytest.mark.slow] if mode == "split8-8bit" else [])
    for mode in MASTER_MODES])  # fmt: skip
def test_fused_masters_fold_the_wrappers_weight_decay_into_one_factor(mode):
    """``1 - lr * (a + b)`` where the eager step multiplies ``(1 - lr * a)(1 - lr * b)``:
    the same to within float32 rounding a step."""
    runs = []
    for fused in (True, False):
        model = _model()
        # split8-8bit: against the fused step's eager math (the same rounding noise)
        opt = _masters_opt(model, fused or mode == "split8-8bit", mode, weight_decay=0.5)
        _train_masters(model, opt, _data(3), eager_math=not fused)
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.allclose(p.float(), q.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("mode", MASTER_MODES)
@pytest.mark.parametrize(
    ("options", "clip"),
    [({}, True), ({"clipnorm": 1.0}, False), ({"gradient_accumulation_steps": 2}, False)],
)
def test_steps_that_need_float32_master_gradients_take_the_eager_path(
    mode, options, clip, monkeypatch
):
    model = _model()
    opt = _masters_opt(model, True, mode, **options)
    monkeypatch.setattr(opt._master, "fused_step", None)  # any fused step would fail
    before = [p.detach().clone() for p in model.parameters()]
    _train_masters(model, opt, _data(2), clip=clip)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fused_masters_skip_a_nonfinite_step_and_change_nothing(masters_trained, monkeypatch):
    runs, data, _ = masters_trained
    model, opt, _ = runs[True]
    before = copy.deepcopy((model.state_dict(), opt.inner_optimizer.state_dict(),
                            _float32_masters(opt)))  # fmt: skip
    skipped = int(opt.skipped_steps)
    norms = []  # the step checks the gradients in its own graph: no norm apart from it
    real_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: norms.append(a) or real_norm(*a, **k))
    opt.zero_grad()
    opt.scale_loss(_loss(model, *data[0]) * float("nan")).backward()
    opt.step()
    assert bool(opt.last_step_skipped) and int(opt.skipped_steps) == skipped + 1
    assert norms == []
    after = (model.state_dict(), opt.inner_optimizer.state_dict(), _float32_masters(opt))
    # AdamW8bit draws its rounding seed before the host knows of the skip, as its
    # eager step draws its noise: the generator moves on, nothing else does.
    for state in (before[1], after[1]):
        state.pop("rng", None)
    assert _equal(before, after)


@pytest.mark.parametrize("setting", ["first step", "skip_nonfinite=False"])
def test_fused_masters_check_apart_where_the_step_cannot(setting):
    """A first step checks before it creates state (a skipped one leaves none) and
    compiles the graph every later step runs (one graph); a run that applies non-finite
    steps checks nothing. Both as the eager masters do."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3, bias=False).bfloat16()  # a layout of its own
    opt = _masters_opt(model, True, "fp32", skip_nonfinite=setting == "first step")
    x = torch.randn(4, 8).bfloat16()

    def step(scale: float) -> None:
        opt.zero_grad()
        opt.scale_loss(model(x).float().pow(2).mean() * scale).backward()
        opt.step()

    if setting == "first step":
        step(float("inf"))
        assert bool(opt.last_step_skipped) and not opt.inner_optimizer.state
        graphs = counters["stats"]["unique_graphs"]
        for _ in range(3):
            step(1.0)
        assert int(opt.iterations) == 3 and counters["stats"]["unique_graphs"] == graphs + 1
    else:
        step(1.0)  # state exists from here on
        step(float("inf"))
        assert not bool(opt.last_step_skipped) and int(opt.skipped_steps) == 0
        assert not torch.isfinite(model.weight).all()  # applied, as asked

def test_fused_float32_masters_adopt_a_model_loaded_after_initialize():
    """The model is the truth: weights loaded into it between steps are what the fused
    step starts from, as the eager step's masters adopt them."""
    donor = _model(seed=5)
    runs = []
    for fused in (True, False):
        model = _model()
        opt = _masters_opt(model, fused, "fp32")
        _train_masters(model, opt, _data(2))
        model.load_state_dict(donor.state_dict())
        _train_masters(model, opt, _data(1))
        runs.append((model, _float32_masters(opt)))
    (fused, fused_masters), (eager, eager_masters) = runs
    for a, b in zip(fused_masters, eager_masters):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    one_step = [w.float() for w in donor.parameters()]
    moved = [(a.float() - b).abs().max() for a, b in zip(fused.parameters(), one_step)]
    assert max(moved) < 0.05  # one step from the loaded weights, not from the old ones


def test_fused_float32_masters_keep_an_ema_as_the_eager_step_does():
    runs = []
    for fused in (True, False):
        model = _model()
        opt = _masters_opt(model, fused, "fp32", use_ema=True, ema_momentum=0.5)
        _train_masters(model, opt, _data(4))
        live = [p.detach().clone() for p in model.parameters()]
        opt.copy_ema_to_params()
        assert any(not torch.equal(a, p) for a, p in zip(live, model.parameters()))
        runs.append(model)
    for p, q in zip(*(m.parameters() for m in runs)):
        assert torch.allclose(p.float(), q.float(), rtol=2**-7, atol=1e-6)


def test_split_masters_have_no_fused_step():
    model = _model()
    model[1].bfloat16()  # "split" needs every parameter in bfloat16
    opt = _masters_opt(model, True, "split")
    assert not opt._master.fuses() and not opt._fuses(None)


@pytest.mark.slow  # compiles split8-8bit's fused step (see ``masters_trained``)
def test_fused_split8_8bit_resumes_bit_exactly_and_its_seed_is_checkpointed():
    data = _data(6)
    model = _model()
    opt = _masters_opt(model, True, "split8-8bit")
    _train_masters(model, opt, data[:3])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train_masters(model, opt, data[3:])
    clone = _model(seed=3)
    clone_opt = _masters_opt(clone, True, "split8-8bit")
    clone.load_state_dict(saved[0])
    clone_opt.load_state_dict(saved[1])
    _train_masters(clone, clone_opt, data[3:])
    assert _equal(model.state_dict(), clone.state_dict())
    assert _equal(opt.state_dict(), clone_opt.state_dict())
    # Another seed is other rounding noise: the run is the generator's, not fixed.
    other = _model()
    other_opt = _masters_opt(other, True, "split8-8bit")
    other_opt.inner_optimizer.seed = 1
    _train_masters(other, other_opt, data)
    codes = [other_opt.inner_optimizer.state[m]["exp_avg_q"] for _, m in other_opt._master._low]
    mine = [opt.inner_optimizer.state[m]["exp_avg_q"] for _, m in opt._master._low]
    assert not all(torch.equal(a, b) for a, b in zip(codes, mine))


def test_adamw8bit_steps_fused_only_under_split8_masters():
    """Float32 masters (O2) around AdamW8bit take the eager step even when asked to fuse:
    the fused 8-bit step is split8's."""
    model = _model()
    opt = _masters_opt(model, True, "split8-8bit")
    assert opt._master._fused_mode == LOW_BITS8_MOMENTS8 and opt._master.fuses()
    inner = AdamW8bit(_model().parameters(), **HYPER)
    o2 = LossScaleOptimizer(inner, loss_scale=None, master_weights="fp32")
    o2._master.fused = True
    assert not o2._master.fuses()
    assert "split8" in fused_adamw_unsupported(inner, FLOAT32_MASTERS)
    assert fused_adamw_unsupported(torch.optim.AdamW([torch.ones(1)]), LOW_BITS8_MOMENTS8) is not None


@pytest.mark.slow  # compiles split8-8bit's fused step (see ``masters_trained``)
def test_the_fused_8bit_step_refuses_a_loaded_state_of_another_size():
    model = _model()
    opt = _masters_opt(model, True, "split8-8bit")
    _train_masters(model, opt, _data(1))
    key = opt._master._low[0][1]
    state = opt.inner_optimizer.state[key]
    state["exp_avg_q"] = state["exp_avg_q"][:256]  # as if saved from a smaller model
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="saved from another model"):
        _train_masters(model, opt, _data(1))
    assert _equal(before, model.state_dict())


# ----------------------------------------------------------------------------- what compiles


#: The kernels' weight format of each mode's fused step (what the masters pass them).
FORMAT = {"kahan": COMPENSATED, "stochastic": STOCHASTIC_ROUNDING, "fp32": FLOAT32_MASTERS,
          "split8": LOW_BITS8, "split8-8bit": LOW_BITS8_MOMENTS8}  # fmt: skip


def step_arguments(mode: str, shapes: tuple, device: str = "cpu") -> tuple:
    """One step's arguments of ``mode``'s math (its kernel format: :data:`FORMAT`) for
    bfloat16 parameters of ``shapes``."""
    args: list[list] = [[] for _ in range(8)]
    for shape in shapes:
        w = torch.randn(shape, device=device).bfloat16()
        moment = torch.float32 if mode == "split8" else torch.bfloat16
        m, v = torch.zeros_like(w, dtype=moment), torch.ones_like(w, dtype=moment)
        seed = torch.tensor([5], device=device)
        extra: object = {"kahan": torch.zeros_like(w), "stochastic": seed, "fp32": w.clone(),
                         "split8": torch.zeros_like(w, dtype=torch.int8)}.get(mode)  # fmt: skip
        if mode == "fp32":
            w = w.float()
        if mode == "split8-8bit":
            state = AdamW8bit([torch.nn.Parameter(w.float())])._fresh_state(w.numel(), w.device)
            extra = (torch.zeros_like(w, dtype=torch.int8), seed)
            m = (state["exp_avg_q"], state["exp_avg_scale"])
            v = (state["exp_avg_sq_q"], state["exp_avg_sq_scale"])
        hyper = torch.tensor([1e-3, 0.9, 0.999, 1e-8], dtype=torch.float64, device=device)
        row = (w, extra, torch.randn_like(w).bfloat16(), m, v, torch.ones((), device=device),
               torch.ones(1, device=device), hyper)  # fmt: skip
        for column, value in zip(args, row):
            column.append(value)
    return (*args, torch.zeros((), device=device))


@pytest.mark.parametrize("mode", ["kahan", "split8-8bit"] + [
    pytest.param(mode, marks=pytest.mark.slow) for mode in ("stochastic", "fp32", "split8")])
def test_compiled_steps_keep_no_parameter_sized_buffer_and_no_power_in_their_loops(mode):
    """Each tensor is read and written in registers: the compiled step allocates nothing
    of a parameter's size (the 8-bit step's block scales and each parameter's bias
    corrections only), and the bias corrections' float64 powers are computed once per
    parameter, not in every vector of a loop; no loop copies a result out of a buffer
    (the 8-bit step did, when its step counts were written in the graph). A loop runs
    on two threads only where each gets ``cpu_min_chunk`` elements (``compile_math``'s
    default; kahan: a 4096-element loop on one, where inductor's own threshold would
    wake the other thread for it). The step as a CPU runs it: its counts advanced in
    the loop (``steps_in_loop``), but for the 8-bit step's."""
    from torch._inductor.utils import run_and_get_code

    # (40, 25): a partial 8-bit block. Two threads, whatever this machine has.
    shapes = ((40, 25), (64, 64), (2, 16384)) if mode == "kahan" else ((40, 25),)
    with torch._inductor.config.patch({"fx_graph_cache": False, "cpp.threads": 2}):
        _, (code, *_) = run_and_get_code(
            compiled_steps.compile_math(FORMAT[mode]), FORMAT[mode], *step_arguments(mode, shapes),
            steps_in_loop=mode != "split8-8bit")  # fmt: skip
    allocations = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", code)
    allocated = [math.prod(int(d) for d in shape.split(",") if d.strip()) for shape in allocations]
    assert all(numel <= 1000 // 256 + 1 for numel in allocated), allocations
    loops = _loop_bodies(code)
    assert loops and not any("std::pow" in loop for loop in loops)
    assert "assert_size_stride(" not in code  # dynamo's guards check the inputs' layout
    assert not _copy_loops(code)  # each output written in place, not copied out of a buffer
    parallel, serial = _loop_bounds(code)
    min_chunk = inspect.signature(compiled_steps.compile_math).parameters["cpu_min_chunk"].default
    assert all(n // 2 >= min_chunk for n in parallel), parallel
    if mode == "kahan":
        assert parallel == [32768] and {1000, 4096} <= set(serial), (parallel, serial)


def _copy_loops(code: str) -> list[str]:
    """The generated loops that only copy: one value loaded, stored elsewhere."""
    copies = []
    for body in _loop_bodies(code):
        values = re.findall(r"auto (tmp\d+) =", body)
        if len(values) == 1 and f"{values[0]}.store(" in body:
            copies.append(body)
    return copies


def _loop_bounds(code: str) -> tuple[list[int], list[int]]:
    """The constant bounds of the generated C++ loops, (those an OpenMP ``for`` splits
    between threads, the others)."""
    parallel: list[int] = []
    serial: list[int] = []
    found = re.finditer(r"(#pragma omp for)|for\(int64_t (\w+)=[^;]*; \2<static_cast<int64_t>\((\d+)L\)", code)
    split = False
    for match in found:
        if match.group(1):
            split = True
            continue
        (parallel if split else serial).append(int(match.group(3)))
        split = False
    return parallel, serial


def _loop_bodies(code: str) -> list[str]:
    """The bodies of the outermost ``for`` loops of inductor's C++ kernels."""
    bodies, at = [], 0
    while (start := code.find("for(int64_t", at)) >= 0:
        depth, end = 0, code.index("{", start)
        while True:
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                break
            end += 1
        bodies.append(code[start:end])
        at = end
    return bodies
