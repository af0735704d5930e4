"""The mixprec benchmark suite: mixprec measured against its anchors in the same process.

Run ``python -m benchmarks`` (``--quick`` for a short run, ``--markdown
BENCHMARKS.md`` to rewrite the published report). One module per workload:

* :mod:`benchmarks.overhead` - ``LossScaleOptimizer`` vs ``torch.amp.GradScaler`` step time;
* :mod:`benchmarks.host_syncs` - host syncs per optimizer step;
* :mod:`benchmarks.throughput` - training samples/s of every precision recipe;
* :mod:`benchmarks.memory` - peak memory, one process per configuration;
* :mod:`benchmarks.accuracy` - digits test accuracy of every recipe vs float32;
* :mod:`benchmarks.mfu` - model FLOP utilisation against a measured matmul rate.

:mod:`benchmarks.recipes` builds the precision recipes the last four compare;
:mod:`benchmarks.report` turns the JSON results into targets and Markdown;
:mod:`benchmarks.suite` runs the workloads and writes the outputs.
"""
