"""The rewrite on real models: accuracy, low-precision ops, float32 parameters, casts.

Run with ``-s`` to see the per-model cast counts next to ``torch.autocast``'s.
"""

import copy
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from mixprec.rewrite import count_casts, explain, rewrite

LOW_DTYPES = [torch.bfloat16, torch.float16]
# Largest |rewritten - float32| relative to the largest |float32 output|.
TOLERANCE = {torch.bfloat16: 0.03, torch.float16: 0.005}


pytestmark = pytest.mark.usefixtures("one_thread")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
        )

    def forward(self, x):
        return self.net(x)


class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class AttentionBlock(nn.Module):
    """Hand-written multi-head self-attention with a residual and a layer norm."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape

        def split(y):
            return y.view(b, t, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        attn = self.drop(scores.softmax(dim=-1))
        y = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.norm(x + self.o(y))


class ResBlock(nn.Module):
    def __init__(self, channels=8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def transformer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested-tensor advice for batch_first
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        return nn.TransformerEncoder(layer, 2)


MODELS = {
    "mlp": (MLP, (16,)),
    "lenet5": (LeNet5, (1, 28, 28)),
    "attention": (AttentionBlock, (6, 16)),
    "resblock": (ResBlock, (8, 8, 8)),
    "transformer": (transformer, (6, 16)),
}
CASES = [(name, dtype) for name in MODELS for dtype in LOW_DTYPES]
IDS = [f"{name}-{str(dtype)[6:]}" for name, dtype in CASES]


def make(name, batch=4, seed=0):
    ctor, shape = MODELS[name]
    torch.manual_seed(seed)
    return ctor(), torch.randn(batch, *shape)


@functools.cache
def rewritten(name, dtype):
    """(float32 model, its rewrite), built once per test session."""
    model, x = make(name)
    return model, rewrite(model, x, dtype=dtype)


class DtypeRecorder(fx.Interpreter):
    """Runs a graph node by node and records the dtype of every tensor it makes."""

    def run(self, *args):
        self.dtypes = {}
        return super().run(*args)

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n] = out.dtype
        return out


def relative_error(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_outputs_match_float32(name, dtype):
    model, gm = rewritten(name, dtype)
    model.eval(), gm.eval()
    x = make(name, batch=3, seed=1)[1]
    with torch.no_grad():
        out, ref = gm(x), model(x)
    assert out.dtype == torch.float32
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_ops_run_in_the_dtype_they_were_painted(name, dtype):
    _, gm = rewritten(name, dtype)
    recorder = DtypeRecorder(gm.train())
    with torch.no_grad():
        recorder.run(make(name, batch=3, seed=2)[1])
    ops = {n: n.meta["mixprec"] for n in recorder.dtypes if "op" in n.meta.get("mixprec", {})}
    allow = [n for n, meta in ops.items() if meta["list"] == "allow"]
    assert allow, "every test model has allow ops"
    assert {recorder.dtypes[n] for n in allow} == {dtype}
    for node, meta in ops.items():
        assert str(recorder.dtypes[node]).endswith(meta["colour"]), node.name


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_parameters_are_the_models_own_float32_parameters(name, dtype):
    model, gm = rewritten(name, dtype)
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    assert {p.dtype for p in gm.parameters()} == {torch.float32}
    assert {id(b) for b in gm.buffers()} == {id(b) for b in model.buffers()}


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_gradients_reach_the_float32_parameters(name, dtype):
    model, gm = rewritten(name, dtype)
    reference = copy.deepcopy(model).eval()
    model.eval(), gm.eval()
    x = make(name, batch=3, seed=3)[1]
    model.zero_grad(set_to_none=True)
    # A fixed random direction: a normalised output's squared mean is nearly flat.
    direction = torch.randn(reference(x).shape, generator=torch.Generator().manual_seed(0))
    (gm(x) * direction).sum().backward()
    (reference(x) * direction).sum().backward()
    ours, theirs = [], []
    for (pname, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, pname
        ours.append(p.grad.flatten())
        theirs.append(ref.grad.flatten())
    ours, theirs = torch.cat(ours), torch.cat(theirs)
    model.zero_grad(set_to_none=True)
    # Compared as one vector: a ReLU input rounded across zero legitimately flips
    # a few single elements, but the gradient as a whole must agree.
    assert F.cosine_similarity(ours, theirs, dim=0) > 0.995
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.05


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
@pytest.mark.parametrize("batch", [1, 5])
def test_other_batch_sizes_than_the_example(name, dtype, batch):
    model, gm = rewritten(name, dtype)
    model.eval(), gm.eval()
    x = make(name, batch=batch, seed=4)[1]
    with torch.no_grad():
        out, ref = gm(x), model(x)
    assert out.shape == ref.shape
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_casts_at_most_those_of_autocast(name, dtype):
    model, gm = rewritten(name, dtype)
    model.eval(), gm.eval()
    x = make(name, batch=3, seed=5)[1]
    ours = count_casts(gm, x)
    theirs = count_casts(model, x, autocast_dtype=dtype)
    assert ours == explain(gm).casts, explain(gm).summary
    assert ours <= theirs, (ours, theirs, explain(gm).summary)


def test_explain_names_the_users_modules():
    _, gm = rewritten("transformer", torch.bfloat16)
    report = explain(gm)
    by_module = {(row.module, row.op): row for row in report.rows}
    assert by_module[("layers.0.linear1", "linear")].colour == "bfloat16"
    assert by_module[("layers.1.norm2", "layer_norm")].reason == "deny: on the deny list"
    assert ("layers.1.self_attn", "scaled_dot_product_attention") in by_module
    assert report.summary.startswith("converted ") and report.summary.endswith(" casts")


@pytest.mark.parametrize("name", ["attention", "transformer"])
def test_dropout_follows_train_and_eval(name):
    model, gm = rewritten(name, torch.bfloat16)
    x = make(name, batch=3, seed=6)[1]
    with torch.no_grad():
        gm.train()
        assert not torch.equal(gm(x), gm(x))
        gm.eval()
        model.eval()
        first = gm(x)
        assert torch.equal(first, gm(x))
        assert relative_error(first, model(x)) < TOLERANCE[torch.bfloat16]


def test_batch_norm_updates_running_stats_in_train_mode_only():
    model, x = make("resblock")
    gm = rewrite(model, x, dtype=torch.bfloat16)
    mean_before = model.bn1.running_mean.clone()
    with torch.no_grad():
        gm.train()
        gm(x + 1.0)
    assert int(model.bn1.num_batches_tracked) == 1
    assert not torch.equal(model.bn1.running_mean, mean_before)
    assert model.bn1.running_mean.dtype == torch.float32
    frozen = [b.clone() for b in model.buffers()]
    with torch.no_grad():
        gm.eval()
        model.eval()
        out = gm(x)
    assert all(torch.equal(a, b) for a, b in zip(frozen, model.buffers(), strict=True))
    assert relative_error(out, model(x)) < TOLERANCE[torch.bfloat16]


def test_the_result_starts_in_the_models_mode():
    model, x = make("mlp")
    assert rewrite(model.eval(), x, dtype=torch.bfloat16).training is False
    assert model.training is False


class Mixed(nn.Module):
    """Integer indices, a float64 buffer and float32 activations in one model."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.tensor([2.0], dtype=torch.float64))

    def forward(self, idx, x):
        h = self.fc(self.embed(idx) + x)
        return h, h.argmax(dim=-1), h.double() * self.scale


def test_integer_and_float64_values_are_left_alone():
    model = Mixed()
    idx, x = torch.randint(0, 10, (4, 5)), torch.randn(4, 5, 8)
    gm = rewrite(model, (idx, x), dtype=torch.bfloat16)
    recorder = DtypeRecorder(gm)
    with torch.no_grad():
        h, arg, wide = recorder.run(idx[:3], x[:3])
        ref_h, _, ref_wide = model(idx[:3], x[:3])
    assert (h.dtype, arg.dtype, wide.dtype) == (torch.float32, torch.int64, torch.float64)
    assert relative_error(wide, ref_wide) < TOLERANCE[torch.bfloat16]
    casts = [n for n in gm.graph.nodes if n.meta.get("mixprec", {}).get("role") == "cast"]
    assert casts and {recorder.dtypes[n.args[0]] for n in casts} <= {torch.float32, torch.bfloat16}
    rows = {row.op: row for row in explain(gm).rows}
    assert rows["embedding"].colour == "float32" and rows["linear"].colour == "bfloat16"
    assert model.scale.dtype == torch.float64
