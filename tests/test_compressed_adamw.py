"""AdamW8bit: AdamW with 8-bit moments (mixprec.optim.AdamW8bit; its codecs are
mixprec.kernels.moments8's)."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.kernels import (
    dequantize_first_moment,
    dequantize_second_moment,
    noise_from_bits,
    quantize_first_moment,
    quantize_second_moment,
)
from mixprec.optim import AdamW8bit, LossScaleOptimizer


def test_first_moment_codes_within_their_resolution():
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(64, 256, generator=gen) * torch.logspace(-6, 2, 64).unsqueeze(1)
    m[3] = 0.0
    q, scale = quantize_first_moment(m)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_first_moment(q, scale)
    # Companding 2x/(1+|x|) has slope >= 1/2, so half a code (1/254) is <= 1/127 of the
    # block's absmax; near zero the slope is 2: 1/508.
    assert bool(((back - m).abs() <= scale.unsqueeze(1) / 127 * 1.0001).all())
    small = (m.abs() < 0.05 * scale.unsqueeze(1)) & (m != 0)
    assert bool(((back - m).abs()[small] <= (scale.unsqueeze(1) / 508 * 1.12).expand_as(m)[small]).all())
    assert torch.equal(back[3], torch.zeros(256))
    assert bool((torch.sign(back) * torch.sign(m) >= 0).all())  # no sign flips


def test_second_moment_codes_within_their_resolution_and_never_zero():
    gen = torch.Generator().manual_seed(1)
    v = (torch.randn(32, 256, generator=gen) * torch.logspace(-8, 1, 32).unsqueeze(1)).square()
    v[:, :4] = torch.tensor([1e-30, 1e-20, 0.0, 1e-12])  # tiny values beside large ones
    q, scale = quantize_second_moment(v)
    assert q.dtype == torch.uint8
    back = dequantize_second_moment(q, scale)
    root, back_root = v.sqrt(), back.sqrt()
    big = root >= scale.unsqueeze(1) / 510
    assert bool(((back_root - root).abs()[big] <= (scale.unsqueeze(1) / 510 * 1.0001).expand_as(v)[big]).all())
    assert bool((back[v > 0] > 0).all())  # never decoded as zero: m / sqrt(v) stays bounded
    assert bool((back[~big] >= v[~big]).all())  # the smallest are rounded up, never down
    assert bool((back[v == 0] == 0).all())


def test_stochastic_rounding_is_unbiased():
    gen = torch.Generator().manual_seed(3)
    m = torch.tensor([[1.0, 0.3, -0.0123, 0.5, -0.77, 0.0, 0.001, -1.0]]).repeat(4000, 1)
    v = m.square()
    q, _ = quantize_first_moment(m, torch.rand(m.shape, generator=gen))
    k, _ = quantize_second_moment(v, torch.rand(v.shape, generator=gen))
    x = m[0]
    exact_m = 2 * x / (1 + x.abs()) * 127
    exact_v = v[0].sqrt() * 255
    assert bool(((q.float().mean(0) - exact_m).abs() < 0.05).all())
    big = exact_v >= 1  # codes below 1 are floored at 1 (rounded up), by design
    assert bool(((k.float().mean(0) - exact_v).abs()[big] < 0.05).all())
    nearest, _ = quantize_first_moment(m[:1])
    assert bool(((q.int() - nearest.int()).abs() <= 1).all())  # one of the two neighbours


def reference_step(params, states, lr, betas, eps, decay, block):
    """AdamW8bit's step written per tensor and plainly: decode, float32 AdamW, encode."""
    beta1, beta2 = betas
    for p, s in zip(params, states):
        n = p.numel()
        padded = -(-n // block) * block
        g = torch.zeros(padded)
        g[:n] = p.grad.float().flatten()
        g = g.view(-1, block)
        m = dequantize_first_moment(s["m"].view(-1, block), s["ms"])
        v = dequantize_second_moment(s["v"].view(-1, block), s["vs"])
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        s["step"] += 1
        update = (m / (1 - beta1 ** s["step"])) / ((v / (1 - beta2 ** s["step"])).sqrt() + eps)
        w = p.detach().float().flatten() * (1 - lr * decay) - lr * update.flatten()[:n]
        with torch.no_grad():
            p.copy_(w.view(p.shape))
        q, s["ms"] = quantize_first_moment(m)
        s["m"] = q.flatten()
        q, s["vs"] = quantize_second_moment(v)
        s["v"] = q.flatten()


def make_params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(300,), (16, 40), (7,), (3, 5, 11)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def set_grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)


