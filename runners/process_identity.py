"""Who owns a run, and whether that process is still alive: a token a record can carry
across process lifetimes (the run history stores it with each unfinished run; the
scratch folders carry it in their names).

A pid alone is not an identity: pids are reused. The token is
`host/boot id/pid/start time`, the start time in clock ticks since boot (field 22 of
/proc/<pid>/stat), so a reused pid, a reboot (new boot id) and a zombie all read as "gone".
Stdlib only: the run history imports this without torch.

Known limitations: another host's process cannot be checked (answer: unknown, so its
runs are left alone); a pid seen from another pid namespace (a container sharing the
data directory) is a different process, and reads as gone unless the pids collide;
without /proc (not Linux) the start time is unknown and only the pid is checked.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class ProcessIdentity:
    host: str
    boot_id: str | None  # None without /proc
    pid: int
    start_ticks: int | None  # None without /proc

    def token(self) -> str:
        return "/".join((self.host, self.boot_id or "", str(self.pid), "" if self.start_ticks is None
                         else str(self.start_ticks)))

    @classmethod
    def from_token(cls, token: str) -> ProcessIdentity | None:
        """The identity a `token()` wrote; None for text that is not one."""
        parts = token.rsplit("/", 3) if isinstance(token, str) else []
        if len(parts) != 4 or not parts[2].isdigit() or not (parts[3] == "" or parts[3].isdigit()):
            return None
        return cls(parts[0], parts[1] or None, int(parts[2]), int(parts[3]) if parts[3] else None)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after "pid (comm) ": state is [0], start time [19]; None when gone."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat[stat.rfind(")") + 2:].split()


def _boot_id() -> str | None:
    text = _read(_BOOT_ID)
    return text.strip() if text else None


def identity_of(pid: int) -> ProcessIdentity | None:
    """The identity of live process `pid` on this host; None when it is gone."""
    boot_id = _boot_id()
    if boot_id is None:  # no /proc: the pid is all there is
        return ProcessIdentity(socket.gethostname(), None, pid, None) if _pid_exists(pid) else None
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return ProcessIdentity(socket.gethostname(), boot_id, pid, int(fields[19]))


def current() -> ProcessIdentity:
    # identity_of reads /proc/self/stat, which a live process always has; the fallback
    # (start time unknown: only the pid is checked) covers a /proc that cannot be read.
    return identity_of(os.getpid()) or ProcessIdentity(socket.gethostname(), _boot_id(), os.getpid(), None)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def is_alive(identity: ProcessIdentity) -> bool | None:
    """True or False for a process of this host; None (unknown) for another host's."""
    if identity.host != socket.gethostname():
        return None
    now = identity_of(identity.pid)
    if now is None:
        return False
    if identity.boot_id is not None and now.boot_id is not None and identity.boot_id != now.boot_id:
        return False  # rebooted since: every process of that boot is gone
    if identity.start_ticks is not None and now.start_ticks is not None:
        return identity.start_ticks == now.start_ticks  # different: the pid was reused
    return True
