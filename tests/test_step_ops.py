"""What an optimizer step dispatches: nothing written when the scale is 1 for good, and
the same number of kernels for 4 parameters as for 16 (split and split8 masters)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.loss_scale import DynamicLossScale, NoOpLossScale
from mixprec.optim import AdamW8bit, LossScaleOptimizer


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16)) for _ in range(3)]


def test_no_scaling_reads_the_gradients_without_writing_them():
    params = _params()
    for p in params:
        p.grad = torch.randn_like(p)
    versions = [p.grad._version for p in params]
    with _Ops() as ops:
        found_inf = NoOpLossScale().unscale_([p.grad for p in params])
    assert float(found_inf) == 0.0
    assert [p.grad._version for p in params] == versions  # nothing written
    assert not any("unscale" in n or n.startswith("_foreach_mul") for n in ops.names)


def test_a_dynamic_scale_still_unscales():
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p) * 8
    found_inf = DynamicLossScale(initial_scale=8.0).unscale_([p.grad for p in params])
    assert float(found_inf) == 0.0 and all(torch.equal(p.grad, torch.ones_like(p)) for p in params)


def test_no_scaling_still_skips_a_nonfinite_step():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = LossScaleOptimizer(torch.optim.SGD(params, lr=0.1), None)
    loss = sum((p.float() ** 2).sum() for p in params) * float("nan")
    opt.scale_loss(loss).backward()
    opt.step()
    assert int(opt.skipped_steps) == 1
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    opt.zero_grad()
    opt.scale_loss(sum((p.float() ** 2).sum() for p in params)).backward()
    opt.step()
    assert int(opt.iterations) == 1 and not torch.equal(params[0], before[0])


def _split_step_ops(count: int, mode: str = "split", eight_bit: bool = False) -> list[str]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 5).bfloat16()) for _ in range(count)]
    inner = AdamW8bit(params, lr=1e-3) if eight_bit else torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt = LossScaleOptimizer(inner, None, master_weights=mode)
    for _ in range(2):  # the second step is the steady state
        opt.zero_grad()
        opt.scale_loss(sum((p.float() ** 2).sum() for p in params)).backward()
        with _Ops() as ops:
            opt.step()
    # Views and empty allocations launch nothing; every other op is a kernel (or a sync).
    metadata = ("view", "_unsafe_view", "as_strided", "detach", "alias", "split", "slice", "empty")
    return [n for n in ops.names if n.split(".")[0] not in metadata]


@pytest.mark.parametrize(("mode", "eight_bit"), [("split", False), ("split8", False), ("split8", True)])
def test_split_masters_step_in_kernels_independent_of_the_parameter_count(mode, eight_bit):
    """split and split8 masters (and AdamW8bit, within one chunk) step every parameter
    of a group in the same kernels: the count does not grow with the parameters."""
    few, many = _split_step_ops(4, mode, eight_bit), _split_step_ops(16, mode, eight_bit)
    assert len(few) == len(many), sorted(set(many) - set(few))


@pytest.mark.parametrize("prefilter", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_finite_check_is_exact_with_or_without_the_cpu_norm_prefilter(prefilter, dtype):
    """The CPU's L2-norm prefilter runs unless a dispatch mode watches the ops
    (:func:`mixprec.numerics.cpu_shortcuts`; then the GPU's way runs): either way the
    verdict is exact and nothing is written."""
    from mixprec import numerics

    huge = torch.full((64,), 3e38 if dtype == torch.bfloat16 else 3.4e38, dtype=dtype)
    cases = {
        "finite": ([torch.randn(8, dtype=dtype), torch.ones(3, dtype=dtype)], 0.0),
        # squares beyond float32's range: the L2 norm overflows, the elements are finite
        "huge but finite": ([torch.ones(2, dtype=dtype), huge], 0.0),
        "inf": ([torch.ones(2, dtype=dtype), torch.tensor([1.0, float("inf")], dtype=dtype)], 1.0),
        "-inf": ([torch.tensor([-float("inf")], dtype=dtype)], 1.0),
        "nan": ([torch.tensor([0.0, float("nan")], dtype=dtype)], 1.0),
    }
    for name, (tensors, expected) in cases.items():
        before = [(t.clone(), t._version) for t in tensors]
        if prefilter:
            found = numerics.any_nonfinite(tensors, torch.device("cpu"))
        else:
            with _Ops():
                found = numerics.any_nonfinite(tensors, torch.device("cpu"))
        assert float(found) == expected, name
        for t, (copy, version) in zip(tensors, before):  # read only
            assert t._version == version and torch.equal(t.nan_to_num(), copy.nan_to_num())
