"""Host memory of this process: resident set now, its high-water mark, and a reset.

``getrusage(RUSAGE_SELF).ru_maxrss`` is the usual way to read a process's peak
memory, but on Linux a child's ``ru_maxrss`` also carries the RSS of the parent it
was forked from (the kernel keeps it across ``exec``), and it cannot be reset. So
this module reads ``VmHWM`` (the same high-water mark, per address space) from
``/proc/self/status``, resets it with ``/proc/self/clear_refs``, and falls back to
``ru_maxrss`` where ``/proc`` is absent.

>>> current = current_rss_mib(); peak = peak_rss_mib()
>>> peak >= current > 0
True
"""

from __future__ import annotations

import gc
import resource
import sys

import torch


def max_rss_mib() -> float:
    """``ru_maxrss`` in MiB (see the module docstring for why it may overstate)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def proc_status_mib(field: str) -> float | None:
    """A ``Vm*`` field (``VmRSS``, ``VmHWM``) of ``/proc/self/status`` in MiB, or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            lines = f.readlines()
    except OSError:  # no /proc: not Linux
        return None
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**10
    return None


def current_rss_mib() -> float:
    """The resident set size now, in MiB (the peak where ``/proc`` is absent)."""
    rss = proc_status_mib("VmRSS")
    return rss if rss is not None else max_rss_mib()


def peak_rss_mib() -> float:
    """The resident-set high-water mark of this address space, in MiB."""
    hwm, rss = proc_status_mib("VmHWM"), proc_status_mib("VmRSS")
    if hwm is None or rss is None:
        return max_rss_mib()
    return max(hwm, rss)  # the kernel raises VmHWM lazily: it may trail VmRSS


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS (Linux); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def live_plain_tensors() -> list[torch.Tensor]:
    """Every live ``torch.Tensor`` or ``Parameter`` of this process (after a garbage
    collection), not meta: the tensors that own storage. Subclasses (fake, functional,
    DTensor) hold none of their own and are left out.

    The filter compares each object's exact type, which is several times cheaper than
    ``torch.is_tensor`` over the millions of objects a long-running process tracks, and
    reads no attribute of other objects (some torch module objects warn when asked).
    Objects moved out of collection by ``gc.freeze()`` are not listed (``gc.get_objects``
    does not see them): a difference taken around new allocations is unaffected.

    >>> t = torch.zeros(3)
    >>> any(x is t for x in live_plain_tensors())
    True
    """
    gc.collect()
    plain = (torch.Tensor, torch.nn.Parameter)
    return [obj for obj in gc.get_objects() if type(obj) in plain and not obj.is_meta]


def live_tensor_bytes() -> int:
    """Bytes of every live plain tensor's storage in this process, each counted once.

    Deterministic where RSS is not: the difference around building a model and its
    optimizer is exactly what they allocate (parameters, state, buffers).

    >>> before = live_tensor_bytes(); kept = torch.zeros(1000); live_tensor_bytes() - before
    4000
    """
    seen: set[int] = set()
    total = 0
    for t in live_plain_tensors():
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
