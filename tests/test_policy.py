"""Policy: names, the p=/c=/o= grammar, str() round trip, global and scoped policies."""

from __future__ import annotations

import copy
import pickle
import threading
from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mixprec.policy import (
    POLICY_NAMES,
    Policy,
    cast_floating,
    global_policy,
    policy_scope,
    set_global_policy,
)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [F32, F16, BF16, F64]
SPELLINGS = {
    F32: ["f32", "fp32", "float32", "float"],
    F16: ["f16", "fp16", "float16", "half"],
    BF16: ["bf16", "bfloat16"],
    F64: ["f64", "fp64", "float64", "double"],
}
KEYS = {
    "param_dtype": ["p", "param", "params"],
    "compute_dtype": ["c", "compute"],
    "output_dtype": ["o", "output"],
}


def dtypes(p: Policy) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    return p.param_dtype, p.compute_dtype, p.output_dtype


@pytest.fixture(autouse=True)
def _reset_global_policy():
    yield
    set_global_policy(None)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float32", (F32, F32, F32)),
        ("float16", (F16, F16, F16)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("float64", (F64, F64, F64)),
        # Keras: variables float32, computations and layer outputs in the compute dtype.
        ("mixed_float16", (F32, F16, F16)),
        ("mixed_bfloat16", (F32, BF16, BF16)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        (" P = fp32 , C = half ", (F32, F16, F16)),
        ("c=bf16", (F32, BF16, BF16)),
        ("p=f16", (F16, F16, F16)),
        ("o=f32,c=f16,p=f32", (F32, F16, F32)),
        ("half", (F16, F16, F16)),
    ],
)
def test_names_and_grammar(name, expected):
    assert dtypes(Policy(name)) == expected


def test_mixed_policies_output_compute_dtype_and_print_their_names():
    assert str(Policy("p=f32,c=f16,o=f16")) == "mixed_float16"
    assert str(Policy("p=f32,c=bf16,o=bf16")) == "mixed_bfloat16"
    assert str(Policy("p=f32,c=bf16,o=f32")) == "p=f32,c=bf16,o=f32"
    assert repr(Policy("mixed_float16")) == "Policy('mixed_float16')"
    assert Policy("mixed_float16").is_mixed and not Policy("float16").is_mixed


def test_other_constructors():
    assert Policy(torch.bfloat16) == Policy("bfloat16")
    p = Policy("mixed_float16")
    assert Policy(p) == p and Policy(p) is not p
    assert dtypes(Policy(compute_dtype="bf16", output_dtype=torch.float32)) == (F32, BF16, F32)
    assert dtypes(Policy(param_dtype=torch.float16)) == (F16, F16, F16)


@given(st.tuples(*[st.sampled_from(DTYPES)] * 3))
def test_str_round_trips(triple):
    policy = Policy(param_dtype=triple[0], compute_dtype=triple[1], output_dtype=triple[2])
    assert dtypes(policy) == triple
    assert Policy(str(policy)) == policy
    assert eval(repr(policy), {"Policy": Policy}) == policy  # repr round trip


@given(
    triple=st.tuples(*[st.sampled_from(DTYPES)] * 3),
    data=st.data(),
)
def test_every_spelling_parses_to_the_same_policy(triple, data):
    fields = list(KEYS)
    order = data.draw(st.permutations(fields))
    items = []
    for field in order:
        key = data.draw(st.sampled_from(KEYS[field]))
        spelled = data.draw(st.sampled_from(SPELLINGS[triple[fields.index(field)]]))
        items.append(f"{key}={spelled}")
    text = ",".join(items)
    assert dtypes(Policy(text)) == triple
    assert Policy(text) == Policy(str(Policy(text)))


def test_frozen_hashable_picklable():
    p = Policy("mixed_bfloat16")
    with pytest.raises(AttributeError):
        p.compute_dtype = torch.float32  # type: ignore[misc]
    assert len({p, Policy("p=f32,c=bf16,o=bf16"), Policy("float32")}) == 2
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p


