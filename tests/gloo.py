"""The marker of tests that need ``torch.distributed``'s gloo backend (CPU ranks on
127.0.0.1): such a test is skipped, with the reason, where the backend is missing."""

from __future__ import annotations

import pytest
import torch.distributed as dist

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