@pytest.mark.parametrize("chunk_size", [1 << 22, 512])  # one chunk; several
def test_step_matches_the_float32_math_reference(chunk_size):
    params, ref = make_params(), make_params()
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1, block_size=64, chunk_size=chunk_size,
                    rounding="nearest")  # fmt: skip
    states = [{"step": 0, "m": torch.zeros(-(-p.numel() // 64) * 64, dtype=torch.int8),
               "ms": torch.zeros(-(-p.numel() // 64)), "v": torch.zeros(
                   -(-p.numel() // 64) * 64, dtype=torch.uint8), "vs": torch.zeros(
                   -(-p.numel() // 64))} for p in ref]  # fmt: skip
    for step in range(6):
        set_grads(params, step)
        set_grads(ref, step)
        opt.step()
        reference_step(ref, states, 1e-2, (0.9, 0.999), 1e-8, 0.1, 64)
    for p, r, s in zip(params, ref, states):
        torch.testing.assert_close(p, r, rtol=0, atol=2e-6)  # 2e-4 of lr: op order
        got = opt.state[p]
        assert float(got["step"]) == s["step"] == 6
        torch.testing.assert_close(got["exp_avg_scale"], s["ms"], rtol=1e-6, atol=0)
        # Codes agree but for float rounding-order ties (rare, one code apart).
        assert int((got["exp_avg_q"].int() - s["m"].int()).abs().max()) <= 1
        assert int((got["exp_avg_sq_q"].int() - s["v"].int()).abs().max()) <= 1
        assert float((got["exp_avg_q"] != s["m"]).float().mean()) < 0.01


def test_tracks_torch_adamw_within_the_stated_tolerance():
    params, ref = make_params(seed=2), make_params(seed=2)
    opt = AdamW8bit(params, lr=1e-3, weight_decay=0.01)
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01)
    steps = 30
    for step in range(steps):
        set_grads(params, step)
        set_grads(ref, step)
        opt.step()
        torch_opt.step()
    for p, r in zip(params, ref):
        s, t = opt.state[p], torch_opt.state[r]
        n = p.numel()
        m = dequantize_first_moment(s["exp_avg_q"].view(-1, 256), s["exp_avg_scale"]).flatten()[:n]
        v = dequantize_second_moment(s["exp_avg_sq_q"].view(-1, 256), s["exp_avg_sq_scale"]).flatten()[:n]
        exp_avg, exp_avg_sq = t["exp_avg"].flatten(), t["exp_avg_sq"].flatten()
        # Stated tolerance after 30 steps: the decoded moments within 5 % of the largest
        # float32 moment of the tensor, the parameters within 10 % of lr * steps.
        assert float((m - exp_avg).abs().max()) <= 0.05 * float(exp_avg.abs().max())
        assert float((v.sqrt() - exp_avg_sq.sqrt()).abs().max()) <= 0.05 * float(exp_avg_sq.sqrt().max())
        assert float((p - r).detach().abs().max()) <= 0.1 * 1e-3 * steps


def test_low_precision_parameters_are_rounded_once_and_scales_stay_float32():
    params = make_params(dtype=torch.bfloat16)
    opt = AdamW8bit(params, lr=1e-2)
    set_grads(params, 0)
    opt.step()
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(opt.state[p]["exp_avg_scale"].dtype == torch.float32 for p in params)


def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resumes_bit_exactly(dtype):
    params = make_params(dtype=dtype)
    opt = AdamW8bit(params, lr=1e-2)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    saved = save_load({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()})
    for step in range(3, 6):
        set_grads(params, step)
        opt.step()
    resumed = [torch.nn.Parameter(t) for t in saved["params"]]
    ropt = AdamW8bit(resumed, lr=1e-2)
    ropt.load_state_dict(saved["opt"])
    assert ropt.state[resumed[0]]["exp_avg_scale"].dtype == torch.float32  # not bfloat16
    # The codes keep their 8 bits (torch's load would cast them to the parameter's dtype).
    assert ropt.state[resumed[0]]["exp_avg_q"].dtype == torch.int8
    assert ropt.state[resumed[0]]["exp_avg_sq_q"].dtype == torch.uint8
    for step in range(3, 6):
        set_grads(resumed, step)
        ropt.step()
    for p, r in zip(params, resumed):
        assert torch.equal(p, r)
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], ropt.state[r][key])


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": -1.0}, "lr"),
    ({"betas": (1.0, 0.9)}, "betas"),
    ({"betas": "0.9"}, "betas"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": 2.5}, "block_size"),
    ({"block_size": 256, "chunk_size": 100}, "chunk_size"),
    ({"rounding": "down"}, "rounding"),
    ({"seed": -1}, "seed"),
    ({"fused": "yes"}, "fused"),
    ({"fused": 1}, "fused"),
])  # fmt: skip
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AdamW8bit([torch.nn.Parameter(torch.ones(3))], **kwargs)


def test_bad_parameters_and_gradients_are_refused():
    with pytest.raises(ValueError, match="floating-point"):
        AdamW8bit([torch.ones(3, dtype=torch.int64)])
    opt = AdamW8bit([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="block_size"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "block_size": 64})
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("how", ["dtype", "shape", "keys", "block_size", "groups"])
def test_mismatched_checkpoints_are_refused_before_anything_changes(how):
    params = make_params()
    opt = AdamW8bit(params, lr=1e-2)
    set_grads(params, 0)
    opt.step()
    state = opt.state_dict()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    bad = {"state": {i: dict(s) for i, s in state["state"].items()},
           "param_groups": [dict(g) for g in state["param_groups"]]}  # fmt: skip
    if how == "dtype":
        bad["state"][3]["exp_avg_q"] = bad["state"][3]["exp_avg_q"].to(torch.int16)
    elif how == "shape":
        bad["state"][3]["exp_avg_sq_scale"] = torch.zeros(5)
    elif how == "keys":
        bad["state"][3] = {"exp_avg": torch.zeros(1)}
    elif how == "block_size":
        bad["param_groups"][0]["block_size"] = 128
    else:
        bad["param_groups"][0]["params"] = bad["param_groups"][0]["params"][:-1]
    bad["state"][0]["exp_avg_q"] = torch.ones_like(state["state"][0]["exp_avg_q"])
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    for k, v in opt.state[params[0]].items():
        assert torch.equal(v, before[k])


def test_found_inf_skips_on_the_device_and_grad_scale_unscales():
    params = make_params()
    opt = AdamW8bit(params, lr=1e-2)
    set_grads(params, 0)
    opt.step()
    weights = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    set_grads(params, 1)
    params[1].grad[0, 0] = float("inf")
    opt.found_inf, opt.grad_scale = torch.ones(()), None
    opt.step()
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert all(torch.equal(v, state[k]) for k, v in opt.state[params[0]].items())
    # grad_scale: gradients multiplied by 8 and divided in the step equal plain ones.
    twin = [torch.nn.Parameter(w.clone()) for w in weights]
    twin_opt = AdamW8bit(twin, lr=1e-2)
    twin_opt.load_state_dict(opt.state_dict())
    set_grads(params, 2)
    set_grads(twin, 2)
    for p in params:
        p.grad.mul_(8.0)
    opt.found_inf, opt.grad_scale = torch.zeros(()), torch.tensor(8.0)
    opt.step()
    del opt.found_inf, opt.grad_scale
    twin_opt.step()
    for p, q in zip(params, twin):
        assert torch.equal(p, q)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func._schema.is_mutable and any(
            a.alias_info is not None for a in func._schema.returns
        ):
            pass  # views: no kernel
        else:
            self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(n_tensors):
    params = [torch.nn.Parameter(torch.randn(100)) for _ in range(n_tensors)]
    opt = AdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(100)
    opt.step()  # creates the state
    with CountOps() as counter:
        opt.step()
    return counter.count


def test_kernel_count_does_not_grow_with_the_number_of_tensors():
    assert ops_per_step(4) == ops_per_step(40)


def tiny_lm(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.Linear(32, 16)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inner_optimizer_of_loss_scale_optimizer(dtype):
    from mixprec.optim import Split8MasterWeights

    model = tiny_lm(dtype)
    inner = AdamW8bit(model.parameters(), lr=1e-2)
    if dtype == torch.float32:  # plain, with dynamic loss scaling and a skipped step
        opt = LossScaleOptimizer(inner)
    else:
        opt = LossScaleOptimizer(inner, loss_scale=None)
        opt._master = Split8MasterWeights(inner)
    x = torch.randint(0, 16, (8, 4))
    losses = []
    for step in range(12):
        logits = model(x).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(1, 1).flatten())
        if step == 3 and dtype == torch.float32:
            loss = loss * float("inf")
        opt.scale_loss(loss).backward()
        opt.unscale_()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert int(opt.skipped_steps) == (1 if dtype == torch.float32 else 0)
    # A LossScaleOptimizer checkpoint round trip keeps the codes bit for bit.
    saved = save_load(opt.state_dict())
    model2 = tiny_lm(dtype)
    inner2 = AdamW8bit(model2.parameters(), lr=1e-2)
    opt2 = LossScaleOptimizer(inner2, loss_scale=None) if dtype != torch.float32 else LossScaleOptimizer(inner2)
    if dtype != torch.float32:
        opt2._master = Split8MasterWeights(inner2)
    opt2.load_state_dict(saved)
    for a, b in zip(opt.inner_optimizer.state.values(), opt2.inner_optimizer.state.values()):
        for key in a:
            assert torch.equal(a[key], b[key])


# -- fused=True: the same step math through torch.compile -------------------------------

needs_compile = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here"
)


def train(params, opt, steps, first=0):
    for step in range(first, first + steps):
        set_grads(params, step)
        opt.step()


def assert_matches_reference(params, opt, ref_params, ref_opt, lr, steps):
    """The fused step against the eager reference: what holds and why.

    Exact: the step counts and the generator (the noise is drawn outside the compiled
    function, from the same generator, in the same order). Close: inductor may fuse a
    multiply and an add into one FMA, compute a power with another routine or reorder, so each
    float32 result is a few ulp off the reference's. A code is a floor (round) of such a
    value, so it differs only where the value is within those ulp of a code boundary:
    rare (>= 99 % equal), and then by one code; that element's moment then differs by
    one code, its later updates by a fraction of ``lr``, and its block's scale by at most
    one code of the absmax (1/127) if it is the block's largest. So: weights within a few
    ulp (1e-6 at magnitude ~1) for >= 99 % of the elements, all within ``lr * steps /
    100``; scales within 1 %; codes at most one apart.
    """
    # Counted over all the elements: one flipped code is a seventh of a 7-element tensor.
    diff = torch.cat([(p.detach().float() - r.detach().float()).abs().flatten()
                      for p, r in zip(params, ref_params)])  # fmt: skip
    assert float((diff <= 1e-6).float().mean()) >= 0.99
    assert float(diff.max()) <= lr * steps / 100
    for key in ("exp_avg_q", "exp_avg_sq_q"):
        codes = torch.cat([(opt.state[p][key].int() - ref_opt.state[r][key].int()).abs()
                           for p, r in zip(params, ref_params)])  # fmt: skip
        assert float((codes == 0).float().mean()) >= 0.99 and int(codes.max()) <= 1
    for p, r in zip(params, ref_params):
        got, want = opt.state[p], ref_opt.state[r]
        assert torch.equal(got["step"], want["step"])
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-2, atol=0)
    rng, ref_rng = opt.state_dict()["rng"], ref_opt.state_dict()["rng"]
    assert rng.keys() == ref_rng.keys() and all(torch.equal(rng[k], ref_rng[k]) for k in rng)


@needs_compile
@pytest.mark.parametrize("chunk_size", [pytest.param(1 << 22, marks=pytest.mark.slow), 512])  # one chunk (its compile takes ~25 s: slow); several, of one tensor
def test_fused_step_matches_the_eager_reference(chunk_size, one_thread):
    from torch._dynamo.utils import counters

    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "block_size": 64, "chunk_size": chunk_size}
    params, ref = make_params(seed=4), make_params(seed=4)
    opt, ref_opt = AdamW8bit(params, fused=True, **kwargs), AdamW8bit(ref, fused=False, **kwargs)
    train(params, opt, 2)
    train(ref, ref_opt, 2)
    graphs = counters["stats"]["unique_graphs"]
    # A schedule's new hyperparameters and a loss scaler's found_inf/grad_scale reuse
    # the graph (so do the chunks' sizes, 1 tensor or several).
    for o in (opt, ref_opt):
        o.param_groups[0].update(lr=2e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.2)
        o.found_inf, o.grad_scale = torch.zeros(()), torch.tensor(4.0)
    for step in range(2, 10):
        for ps, o in ((params, opt), (ref, ref_opt)):
            set_grads(ps, step)
            for p in ps:
                p.grad.mul_(4.0)
            o.step()
    assert counters["stats"]["unique_graphs"] == graphs
    assert_matches_reference(params, opt, ref, ref_opt, lr=2e-2, steps=10)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_compile)])
