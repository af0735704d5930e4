"""``python -m benchmarks``: the suite of :mod:`benchmarks.suite`, with OpenMP set for timing.

``python -m benchmarks step_cost [options]`` runs :mod:`benchmarks.step_cost` instead
(ops, launches and bytes per training step; not part of the suite's workloads).

``OMP_WAIT_POLICY`` must be set before torch loads its OpenMP runtime, hence here,
before any import of torch; a value the user set is kept.
"""

import os
import sys

DEFAULTED = tuple(k for k in ("OMP_WAIT_POLICY",) if k not in os.environ)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if sys.argv[1:2] == ["step_cost"]:  # its own command line: python -m benchmarks step_cost ...
    from benchmarks.step_cost import main as step_cost_main  # noqa: E402

    sys.exit(step_cost_main(sys.argv[2:]))

from benchmarks.suite import main  # noqa: E402  (after the environment is set)

sys.exit(main(defaulted=DEFAULTED))
