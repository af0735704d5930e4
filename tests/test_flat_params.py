"""FlatParameters: a group of parameters held as views of one flat tensor."""

from __future__ import annotations

import pytest
import torch

from mixprec.optim._flat_params import FlatParameters, is_dense


def _params():
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 3, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    transposed = torch.randn(5, 2, generator=gen).t()
    plain = torch.randn(7, generator=gen)
    scalar = torch.randn((), generator=gen)
    return [torch.nn.Parameter(t) for t in (conv, transposed, plain, scalar)]


def test_dense_layouts_are_held_in_memory_order_with_values_and_strides_kept():
    params = _params()
    before = [(p.detach().clone(), p.stride()) for p in params]
    flat = FlatParameters(params)
    assert flat.held and flat.holds()
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    for p, (value, stride) in zip(params, before):
        assert torch.equal(p, value) and p.stride() == stride
    # values holds each parameter's memory block: gather and views_of invert each other
    assert torch.equal(flat.gather([p.detach() for p in params]), flat.values)
    doubled = flat.values * 2
    for view, p in zip(flat.views_of(doubled), params):
        assert torch.equal(view, p * 2) and view.stride() == p.stride()
    contiguous = [p.detach().contiguous() for p in params]  # another layout: copied in place
    assert torch.equal(flat.gather(contiguous), flat.values)


def test_non_dense_and_fsdp1_parameters_are_not_held_but_gather_and_scatter():
    expanded = torch.nn.Parameter(torch.ones(3, 1).expand(3, 4))
    assert not is_dense(expanded) and is_dense(torch.ones(2, 3).t())
    marked = torch.nn.Parameter(torch.ones(4))
    marked._fsdp_flattened = True  # what FSDP1 marks its parameters with
    for params in ([expanded, torch.nn.Parameter(torch.zeros(2))], [marked]):
        ptrs = [p.data_ptr() for p in params]
        flat = FlatParameters(params)
        assert not flat.held and [p.data_ptr() for p in params] == ptrs
        values = flat.gather([p.detach() for p in params])
        assert values.numel() == sum(p.numel() for p in params)
        if params[0] is marked:
            flat.scatter(values + 1)
            assert torch.equal(marked.detach(), torch.full((4,), 2.0))


def test_new_storage_releases_the_group_and_a_changed_layout_is_refused():
    params = _params()
    flat = FlatParameters(params)
    params[2].data = torch.zeros(7)
    flat.follow()
    assert not flat.held and flat.values.numel() == 0
    assert torch.equal(flat.views_of(flat.gather([p.detach() for p in params]))[2], torch.zeros(7))
    params[0].data = params[0].detach().contiguous()  # same values, another layout
    with pytest.raises(ValueError, match=r"changed from torch.float32 \(4, 3, 3, 3\) with "
                       r"strides \(27, 1, 9, 3\) .* to .*strides \(27, 9, 3, 1\)"):  # fmt: skip
        flat.follow()
    with pytest.raises(ValueError, match="one device and dtype"):
        FlatParameters([torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1).half())])