def test_a_skipped_first_step_changes_nothing(fused, one_thread):
    """At step 0 the bias corrections divide by zero (``lr / (1 - beta1**0)``): a skip
    there must still leave weights, codes, scales and counts as they were, no NaN."""
    params = make_params(seed=6)
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1, block_size=64, fused=fused)
    weights = [p.detach().clone() for p in params]
    set_grads(params, 0)
    params[0].grad[0] = float("nan")
    opt.found_inf, opt.grad_scale = torch.ones(()), torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    for p in params:
        state = opt.state[p]
        assert float(state["step"]) == 0
        assert not state["exp_avg_q"].any() and not state["exp_avg_sq_q"].any()
        assert not state["exp_avg_scale"].any() and not state["exp_avg_sq_scale"].any()
    opt.found_inf = torch.zeros(())  # the next step is the first Adam step: lr * sign(g)
    set_grads(params, 1)
    opt.step()
    for p, w in zip(params, weights):
        expected = w * (1 - 1e-2 * 0.1) - 1e-2 * torch.sign(p.grad)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-5)


def test_noise_from_bits_is_uniform_and_independent():
    bits = torch.empty(200_000, dtype=torch.int32).random_(generator=torch.Generator().manual_seed(0))
    m, v = noise_from_bits(bits)
    for u in (m, v):
        assert 0 <= float(u.min()) and float(u.max()) < 1
        assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert abs(float(torch.corrcoef(torch.stack([m, v]))[0, 1])) < 0.01


