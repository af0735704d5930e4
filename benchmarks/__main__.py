"""``python -m benchmarks``: the suite of :mod:`benchmarks.suite`, with OpenMP set for timing.

``python -m benchmarks step_cost [options]`` runs :mod:`benchmarks.step_cost` instead
(ops, launches and bytes per training step; not part of the suite's workloads).
``python -m benchmarks bit_identity --record|--check FILE`` runs
:mod:`benchmarks.bit_identity` (the bits of a grid of tiny training runs), and
``python -m benchmarks step_trace`` :mod:`benchmarks.step_trace` (the library's
Python functions one training step calls).

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
if sys.argv[1:2] == ["bit_identity"]:
    from benchmarks.bit_identity import main as bit_identity_main  # noqa: E402

    sys.exit(bit_identity_main(sys.argv[2:]))
if sys.argv[1:2] == ["step_trace"]:
    from benchmarks.step_trace import main as step_trace_main  # noqa: E402

    sys.exit(step_trace_main(sys.argv[2:]))

from benchmarks.suite import main  # noqa: E402  (after the environment is set)

sys.exit(main(defaulted=DEFAULTED))
