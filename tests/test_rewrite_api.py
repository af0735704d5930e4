"""Entry points: argument checking, one API per model, loss scales, reports."""

import copy
import json
import re

import pytest
import torch
from torch import fx, nn

from mixprec import amp
from mixprec.compat.tf import enable_mixed_precision_graph_rewrite
from mixprec.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import policy_scope
from mixprec.rewrite import AmpLists, CastCounter, LazyRewrite, count_casts, explain, rewrite


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.Softmax(dim=-1))


X = torch.randn(4, 6)


def api_of(model: nn.Module) -> str | None:
    """The mixed-precision API that claimed ``model`` or a submodule of it (``"amp"`` or
    ``"rewrite"``), or ``None``: as the graph rewrite sees it, which refuses a model that
    either API claimed. A claim travels with a deep copy; a lazy rewrite captures nothing."""
    try:
        rewrite(copy.deepcopy(model))
    except ValueError as err:
        claimed = re.search(r"already uses the mixprec '(\w+)' API", str(err))
        if claimed is None:
            raise
        return claimed[1]
    return None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"model": "net"}, TypeError, "model must be a torch.nn.Module, got str"),
        ({"dtype": torch.float32}, ValueError, "dtype must be torch.float16 or torch.bfloat16"),
        ({"dtype": 16}, TypeError, r"dtype must be .*got 16 \(int\)"),
        ({"lists": ["mm"]}, TypeError, "lists must be a mixprec.rewrite.AmpLists or None"),
        ({"level": "O2"}, ValueError, "unknown level 'O2'; accepted levels"),
        ({"level": 2}, TypeError, r"level must be a string, got 2 \(int\)"),
        ({"keep_output_dtype": "yes"}, TypeError, "keep_output_dtype must be True or False"),
        ({"example_inputs": [1.0]}, TypeError, "example_inputs must contain at least one tensor"),
    ],
)
def test_rewrite_rejects_bad_arguments_and_claims_nothing(kwargs, error, match):
    model = mlp()
    arguments = {"model": model, "example_inputs": X, **kwargs}
    with pytest.raises(error, match=match):
        rewrite(**arguments)
    assert api_of(model) is None


def test_rewrite_rejects_low_precision_parameters():
    with pytest.raises(ValueError, match=r"parameter '0.weight' is torch.float16.*model.float\(\)"):
        rewrite(mlp().half(), X.half())


def test_dtype_names_are_accepted():
    assert explain(rewrite(mlp(), X, dtype="bf16")).dtype == "bfloat16"


def test_a_model_is_rewritten_once():
    model = mlp()
    gm = rewrite(model, X, dtype=torch.bfloat16)
    assert api_of(model) == "rewrite"
    with pytest.raises(ValueError, match="already uses the mixprec 'rewrite' API"):
        rewrite(model, X)
    # The graph module is claimed too (its deep copy is a new graph module: asked directly).
    with pytest.raises(ValueError, match="already uses the mixprec 'rewrite' API"):
        rewrite(gm, X)
    with pytest.raises(ValueError, match="already uses the mixprec 'rewrite' API"):
        amp.initialize(gm, level="O1")


def test_every_submodule_is_marked_so_amp_refuses_them():
    model = mlp()
    rewrite(model, X, dtype=torch.bfloat16)
    assert {api_of(m) for m in model.modules()} == {"rewrite"}
    for module in model.modules():
        with pytest.raises(ValueError, match="already uses the mixprec 'rewrite' API"):
            amp.set_policy(module, "mixed_bfloat16")


def test_entry_point_refuses_a_mixed_global_policy():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with policy_scope("mixed_float16"):
        with pytest.raises(ValueError, match="policy API is in use .*'mixed_float16'"):
            enable_mixed_precision_graph_rewrite(optimizer, model=model, example_inputs=X)
    assert api_of(model) is None


def test_a_model_using_the_amp_api_is_rejected():
    model = mlp()
    amp.set_policy(model, "mixed_bfloat16")
    with pytest.raises(ValueError, match="already uses the mixprec 'amp' API"):
        rewrite(model, X)
    other = mlp()
    amp.to_float(other[0], torch.bfloat16)
    with pytest.raises(ValueError, match="submodule '0' already uses the mixprec 'amp' API"):
        rewrite(other, X)


def test_environment_overrides_apply_to_rewrite(monkeypatch):
    monkeypatch.setenv("MIXPREC_DENYLIST_REMOVE", "softmax")
    monkeypatch.setenv("MIXPREC_ALLOWLIST_ADD", "softmax")
    report = explain(rewrite(mlp(), X, dtype=torch.bfloat16))
    softmax = next(row for row in report.rows if row.op == "softmax")
    assert softmax.list == "allow" and softmax.colour == "bfloat16"
    monkeypatch.setenv("MIXPREC_ALLOWLIST_ADD", "softmaxx")
    with pytest.raises(ValueError, match="MIXPREC_ALLOWLIST_ADD='softmaxx'"):
        rewrite(mlp(), X)


def test_custom_lists_and_keep_output_dtype():
    lists = AmpLists().remove("deny", "softmax").add("allow", "softmax")
    gm = rewrite(mlp(), X, dtype=torch.bfloat16, lists=lists, keep_output_dtype=True)
    assert gm(X).dtype == torch.bfloat16
    assert rewrite(mlp(), X, dtype=torch.bfloat16, lists=lists)(X).dtype == torch.float32