@needs_compile
def test_fused_skipped_step_changes_nothing(one_thread):
    params = make_params(seed=5)
    opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1, block_size=64, fused=True)
    train(params, opt, 2)
    weights = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    set_grads(params, 2)
    params[1].grad[0, 0] = float("inf")
    opt.found_inf, opt.grad_scale = torch.ones(()), torch.tensor(2.0)
    opt.step()
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    for p, saved in zip(params, states):
        assert all(torch.equal(opt.state[p][k], v) for k, v in saved.items())


@needs_compile
def test_fused_and_eager_checkpoints_interchange(one_thread):
    """Three steps one way, the checkpoint loaded into the other, three more steps: both
    orders match six eager steps (as the fused step does, see the helper)."""
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "block_size": 64}
    ref = make_params(seed=6)
    ref_opt = AdamW8bit(ref, fused=False, **kwargs)
    train(ref, ref_opt, 6)
    for first, then in ((True, False), (False, True)):
        params = make_params(seed=6)
        opt = AdamW8bit(params, fused=first, **kwargs)
        train(params, opt, 3)
        saved = save_load({"params": [p.detach() for p in params], "opt": opt.state_dict()})
        resumed = [torch.nn.Parameter(t) for t in saved["params"]]
        other = AdamW8bit(resumed, fused=then, **kwargs)
        other.load_state_dict(saved["opt"])
        train(resumed, other, 3, first=3)
        assert_matches_reference(resumed, other, ref, ref_opt, lr=1e-2, steps=6)


