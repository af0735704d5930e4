"""A model that computes its own loss in ``forward`` (nanoGPT, Hugging Face models given
``labels``): what each level does with that loss, and how to keep it float32.

At O2/O3/lean the forward runs in low precision, so ``F.cross_entropy`` inside it takes
bfloat16 logits and returns a bfloat16 loss, which leaves the model cast to float32
(rounded to bfloat16 on the way). Listing the loss function in ``black_list`` runs it in
float32 and keeps its output float32, as ``torch.autocast`` does; computing the loss
outside ``forward`` from the model's float32 output gives the same number."""

from __future__ import annotations

import pytest
import real_models
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch import nn

from mixprec import amp

BF16, F32 = torch.bfloat16, torch.float32
NORMS = [t for t in amp.get_black_list() if isinstance(t, type)]  # the default's modules


class TinyGPT(nn.Module):
    """nanoGPT's shape: tied embedding and head, the loss computed in ``forward``."""

    def __init__(self, vocab: int = 11, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.wte(idx)
        logits = self.lm_head(self.ln_f(x + self.block(x)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (3, 8), generator=g), torch.randint(0, 11, (3, 8), generator=g)


def logits_seen(model: TinyGPT) -> list[torch.Tensor]:
    """The head's output as the forward computes with it (before the root's cast)."""
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    return seen


@pytest.mark.parametrize("level", ["O2", "O3", "lean"])
def test_by_default_a_loss_in_forward_is_computed_in_low_precision(level):
    """What the levels guide says happens: cross-entropy on the bfloat16 logits, its
    bfloat16 result cast to float32 when it leaves the model."""
    model, _ = amp.initialize(TinyGPT(), level=level, dtype=BF16)
    seen = logits_seen(model)
    idx, targets = tokens()
    _, loss = model(idx, targets)
    assert seen[0].dtype == BF16 and loss.dtype == F32
    low = F.cross_entropy(seen[0].view(-1, 11), targets.view(-1), ignore_index=-1)
    assert low.dtype == BF16 and torch.equal(loss, low.float())


@pytest.mark.parametrize("level", ["O2", "O3", "lean"])
def test_a_listed_loss_function_runs_and_stays_float32(level):
    """``black_list=[..., F.cross_entropy]``: the loss is cross-entropy in float32 on the
    logits the model computed (as ``torch.autocast`` computes it), never rounded to
    bfloat16; its gradient reaches the low-precision layers."""
    model, _ = amp.initialize(
        TinyGPT(), level=level, dtype=BF16, black_list=[*NORMS, F.cross_entropy]
    )
    seen = logits_seen(model)
    idx, targets = tokens()
    logits, loss = model(idx, targets)
    assert seen[0].dtype == BF16 and loss.dtype == F32
    want = F.cross_entropy(seen[0].float().view(-1, 11), targets.view(-1), ignore_index=-1)
    assert torch.equal(loss, want)
    # ...which is the loss computed outside forward from the model's float32 output.
    outside = F.cross_entropy(logits.view(-1, 11), targets.view(-1), ignore_index=-1)
    assert torch.equal(loss, outside)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_listed_loss_function_stays_float32_under_compile():
    model, _ = amp.initialize(
        TinyGPT(), level="O2", dtype=BF16, black_list=[*NORMS, F.cross_entropy]
    )
    idx, targets = tokens()
    eager = model(idx, targets)[1]
    dynamo.reset()
    try:
        compiled = torch.compile(lambda i, t: model(i, t)[1], backend="eager")(idx, targets)
    finally:
        dynamo.reset()
    assert compiled.dtype == F32 and torch.equal(compiled, eager)


def test_other_listed_functions_still_hand_back_the_regions_dtype():
    """Only loss functions keep a float32 output: a listed softmax inside the bfloat16
    region runs in float32 and returns bfloat16, so the matmul after it still runs."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.qk = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = torch.softmax(self.qk(x) @ x.transpose(-1, -2), dim=-1)
            return scores @ x

    model, _ = amp.initialize(
        Attention(), level="O2", dtype=BF16, black_list=[F.softmax, torch.softmax]
    )
    assert model(torch.randn(2, 3, 4)).dtype == F32  # no dtype clash inside


def test_hugging_face_models_given_labels_upcast_the_logits_themselves():
    """Transformers' causal-LM loss casts the logits to float32 before cross-entropy, so
    at O2 the loss of a GPT-2 given ``labels`` is already float32 arithmetic on the
    bfloat16 logits: the same as the loss computed outside from its float32 output."""
    model = real_models.gpt2(layers=1, width=32)
    amp.initialize(model, level="O2", dtype=BF16)
    ids = real_models.char_batches(batch=2, length=12, steps=1)[0][0].contiguous()
    with torch.no_grad():
        out = model(ids, labels=ids)
    vocab = out.logits.size(-1)
    outside = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    assert out.loss.dtype == F32
    # Equal up to the order of the mean (bfloat16 rounding would be ~1e-3 relative).
    torch.testing.assert_close(out.loss, outside, rtol=1e-6, atol=0)