@pytest.mark.parametrize(
    "level, converted", [("default", 3), ("allow_only", 2), ("unsafe_force_all", 4)]
)
def test_levels_change_what_is_converted(level, converted):
    report = explain(rewrite(mlp(), X, dtype=torch.bfloat16, level=level))
    assert (report.converted, report.total) == (converted, 4)


@pytest.mark.parametrize(
    "loss_scale, kind",
    [("dynamic", DynamicLossScale), (128, StaticLossScale), (64.0, StaticLossScale)],
)
def test_entry_point_returns_the_model_and_a_loss_scale_optimizer(loss_scale, kind):
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    gm, opt = enable_mixed_precision_graph_rewrite(
        inner, loss_scale, model=model, dtype=torch.bfloat16, example_inputs=(X,)
    )
    assert isinstance(gm, fx.GraphModule) and isinstance(opt, LossScaleOptimizer)
    assert opt.inner_optimizer is inner and isinstance(opt.loss_scaler, kind)
    before = model[0].weight.detach().clone()
    loss = -gm(X)[:, 0].log().mean()
    opt.scale_loss(loss).backward()
    opt.step()
    opt.zero_grad()
    assert not torch.equal(before, model[0].weight)
    assert model[0].weight.dtype == torch.float32


def test_entry_point_accepts_a_loss_scale_object():
    model = mlp()
    scale = NoOpLossScale()
    _, opt = enable_mixed_precision_graph_rewrite(
        torch.optim.SGD(model.parameters(), lr=0.1), scale, model=model, example_inputs=X
    )
    assert opt.loss_scaler is scale


def test_entry_point_without_example_inputs_captures_on_the_first_call():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lazy, opt = enable_mixed_precision_graph_rewrite(optimizer, model=model, dtype=torch.bfloat16)
    assert isinstance(lazy, LazyRewrite) and lazy.captures == 0
    assert api_of(model) == "rewrite"  # claimed at once: amp is refused from now on
    eager = rewrite(mlp(), X, dtype=torch.bfloat16)
    assert torch.equal(lazy(X), eager(X)) and lazy.captures == 1
    assert isinstance(opt, LossScaleOptimizer) and opt.inner_optimizer is optimizer


def test_entry_point_needs_a_model_for_example_inputs_or_max_captures():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs in ({"example_inputs": X}, {"max_captures": 2}):
        with pytest.raises(ValueError, match="without model="):
            enable_mixed_precision_graph_rewrite(optimizer, **kwargs)
    assert api_of(model) is None


@pytest.mark.parametrize(
    "loss_scale, error, match",
    [
        ("static", ValueError, "loss_scale must be 'dynamic'"),
        (-2, ValueError, "loss_scale must be a positive number"),
        (True, ValueError, r"loss_scale must be .*got True \(bool\)"),
        ([128], ValueError, r"got \[128\] \(list\)"),
    ],
)
def test_entry_point_rejects_bad_loss_scales_and_claims_nothing(loss_scale, error, match):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        enable_mixed_precision_graph_rewrite(optimizer, loss_scale, model=model, example_inputs=X)
    assert api_of(model) is None


def test_entry_point_rejects_bad_optimizers():
    model = mlp()
    with pytest.raises(TypeError, match="opt must be a torch.optim.Optimizer, got str"):
        enable_mixed_precision_graph_rewrite("sgd", model=model, example_inputs=X)
    wrapped = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already a LossScaleOptimizer; pass the plain"):
        enable_mixed_precision_graph_rewrite(wrapped, model=model, example_inputs=X)
    stranger = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="opt holds none of model's parameters"):
        enable_mixed_precision_graph_rewrite(stranger, model=model, example_inputs=X)
    assert api_of(model) is None


def test_entry_point_refuses_a_model_that_uses_the_amp_api():
    model = mlp()
    amp.set_policy(model, "mixed_bfloat16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="already uses the mixprec 'amp' API"):
        enable_mixed_precision_graph_rewrite(optimizer, model=model, example_inputs=X)


def test_report_prints_a_table_and_converts_to_data():
    report = explain(rewrite(mlp(), X, dtype=torch.bfloat16))
    text = str(report)
    header = text.splitlines()[0].split()
    assert header == ["module", "node", "op", "list", "colour", "reason"]
    assert "deny: on the deny list" in text
    assert text.splitlines()[-1].startswith(report.summary)
    assert report.summary == f"converted 3/4 ops to bfloat16 using {report.casts} casts"
    data = json.loads(json.dumps(report.to_dict()))
    assert data["summary"] == report.summary and data["converted"] == 3
    assert {row["op"] for row in data["rows"]} >= {"linear", "tanh", "softmax", "cast"}
    assert all(row["module"] in ("", "0", "1", "2", "3") for row in data["rows"])


def test_explain_rejects_other_modules():
    with pytest.raises(TypeError, match="graph_module must be a torch.fx.GraphModule"):
        explain(mlp())
    with pytest.raises(ValueError, match="was not produced by mixprec.rewrite.rewrite"):
        explain(fx.symbolic_trace(mlp()))


def test_cast_counter_counts_dtype_changes_only():
    x = torch.randn(3)
    with CastCounter() as counter:
        x.to(torch.float32)
        x.half().float()
        x.clone()
    assert counter.count == 2 and counter.casts == [
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
    ]
    assert count_casts(nn.Linear(3, 3), torch.randn(2, 3)) == 0
    assert count_casts(nn.Linear(3, 3), torch.randn(2, 3), autocast_dtype=torch.bfloat16) == 3
