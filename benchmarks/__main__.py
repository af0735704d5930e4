"""``python -m benchmarks``: the suite of :mod:`benchmarks.suite`, with OpenMP set for timing.

``OMP_WAIT_POLICY`` must be set before torch loads its OpenMP runtime, hence here,
before any import of torch; a value the user set is kept.
"""

import os
import sys

DEFAULTED = tuple(k for k in ("OMP_WAIT_POLICY",) if k not in os.environ)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.suite import main  # noqa: E402  (after the environment is set)

sys.exit(main(defaulted=DEFAULTED))
