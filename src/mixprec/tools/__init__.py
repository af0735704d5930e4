"""Measuring tools used by tests, benchmarks and the CLI: host-sync counting, memory
readings, and several local ranks.

* :class:`HostSyncCounter` - counts device-to-host syncs in a block.
* :func:`peak_rss_mib`, :func:`reset_peak_rss` - this process's peak resident memory,
  and a reset; :func:`live_tensor_bytes` - the bytes of every live tensor, so that what
  a block allocates is a difference (:mod:`mixprec.tools._memory`).
* :func:`run_on_ranks` - run a function on several local ranks joined by
  ``torch.distributed`` (gloo, bounded in time); :func:`free_port` - a free TCP port on
  ``127.0.0.1``, for a ``torchrun`` of one's own (:mod:`mixprec.tools._spawn`).
"""

from mixprec.tools._memory import live_tensor_bytes, peak_rss_mib, reset_peak_rss
from mixprec.tools._spawn import free_port, run_on_ranks
from mixprec.tools._syncs import HostSyncCounter

__all__ = [
    "HostSyncCounter",
    "peak_rss_mib",
    "reset_peak_rss",
    "live_tensor_bytes",
    "run_on_ranks",
    "free_port",
]
