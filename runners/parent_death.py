"""A run's processes die with the process that started them, even when it is SIGKILLed
and cannot clean up: `die_with_parent()` asks the kernel (Linux prctl PR_SET_PDEATHSIG) to
send this process SIGKILL when its parent exits, then checks that the parent did not exit
already (the request would then never fire).

Called first thing by the run child (runners.child) and by each rank (runners.rank_worker,
whose parent is torchrun); torchrun itself, which is not ours to edit, is started through
this module as a wrapper that does the same and then becomes torchrun (the setting
survives exec):

    python -m runners.parent_death PARENT_PID -m torch.distributed.run ...

So a SIGKILLed verify kills its child, or torchrun, whose death kills every rank.

Known limitations: Linux only (elsewhere this does nothing: the parent's own clean-up is
all there is). The kernel watches the parent *thread* that started the process: a caller
must wait for its child in the thread that started it (runners.isolation and
runners.launch do). A grandchild the run itself starts is not covered (none is: data
loaders run with no worker processes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PARENT_PID_ENV = "PLANNER_PARENT_PID"  # set by the starter: the pid the child must outlive
_PR_SET_PDEATHSIG = 1


def _prctl_pdeathsig(number: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(number), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int | None = None) -> bool:
    """SIGKILL this process when its parent exits; exits at once if the parent (the pid
    `expected_parent`, else the one this process started under) is gone already.
    Returns whether the kernel took the request."""
    parent = os.getppid()
    armed = _prctl_pdeathsig(signal.SIGKILL)
    # Re-read after arming: a parent that died before prctl left us to a reaper (pid 1 or
    # a subreaper), and the signal will never come.
    now = os.getppid()
    if now != parent or now == 1 or (expected_parent is not None and now != expected_parent):
        os._exit(128 + signal.SIGKILL)
    return armed


def expected_parent_from_env() -> int | None:
    text = os.environ.get(PARENT_PID_ENV, "")
    return int(text) if text.isdigit() else None


def wrapper_command(parent_pid: int, argv: list[str]) -> list[str]:
    """`argv` (a Python command line without the interpreter) started through this wrapper."""
    return [sys.executable, "-m", "runners.parent_death", str(parent_pid), *argv]


def main() -> None:
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m runners.parent_death PARENT_PID PYTHON_ARGS...")
    die_with_parent(int(sys.argv[1]))
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])


if __name__ == "__main__":
    main()
