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


# -- jmp's policy tests, re-expressed (jmp/_src/policy_test.py) -------------------------

JMP_NAMES = {F16: "float16", BF16: "bfloat16", F32: "float32"}


@pytest.mark.parametrize("dtype", list(JMP_NAMES), ids=str)
def test_jmp_get_policy_of_a_dtype_name(dtype):
    assert dtypes(Policy(JMP_NAMES[dtype])) == (dtype,) * 3


@pytest.mark.parametrize("dtype", list(JMP_NAMES), ids=str)
def test_jmp_get_policy_mixed(dtype):
    assert dtypes(Policy(f"c={JMP_NAMES[dtype]}")) == (F32, dtype, dtype)


@pytest.mark.parametrize("dtype", list(JMP_NAMES), ids=str)
def test_jmp_get_policy_compute_with_full_output(dtype):
    assert dtypes(Policy(f"c={JMP_NAMES[dtype]},o=full")) == (F32, dtype, F32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_jmp_with_output_dtype(dtype):
    policy = Policy(F32).with_output_dtype(dtype)
    assert dtypes(policy) == (F32, F32, dtype)
    assert Policy("mixed_bfloat16").with_output_dtype(SPELLINGS[dtype][0]).output_dtype == dtype


def test_jmp_full_and_half_spellings():
    # jmp: "full" is float32; "half" is float16 off TPUs (bfloat16 on them; no TPUs here).
    assert dtypes(Policy("full")) == (F32,) * 3
    assert dtypes(Policy("half")) == (F16,) * 3
    assert dtypes(Policy("p=full,c=half")) == (F32, F16, F16)
    assert dtypes(Policy(compute_dtype="bf16", output_dtype="full")) == (F32, BF16, F32)


def test_jmp_almost_a_dtype_is_an_error():
    with pytest.raises(ValueError, match="unknown policy name 'compute_float16'"):
        Policy("compute_float16")


def test_with_output_dtype_rejects_bad_dtypes_naming_the_argument():
    p = Policy("mixed_float16")
    with pytest.raises(ValueError, match="output_dtype: unknown dtype 'int8'.*full"):
        p.with_output_dtype("int8")
    with pytest.raises(TypeError, match="output_dtype must be a torch.dtype"):
        p.with_output_dtype(3)
    assert p == Policy("mixed_float16")  # frozen: nothing changed


ALL_SPELLINGS = {**SPELLINGS, F32: [*SPELLINGS[F32], "full"]}


def jmp_reference(text: str) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """jmp's get_policy rule, written out independently of mixprec's parser."""
    lookup = {n: d for d, names in ALL_SPELLINGS.items() for n in names}
    named = {"mixed_float16": (F32, F16, F16), "mixed_bfloat16": (F32, BF16, BF16)}
    text = text.strip().lower()
    if "=" not in text:
        return named.get(text) or (lookup[text],) * 3
    found = {}
    for part in text.split(","):
        key, value = (s.strip() for s in part.split("="))
        found[key[0]] = lookup[value]
    param = found.get("p", F32)
    compute = found.get("c", param)
    return param, compute, found.get("o", compute)


def _case(draw, text):
    return draw(st.sampled_from([text, text.upper(), text.capitalize()]))


@st.composite
def policy_texts(draw):
    """Any sentence of the policy grammar: a name, or 1-3 distinct keys in any order,
    each under any alias, with any dtype spelling, case and spaces."""
    space = st.sampled_from(["", " ", "  "])
    if draw(st.booleans()):
        names = [
            "mixed_float16",
            "mixed_bfloat16",
            *[n for ns in ALL_SPELLINGS.values() for n in ns],
        ]
        return draw(space) + _case(draw, draw(st.sampled_from(names))) + draw(space)
    fields = draw(st.lists(st.sampled_from(list(KEYS)), min_size=1, max_size=3, unique=True))
    items = []
    for field in fields:
        key = _case(draw, draw(st.sampled_from(KEYS[field])))
        dtype = draw(st.sampled_from(DTYPES))
        value = _case(draw, draw(st.sampled_from(ALL_SPELLINGS[dtype])))
        items.append(f"{draw(space)}{key}{draw(space)}={draw(space)}{value}{draw(space)}")
    return ",".join(items)


@given(policy_texts())
def test_every_sentence_of_the_grammar_parses_as_jmp_would_and_str_parses_back(text):
    policy = Policy(text)
    assert dtypes(policy) == jmp_reference(text)
    assert Policy(str(policy)) == policy
    assert str(Policy(str(policy))) == str(policy)
