"""The rewrite without example inputs: capture on the first call, recapture on new input
shapes/dtypes or train/eval mode, a bound with a clear error, and the model's own tree."""

import pytest
import torch
from test_rewrite_api import api_of
from torch import nn

from mixprec import amp
from mixprec.rewrite import (
    CaptureError,
    LazyRewrite,
    RecaptureLimitError,
    count_casts,
    explain,
    rewrite,
)


class Pooled(nn.Module):
    """Averages over a sequence of any length; a Python branch on ``self.training``
    that no graph constant records (a graph traced in training mode keeps it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.scale = 2.0

    def forward(self, x):
        h = torch.relu(self.fc(x.float())).mean(dim=1)
        if self.training:
            h = h * self.scale
        return self.head(h)


def pooled():
    torch.manual_seed(0)
    return Pooled()


def test_nothing_is_captured_until_the_first_call_and_the_result_matches_the_eager_rewrite():
    x = torch.randn(4, 5, 6)
    lazy = rewrite(pooled(), dtype=torch.bfloat16)
    assert isinstance(lazy, LazyRewrite) and lazy.captures == 0
    eager = rewrite(pooled(), x, dtype=torch.bfloat16)
    assert torch.equal(lazy(x), eager(x))
    assert lazy.captures == 1
    assert explain(lazy).summary == explain(eager).summary


def test_other_batch_sizes_reuse_the_graph_other_shapes_and_dtypes_recapture():
    lazy = rewrite(pooled(), dtype=torch.bfloat16)
    lazy(torch.randn(4, 5, 6))
    lazy(torch.randn(9, 5, 6))  # the batch dimension is free
    assert lazy.captures == 1
    lazy(torch.randn(4, 7, 6))  # another sequence length
    assert lazy.captures == 2
    lazy(torch.randn(3, 7, 6))
    assert lazy.captures == 2
    lazy(torch.randn(4, 5, 6, dtype=torch.float64))  # another dtype
    assert lazy.captures == 3
    assert explain(lazy).rows  # the report is on the graph of the last call


def test_a_batch_of_one_gets_its_own_graph_without_a_warning(recwarn):
    lazy = rewrite(pooled(), dtype=torch.bfloat16)
    lazy(torch.randn(4, 5, 6))
    lazy(torch.randn(1, 5, 6))  # torch.export fixes batch sizes 0 and 1
    assert lazy.captures == 2 and not [w for w in recwarn if "batch size" in str(w.message)]


def test_train_and_eval_each_capture_in_their_own_mode():
    x = torch.randn(4, 5, 6)
    reference = pooled()
    lazy = rewrite(pooled(), dtype=torch.bfloat16)
    traced_in_training = rewrite(pooled(), x, dtype=torch.bfloat16)
    train_out = lazy(x)
    lazy.eval()
    assert not lazy.model.training and not lazy.fc.training
    eval_out = lazy(x)
    assert lazy.captures == 2
    # The eval graph dropped the training-only branch (h * 2); a graph traced in
    # training mode and switched to eval keeps it (the eager rewrite's limitation).
    with torch.no_grad():
        want = reference.eval()(x)
    torch.testing.assert_close(eval_out, want, atol=0.05, rtol=0.05)
    assert not torch.allclose(train_out, eval_out, atol=0.05)
    traced_in_training.eval()
    assert not torch.allclose(traced_in_training(x), want, atol=0.05)
    lazy.train()
    lazy(x)
    assert lazy.captures == 2  # back to the training graph


def test_beyond_max_captures_a_clear_error_and_nothing_changes():
    lazy = rewrite(pooled(), dtype=torch.bfloat16, max_captures=2)
    lazy(torch.randn(4, 5, 6))
    lazy(torch.randn(4, 6, 6))
    before = {k: v.clone() for k, v in lazy.state_dict().items()}
    with pytest.raises(RecaptureLimitError) as info:
        lazy(torch.randn(4, 7, 6))
    message = str(info.value)
    assert "max_captures=2" in message and "float32[4, 7, 6]" in message
    assert "float32[4, 5, 6]" in message and "drop_last=True" in message
    assert isinstance(info.value, CaptureError) and lazy.captures == 2
    assert all(torch.equal(before[k], v) for k, v in lazy.state_dict().items())
    lazy(torch.randn(2, 5, 6))  # the captured kinds of call still run


def test_the_lazy_module_is_the_models_own_tree_and_trains_it():
    model = pooled()
    lazy = rewrite(model, dtype=torch.bfloat16)
    assert list(lazy.parameters()) == list(model.parameters())
    assert lazy.state_dict().keys() == model.state_dict().keys()
    assert lazy.fc is model.fc and lazy.scale == 2.0  # the model's attributes
    opt = torch.optim.SGD(lazy.parameters(), lr=0.5)
    x, y = torch.randn(8, 5, 6), torch.randint(0, 3, (8,))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(lazy(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] and model.fc.weight.dtype == torch.float32
    fresh = pooled()
    lazy.load_state_dict(fresh.state_dict())
    assert torch.equal(model.fc.weight, fresh.fc.weight)


def test_moving_or_converting_forgets_the_graphs_and_low_parameters_are_refused():
    lazy = rewrite(pooled(), dtype=torch.bfloat16)
    lazy(torch.randn(4, 5, 6))
    lazy.to(torch.device("cpu"))
    assert lazy.captures == 0
    lazy.half()
    with pytest.raises(
        ValueError, match=r"parameter 'fc.weight' is torch.float16.*model.float\(\)"
    ):
        lazy(torch.randn(4, 5, 6).half())
    lazy.float()
    assert lazy(torch.randn(4, 5, 6)).dtype == torch.float32


def test_one_api_per_model_and_the_arguments_are_checked_at_once():
    model = pooled()
    lazy = rewrite(model, dtype=torch.bfloat16)
    assert api_of(model) == api_of(lazy) == "rewrite"
    with pytest.raises(ValueError, match="'rewrite' API"):
        amp.initialize(model, level="O1")
    with pytest.raises(ValueError, match="'rewrite' API"):
        rewrite(model)
    with pytest.raises(ValueError, match="drop max_captures"):
        rewrite(pooled(), torch.randn(4, 5, 6), max_captures=2)
    with pytest.raises(ValueError, match="max_captures must be an integer >= 1"):
        rewrite(pooled(), max_captures=0)
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        rewrite(pooled(), dtype=torch.float32)
    with pytest.raises(TypeError, match="positional arguments only"):
        lazy(x=torch.randn(4, 5, 6))
    with pytest.raises(ValueError, match="has not run yet"):
        explain(lazy)


def test_casts_match_the_eager_rewrite():
    x = torch.randn(4, 5, 6)
    lazy = rewrite(pooled(), dtype=torch.bfloat16)
    lazy(x)
    eager = rewrite(pooled(), x, dtype=torch.bfloat16)
    assert count_casts(lazy, x) == count_casts(eager, x)


def test_a_deep_copy_captures_its_own_model():
    import copy

    lazy = rewrite(pooled(), dtype=torch.bfloat16)
    twin = copy.deepcopy(lazy)
    with torch.no_grad():
        twin.model.fc.weight.zero_()
        twin.model.fc.bias.zero_()
    x = torch.randn(4, 5, 6)
    assert torch.equal(twin(x), twin(torch.randn(4, 5, 6)))  # its fc is zero: x is ignored
    assert not torch.equal(lazy(x), lazy(torch.randn(4, 5, 6)))  # the original's is not
    assert list(twin.parameters())[0] is twin.model.fc.weight
