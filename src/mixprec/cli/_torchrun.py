"""How a ``mixprec`` process started by ``torchrun`` ends on an error: its own line, its
own exit code, on every rank.

``torchrun`` watches its processes every 0.1 s and, once one has exited with an
error, sends SIGTERM to the others. The ranks meet an input error together (they
agree on it, see :func:`mixprec.cli._train.run_train`), but the first to exit would
get the others killed while they still print: their line lost, their exit code
-15. So, under ``torchrun``:

* :func:`failing` (called as soon as a rank knows it is ending with an error, its own
  or another rank's) makes the process ignore SIGTERM from then on: it is already on
  its way out, and finishes that;
* :func:`finish` prints the error line and ends the process at once with its exit code
  (nothing is left to clean up: the run folder's lock and the process group were
  released on the way out).

Until then SIGTERM keeps its default action (a rank blocked in a collective when
another crashed still dies at once).

What the user then sees: every rank's one line (``mixprec: error: ...``), and then
``torchrun``'s own failure summary (a ``ChildFailedError`` listing each rank's exit
code) with ``torchrun``'s exit code 1.

Outside ``torchrun`` nothing here changes anything:

>>> under_torchrun({})
False
>>> under_torchrun({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"})
True
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one of several that ``torchrun`` started."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env and int(env.get("WORLD_SIZE", "1") or 1) > 1


def failing() -> None:
    """This process is ending with an error (its own or its ranks'): under ``torchrun``,
    in the main thread, SIGTERM is ignored from now on."""
    if under_torchrun() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def finish(line: str, code: int) -> int:
    """Print ``line`` on stderr; under ``torchrun`` end the process now with ``code``."""
    print(line, file=sys.stderr)
    if under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
