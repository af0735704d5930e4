"""The op lists of the graph rewrite: defaults, edits, conflicts, environment overrides."""

import pytest
import torch

from mixprec.rewrite import (
    ALLOW,
    CLEAR,
    DENY,
    INFER,
    PAINT_LEVELS,
    AmpLists,
    explain,
    normalize_op_name,
    rewrite,
)

DEFAULTS = {"allow": ALLOW, "infer": INFER, "deny": DENY, "clear": CLEAR}


def test_default_lists_are_disjoint():
    names = list(DEFAULTS)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert not DEFAULTS[first] & DEFAULTS[second], (first, second)


@pytest.mark.parametrize(
    "op, expected",
    [
        ("linear", "allow"),
        ("addmm", "allow"),
        ("baddbmm", "allow"),
        ("einsum", "allow"),
        ("conv_transpose2d", "allow"),
        ("scaled_dot_product_attention", "allow"),
        # Recurrent layers and cells, allowed as in the classic lists (LSTM, GRU, RNN ops).
        ("lstm", "allow"),
        ("gru", "allow"),
        ("rnn_tanh", "allow"),
        ("rnn_relu", "allow"),
        ("lstm_cell", "allow"),
        ("gru_cell", "allow"),
        ("rnn_tanh_cell", "allow"),
        ("rnn_relu_cell", "allow"),
        ("exp", "deny"),
        ("cumsum", "deny"),
        ("cross_entropy_loss", "deny"),
        ("mse_loss", "deny"),
        ("add", "infer"),
        ("gelu", "infer"),
        ("avg_pool2d", "infer"),
        ("dropout", "infer"),
        ("view", "clear"),
        ("getitem", "clear"),
        ("max_pool2d", "clear"),
        ("relu", "clear"),
        ("pad", "clear"),
        # The contested entries, decided in lists.py with the reasons written there.
        ("softmax", "deny"),
        ("log_softmax", "deny"),
        ("layer_norm", "deny"),
        ("batch_norm", "infer"),
        ("embedding", None),
    ],
)
def test_default_classification(op, expected):
    assert AmpLists().list_of(op) == expected


@pytest.mark.parametrize(
    "spelling",
    ["addmm", "aten.addmm", "aten::addmm", "torch.ops.aten.addmm.default", "addmm_", " addmm "],
)
def test_op_name_spellings_normalize_to_the_short_name(spelling):
    assert normalize_op_name(spelling) == "addmm"
    assert AmpLists().list_of(spelling) == "allow"


def test_add_and_remove_edit_one_list_and_chain():
    lists = AmpLists()
    assert lists.remove("deny", "softmax").add("infer", "softmax") is lists
    assert lists.list_of("softmax") == "infer"
    assert "softmax" not in lists.deny


def test_conflict_names_both_lists_and_leaves_lists_unchanged():
    lists = AmpLists()
    before = lists.copy()
    with pytest.raises(ValueError, match="both the allow list and the deny list"):
        lists.add("allow", "softmax")
    assert lists == before


def test_constructor_conflict_is_an_error():
    with pytest.raises(ValueError, match="'mm' would be in both the allow list and the clear"):
        AmpLists(clear=["mm", "view"])


def test_unknown_op_names_are_errors_with_suggestions():
    with pytest.raises(ValueError, match="unknown op name 'matmull'.*did you mean 'matmul'"):
        AmpLists().add("allow", "matmull")
    with pytest.raises(ValueError, match="unknown op name"):
        AmpLists(deny=["not_an_op_anywhere"])


def test_any_aten_op_can_be_listed():
    assert AmpLists().add("clear", "erfinv").list_of("erfinv") == "clear"


def test_unknown_list_name_and_wrong_types():
    with pytest.raises(ValueError, match="list_name must be one of"):
        AmpLists().add("white", "mm")
    with pytest.raises(TypeError, match=r"write deny=\['exp'\]"):
        AmpLists(deny="exp")
    with pytest.raises(TypeError, match="op names must be strings"):
        AmpLists().add("allow", 3)


def test_removing_an_absent_op_is_an_error():
    with pytest.raises(ValueError, match="'mm' is not on the deny list .*the allow list"):
        AmpLists().remove("deny", "mm")


def test_env_overrides_remove_before_add():
    env = {"MIXPREC_DENYLIST_REMOVE": "softmax, log_softmax", "MIXPREC_ALLOWLIST_ADD": "softmax"}
    lists = AmpLists().with_env(env)
    assert lists.list_of("softmax") == "allow"
    assert lists.list_of("log_softmax") is None


def test_env_overrides_for_every_list(monkeypatch):
    monkeypatch.setenv("MIXPREC_ALLOWLIST_REMOVE", "einsum")
    monkeypatch.setenv("MIXPREC_INFERLIST_ADD", "einsum")
    monkeypatch.setenv("MIXPREC_CLEARLIST_REMOVE", "relu")
    monkeypatch.setenv("MIXPREC_DENYLIST_ADD", "relu,aten.erfinv")
    base = AmpLists()
    lists = base.with_env()
    assert lists.list_of("einsum") == "infer"
    assert lists.list_of("relu") == "deny"
    assert lists.list_of("erfinv") == "deny"
    assert base.list_of("relu") == "clear"  # with_env returns a copy


def test_env_override_errors():
    with pytest.raises(ValueError, match="MIXPREC_ALLOWLIST_ADD='softmaxx'.*did you mean"):
        AmpLists().with_env({"MIXPREC_ALLOWLIST_ADD": "softmaxx"})
    with pytest.raises(ValueError, match="both the allow list and the deny list.*MIXPREC"):
        AmpLists().with_env({"MIXPREC_ALLOWLIST_ADD": "softmax"})
    with pytest.raises(ValueError, match="removes 'mm', which is not on the clear list"):
        AmpLists().with_env({"MIXPREC_CLEARLIST_REMOVE": "mm"})


def test_levels():
    assert set(PAINT_LEVELS) == {"default", "treat_infer_as_deny", "allow_only", "unsafe_force_all"}
    for level in PAINT_LEVELS:
        gm = rewrite(torch.nn.Linear(2, 2), torch.randn(3, 2), dtype=torch.bfloat16, level=level)
        assert explain(gm).level == level
    with pytest.raises(ValueError, match="unknown level 'O1'; accepted levels: 'default'"):
        rewrite(torch.nn.Linear(2, 2), torch.randn(3, 2), level="O1")


def test_repr_and_equality():
    assert AmpLists() == AmpLists()
    assert AmpLists() != AmpLists().remove("clear", "relu")
    assert repr(AmpLists()).startswith("AmpLists(allow=")
