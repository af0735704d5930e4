"""The amp levels as data: one frozen, checked ``LevelSpec`` per level, in one table that
``amp.initialize``, the command line and the levels guide read."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from torch import nn

from mixprec import amp
from mixprec.amp import LEVEL_SPECS, LEVELS, LevelSpec
from mixprec.amp._level_specs import (
    _check_table,
    check_level_name,
    check_master_weights,
    float16_optimizer_state,
    level_master_weights,
    level_table,
)
from mixprec.cli import build_parser
from mixprec.loss_scale import DynamicLossScale, NoOpLossScale
from mixprec.optim.masters import mode_of
from mixprec.train._names import AMP_LEVELS

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOW = (torch.float16, torch.bfloat16)
#: The levels that name their rules (``auto`` picks one of them).
CONCRETE = [name for name, spec in LEVEL_SPECS.items() if not spec.by_hardware]


def test_every_level_has_a_spec_and_the_command_line_spells_the_table():
    assert set(LEVELS) <= set(LEVEL_SPECS)
    assert LEVELS == tuple(name for name, spec in LEVEL_SPECS.items() if spec.amp)
    assert all(spec.name == name for name, spec in LEVEL_SPECS.items())
    # mixprec.cli._args loads without torch, so its choices are written out: the same.
    assert AMP_LEVELS == tuple(LEVEL_SPECS)
    assert [name for name, spec in LEVEL_SPECS.items() if spec.by_hardware] == ["auto"]


def test_the_train_command_offers_and_explains_every_level():
    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    level = next(a for a in train._actions if a.dest == "level")
    assert tuple(level.choices) == tuple(LEVEL_SPECS)
    assert all(f"{name} " in level.help for name in LEVEL_SPECS), level.help


def test_the_specs_and_the_table_are_read_only():
    spec = LEVEL_SPECS["O2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.master_weights = "kahan"  # type: ignore[misc]
    with pytest.raises(TypeError):
        LEVEL_SPECS["O2"] = spec  # type: ignore[index]
    assert hash(spec) == hash(dataclasses.replace(spec))


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", ""),
        ("storage", "half"),
        ("forward", "jit"),
        ("float16_loss_scale", "static"),
        ("bfloat16_loss_scale", 2.0),
        ("master_weights", "fp64"),
        ("master_weights", True),  # the canonical spelling only: "fp32"
        ("alias_of", "O2"),  # itself
        ("amp", "yes"),
    ],
)
def test_a_bad_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b") as caught:
        dataclasses.replace(LEVEL_SPECS["O2"], **{field: value})
    assert repr(value) in str(caught.value)


@pytest.mark.parametrize(
    "base, changes, field",
    [
        ("O0", {"master_weights": "fp32"}, "master_weights"),  # float32 storage: no masters
        ("O0", {"storage": "low"}, "storage"),  # a float32 forward stores float32
        ("O0", {"float16_loss_scale": "dynamic"}, "float16_loss_scale"),
        ("O2", {"forward": None}, "forward"),  # None in some per-level fields, not all
        ("auto", {"storage": "low"}, "forward"),
    ],
)
def test_fields_that_contradict_each_other_are_refused(base, changes, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        dataclasses.replace(LEVEL_SPECS[base], **changes)


def test_a_new_level_is_one_spec():
    made = LevelSpec("O3-scaled", storage="low", forward="casts", float16_loss_scale="dynamic",
                     bfloat16_loss_scale="none", master_weights=False)  # fmt: skip
    assert made.keep_norms_float32 is False and made.low_precision and not made.by_hardware
    spec = dataclasses.replace(LEVEL_SPECS["O2"], name="O2-kahan", master_weights="kahan")
    assert spec.master_weights == "kahan" and spec.default_loss_scale(torch.float16).kind == (
        "dynamic"
    )
    with pytest.raises(ValueError, match="same storage and forward"):
        _check_table({"O2": LEVEL_SPECS["O2"], "x": dataclasses.replace(spec, name="x",
                                                                        alias_of="O2",
                                                                        storage="low")})  # fmt: skip
    with pytest.raises(ValueError, match="is the spec of"):
        _check_table({"O3": LEVEL_SPECS["O2"]})
    assert LEVEL_SPECS["lean"].alias_of == "O3"


# -- the rules read from the table are the rules the levels always had -------------------


@pytest.mark.parametrize("level", CONCRETE)
@pytest.mark.parametrize("dtype", [*LOW, torch.float32])
def test_the_default_loss_scale_per_level_and_dtype(level, dtype):
    scaled = level in ("O1", "O2", "rewrite") and dtype == torch.float16
    expected = DynamicLossScale if scaled else NoOpLossScale
    assert type(LEVEL_SPECS[level].default_loss_scale(dtype)) is expected


def test_auto_has_no_rules_of_its_own():
    with pytest.raises(ValueError, match="resolve it first"):
        LEVEL_SPECS["auto"].default_loss_scale(torch.float16)
    assert LEVEL_SPECS["auto"].keep_norms_float32 is None


@pytest.mark.parametrize("level", CONCRETE)
def test_the_default_masters_and_the_float16_state_rule(level):
    default = {"O2": "fp32", "lean": "kahan"}.get(level, False)
    assert level_master_weights(level) == default
    for dtype in LOW:
        for masters in (False, "fp32", "kahan"):
            # The state is float16 where float16 parameters are stepped themselves: no
            # masters, or kahan's compensated steps (not float32 masters), at any level
            # that stores low-precision parameters.
            rule = (
                dtype == torch.float16
                and level in ("O2", "O3", "lean")
                and masters in (False, "kahan")
            )
            assert float16_optimizer_state(level, dtype, masters) == rule


def _adamw_eps_1e_8():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def test_o2_with_kahan_in_float16_refuses_an_eps_its_float16_state_cannot_hold():
    # Kahan steps the float16 parameters themselves, so AdamW's moments are float16 and
    # eps=1e-8 rounds to zero in them: the first steps turned the weights NaN or inf.
    from mixprec import amp

    net, opt = _adamw_eps_1e_8()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="eps=1e-08"):
        amp.initialize(net, opt, "O2", torch.float16, master_weights="kahan")
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # nothing changed


def test_o3_with_float32_masters_in_float16_keeps_float32_state_and_takes_eps_1e_8():
    from mixprec import amp

    net, opt = _adamw_eps_1e_8()
    net, opt = amp.initialize(net, opt, "O3", torch.float16, master_weights="fp32")
    x = torch.randn(16, 8, dtype=torch.float16)
    for _ in range(3):
        opt.scale_loss(net(x).float().square().mean()).backward()
        opt.step()
        opt.zero_grad()
    assert int(opt.iterations) == 3
    assert all(torch.isfinite(p).all() for p in net.parameters())
    state = opt.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_float32_storage_refuses_master_weights(level):
    assert check_master_weights(False, level, torch.bfloat16) is False
    with pytest.raises(ValueError, match=f"{level} keeps every parameter in float32"):
        check_master_weights("kahan", level, torch.bfloat16)


def test_level_names_are_checked_and_normalised():
    assert [check_level_name(n) for n in ("o0", " O2 ", "LEAN", "Auto")] == [
        "O0", "O2", "lean", "auto",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="mixprec.rewrite.rewrite"):
        check_level_name("rewrite")  # a level of Model and the command line, not of amp
    with pytest.raises(TypeError, match="level must be a str"):
        check_level_name(2)


@pytest.mark.parametrize("level", [name for name in CONCRETE if LEVEL_SPECS[name].amp])
@pytest.mark.parametrize("dtype", LOW)
def test_initialize_does_what_the_spec_says(level, dtype):
    spec = LEVEL_SPECS[level]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    net, opt = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), level, dtype)
    stored = {
        "float32": (torch.float32, torch.float32),
        "low_norms_float32": (dtype, torch.float32),
        "low": (dtype, dtype),
    }[str(spec.storage)]
    assert (net[0].weight.dtype, net[1].weight.dtype) == stored
    assert opt.loss_scaler.kind == spec.default_loss_scale(dtype).kind
    assert opt.master_weights == mode_of(spec.master_weights).option
    assert net(torch.randn(3, 4)).dtype == torch.float32


# -- the docs' table ------------------------------------------------------------------------


def test_the_level_table_of_the_guide_is_the_spec_table():
    lines = (ROOT / "docs" / "guides" / "levels.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| level | parameters | compute | optimizer steps | default loss scale |")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    shown = "\n".join(lines[start:end])
    assert shown == level_table(), (
        "docs/guides/levels.md's level table differs from mixprec.amp.LEVEL_SPECS; paste:\n"
        + level_table()
    )
    assert len(lines[start:end]) == 2 + len(LEVEL_SPECS)