def test_fused_defaults_to_eager_on_the_cpu():
    params, ref = make_params(), make_params()
    opt, ref_opt = AdamW8bit(params, lr=1e-2), AdamW8bit(ref, lr=1e-2, fused=False)
    train(params, opt, 2)
    train(ref, ref_opt, 2)
    assert all(torch.equal(p, r) for p, r in zip(params, ref))
    assert not opt._fused_on(torch.device("cpu"))


def test_fused_is_refused_where_torch_compile_is_not_supported(monkeypatch):
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(RuntimeError, match="fused=True: torch.compile is not supported"):
        AdamW8bit([torch.nn.Parameter(torch.ones(3))], fused=True)
    opt = AdamW8bit([torch.nn.Parameter(torch.ones(3))])  # the default steps eagerly
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    assert not opt._fused_on(torch.device("cuda"))


@needs_compile
@pytest.mark.parametrize("device", [
    "cpu",  # the same test with fused=True, so that it runs everywhere
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")),
])  # fmt: skip
def test_fused_on_the_device_matches_eager(device):
    """On CUDA the default (fused=None) compiles; on the CPU fused=True does. Gradients
    and a skipped step's found_inf on the device, as a scaler gives them."""
    from mixprec.kernels.compiled import compile_unsupported

    if compile_unsupported(device):
        pytest.skip(compile_unsupported(device))
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "block_size": 64}
    params = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(seed=7)]
    ref = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(seed=7)]
    opt = AdamW8bit(params, fused=None if device == "cuda" else True, **kwargs)
    ref_opt = AdamW8bit(ref, fused=False, **kwargs)
    assert opt._fused_on(params[0].device)
    for step in range(6):
        gen = torch.Generator().manual_seed(100 + step)
        grads = [torch.randn(p.shape, generator=gen) * 0.1 for p in params]
        for ps, o in ((params, opt), (ref, ref_opt)):
            for p, g in zip(ps, grads):
                p.grad = g.to(device)
            o.found_inf = torch.tensor(float(step == 3), device=device)  # step 3 skipped
            o.grad_scale = None
            o.step()
    assert float(opt.state[params[0]]["step"]) == 5
    assert_matches_reference(params, opt, ref, ref_opt, lr=1e-2, steps=5)
