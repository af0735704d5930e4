"""Checkpoints written by mixprec 0.2.0 load into this version and resume bit for bit.

``tests/data/checkpoints_0.2.0/`` holds, per master-weight mode, the model and
``LossScaleOptimizer`` state dicts that 0.2.0 wrote after three steps of a tiny model,
and ``expected.json`` the SHA-256 of the model and optimizer state that 0.2.0 reached
after three more steps from there. Loading each checkpoint here and taking the same
three steps must reach the same bits. Floating-point results depend on the CPU's
kernels, so the digests are compared on the kind of machine they were written on
(``expected.json`` names it); elsewhere the resumed run must still load and step.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec import amp
from mixprec.optim import AdamW8bit

DATA = Path(__file__).parent / "data" / "checkpoints_0.2.0"
EXPECTED = json.loads((DATA / "expected.json").read_text())

CONFIGS = {
    "o2_bf16_fp32": ("O2", torch.bfloat16, "fp32", "adamw"),
    "o2_bf16_split": ("O2", torch.bfloat16, "split", "adamw"),
    "o2_bf16_split8": ("O2", torch.bfloat16, "split8", "adamw"),
    "o2_bf16_split8_adamw8bit": ("O2", torch.bfloat16, "split8", "adamw8bit"),
    "lean_bf16_kahan": ("lean", torch.bfloat16, "kahan", "adamw"),
    "o3_bf16_stochastic": ("O3", torch.bfloat16, "stochastic", "adamw"),
    "o2_fp16_fp32_dynamic": ("O2", torch.float16, "fp32", "sgd"),
    "o3_bf16_none": ("O3", torch.bfloat16, False, "sgd"),
}


def build(name: str) -> tuple[torch.nn.Module, Any]:
    level, dtype, masters, kind = CONFIGS[name]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                              torch.nn.Linear(16, 4))  # fmt: skip
    inner: torch.optim.Optimizer
    if kind == "adamw":
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    elif kind == "adamw8bit":
        inner = AdamW8bit(net.parameters(), lr=1e-2, block_size=16)
    else:
        inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return amp.initialize(net, inner, level, dtype, master_weights=masters)


def last_three_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
    return batches[3:]  # the checkpoints were written after the first three


def digest(net: torch.nn.Module, opt: Any) -> str:
    """SHA-256 of every tensor's dtype, shape and bytes and every other value, by key."""
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        else:
            h.update(repr(value).encode())

    walk(net.state_dict())
    walk(opt.state_dict())
    return h.hexdigest()


def same_machine() -> bool:
    here = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }
    return here == EXPECTED["machine"]


#: The CPU threads 0.2.0 ran with (torch's default on the 2-core machine that wrote the
#: data): a reduction's order, so its last bits, follow how it is split over threads.
WRITTEN_WITH_THREADS = 2


@pytest.fixture
def threads_as_written():
    threads = torch.get_num_threads()
    torch.set_num_threads(WRITTEN_WITH_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_0_2_0_checkpoint_resumes_bit_for_bit(name, threads_as_written):
    assert EXPECTED["mixprec"] == "0.2.0" and set(EXPECTED["digests"]) == set(CONFIGS)
    net, opt = build(name)
    saved = torch.load(DATA / f"{name}.pt", weights_only=True)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    assert int(opt.iterations) == 3
    for x, y in last_three_batches():
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    assert int(opt.iterations) + int(opt.skipped_steps) == 6
    assert all(torch.isfinite(p).all() for p in net.parameters())
    if same_machine():
        assert digest(net, opt) == EXPECTED["digests"][name]
