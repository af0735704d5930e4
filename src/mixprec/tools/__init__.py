"""Measuring tools used by tests, benchmarks and the CLI: host-sync counting, memory readings.

* :class:`~mixprec.tools._syncs.HostSyncCounter` - counts device-to-host syncs in a block.
* :mod:`mixprec.tools._memory` - this process's current and peak resident memory.
* :mod:`mixprec.tools._spawn` - run a function on several local ranks (gloo, bounded in time).
"""

from mixprec.tools._memory import peak_rss_mib, reset_peak_rss
from mixprec.tools._syncs import HostSyncCounter

__all__ = ["HostSyncCounter", "peak_rss_mib", "reset_peak_rss"]