@pytest.mark.parametrize(
    "bad, error, fragment",
    [
        ("mixed_int8", ValueError, "'mixed_float16'"),  # lists the accepted names
        ("", ValueError, "unknown policy name"),
        ("p=f32,c=int8", ValueError, "accepted spellings"),
        ("p=f32,q=f16", ValueError, "key one of"),
        ("p=f32,p=f16", ValueError, "twice"),
        ("p=f32;c=f16", ValueError, "accepted spellings"),
        (torch.int32, ValueError, "floating dtype"),
        (3, TypeError, "str, torch.dtype or Policy"),
    ],
)
def test_bad_names_raise_with_the_value_and_the_fix(bad, error, fragment):
    with pytest.raises(error) as info:
        Policy(bad)
    assert fragment in str(info.value)


def test_name_and_keywords_together_or_nothing_raise():
    with pytest.raises(TypeError, match="not both"):
        Policy("float32", compute_dtype=torch.float16)
    with pytest.raises(TypeError, match="needs a name"):
        Policy()
    with pytest.raises(TypeError, match="compute_dtype"):
        Policy(compute_dtype=1.5)


def test_policy_names_constant_lists_every_named_policy():
    assert set(POLICY_NAMES) == {
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "mixed_float16",
        "mixed_bfloat16",
    }
    for name in POLICY_NAMES:
        assert str(Policy(name)) == name


def test_global_policy_set_and_reset():
    assert global_policy() == Policy("float32")
    set_global_policy("mixed_float16")
    assert global_policy() == Policy("mixed_float16")
    with pytest.raises(ValueError):
        set_global_policy("nonsense")
    assert global_policy() == Policy("mixed_float16")  # a rejected call changes nothing
    set_global_policy(None)
    assert global_policy() == Policy("float32")


def test_scope_nests_restores_on_error_and_beats_the_global_policy():
    set_global_policy("mixed_float16")
    with policy_scope("bfloat16") as outer:
        assert outer == global_policy() == Policy("bfloat16")
        with policy_scope("p=f32,c=bf16,o=f32"):
            assert str(global_policy()) == "p=f32,c=bf16,o=f32"
        assert global_policy() == Policy("bfloat16")
        with pytest.raises(RuntimeError):
            with policy_scope("float16"):
                raise RuntimeError("boom")
        assert global_policy() == Policy("bfloat16")
    assert global_policy() == Policy("mixed_float16")


def test_scope_is_local_to_its_thread():
    seen = []
    with policy_scope("bfloat16"):
        worker = threading.Thread(target=lambda: seen.append(global_policy()))
        worker.start()
        worker.join()
    assert seen == [Policy("float32")]


def test_cast_floating_casts_only_floating_tensors_and_keeps_containers():
    Pair = namedtuple("Pair", "a b")
    x, ids = torch.ones(2, requires_grad=True), torch.arange(3)
    tree = {"pair": Pair(x, ids), "list": [x, 1.5], "od": OrderedDict(k=x)}
    out = cast_floating(tree, torch.bfloat16)
    assert isinstance(out["pair"], Pair) and out["pair"].a.dtype == torch.bfloat16
    assert out["pair"].b is ids and out["list"][1] == 1.5
    assert isinstance(out["od"], OrderedDict) and out["od"]["k"].dtype == torch.bfloat16
    out["pair"].a.float().sum().backward()  # the cast is differentiable
    assert torch.equal(x.grad, torch.ones(2))
    same = (x.detach(), ids)
    assert cast_floating(same, torch.float32) is same


def test_policy_cast_helpers():
    p = Policy("p=f32,c=bf16,o=f16")
    x = torch.ones(2)
    assert p.cast_to_compute(x).dtype == torch.bfloat16
    assert p.cast_to_output([x])[0].dtype == torch.float16
    assert p.cast_to_param(x) is x
