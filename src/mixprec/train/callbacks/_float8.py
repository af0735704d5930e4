"""``Float8Monitor``: per-layer float8 amax, saturation and overflows, in the metrics.

At each epoch's end the callback reads :func:`mixprec.float8.read_float8_stats` of the
trainer's model (one host sync an epoch, none between) and

* puts ``fp8_saturated`` (the largest fraction of elements clipped at the float8
  maximum in any layer's last input, weight or gradient cast) and ``fp8_overflows``
  (casts with an inf/NaN amax so far, all layers) into ``state.metrics``, so a
  :class:`CSVLogger` or :class:`History` placed *after* it records them;
* keeps every layer's statistics for the epoch in ``records``; ``summary()`` is the
  JSON-ready record for a metrics file.

>>> import torch
>>> from mixprec.float8 import Float8Linear
>>> from mixprec.train.callbacks import RunState
>>> net = torch.nn.Sequential(Float8Linear(16, 16))
>>> net(torch.ones(4, 16)).sum().backward()
>>> state, monitor = RunState(epoch=1, model=net), Float8Monitor()
>>> monitor.on_epoch_end(state)
>>> state.metrics["fp8_saturated"], state.metrics["fp8_overflows"]
(0.0, 0.0)
>>> monitor.summary()["epochs"][0]["layers"]["0"]["amax_input"]
1.0
"""

from __future__ import annotations

from typing import Any

from mixprec.train.callbacks._base import Callback, RunState


class Float8Monitor(Callback):
    """Record each float8 layer's statistics at every epoch's end (see the module)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_epoch_end(self, state: RunState) -> None:
        """Read the float8 statistics and put their summary into ``state.metrics``."""
        if state.model is None:
            raise ValueError(
                "Float8Monitor needs the trainer's model in RunState.model; use it with "
                "mixprec.Model.train"
            )
        # Imported here: mixprec.float8 loads when the callback runs, not with mixprec.train.
        from mixprec.float8 import read_float8_stats
        from mixprec.float8._stats import TENSORS

        stats = read_float8_stats(state.model)
        if not stats:
            raise ValueError(
                "Float8Monitor found no float8 layer in the model: convert it first "
                "(amp.initialize(..., fp8=True) or mixprec.float8.convert_to_float8)"
            )
        layers = stats.values()
        state.metrics["fp8_saturated"] = max(
            layer[f"saturated_fraction_{t}"] for layer in layers for t in TENSORS
        )
        state.metrics["fp8_overflows"] = sum(
            layer[f"overflows_{t}"] for layer in layers for t in TENSORS
        )
        self.records.append({"epoch": state.epoch, "layers": stats})

    def summary(self) -> dict[str, Any]:
        """Every epoch's per-layer statistics, JSON-ready."""
        return {"epochs": self.records}
