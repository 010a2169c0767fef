"""Temporary folders of a run, and nothing left behind: `scratch_dir(kind)` makes one
folder per run under the system temp folder and removes it when the run ends, whatever the
outcome; the run's processes get it as TMPDIR, so what they write through `tempfile` (the
Trainer's output_dir, torch elastic's logs) goes with it.

A starter that is SIGKILLed cannot remove its folder, so the name carries its owner
(`planner-<kind>-<pid>-<start ticks>-<random>`, runners.process_identity) and every new
scratch folder first sweeps those whose owner is gone.

Known limitations: a folder made before a reboot by a pid that, after it, is reused with
the same start time is kept until that process ends (start ticks count from boot).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from runners.process_identity import current, identity_of

_NAME = re.compile(r"^planner-(run|launch)-(\d+)-(\d+)-[A-Za-z0-9_]+$")
KINDS = ("run", "launch")


def _owner_is_gone(pid: int, start_ticks: int) -> bool:
    now = identity_of(pid)
    if now is None:
        return True
    return now.start_ticks is not None and now.start_ticks != start_ticks  # None: no /proc, the pid lives


def sweep_orphans(root: Path | None = None) -> list[Path]:
    """Remove the scratch folders under `root` (the temp folder) whose owner is gone; returns them."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        if _owner_is_gone(int(match.group(2)), int(match.group(3))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


@contextmanager
def scratch_dir(kind: str, root: Path | None = None):
    """A fresh private folder for one run (Path), removed on exit; sweeps orphans first."""
    if kind not in KINDS:
        raise ValueError(f"scratch kind must be one of {', '.join(KINDS)}, got {kind!r}")
    root = Path(root or tempfile.gettempdir())
    sweep_orphans(root)
    me = current()
    folder = Path(tempfile.mkdtemp(prefix=f"planner-{kind}-{me.pid}-{me.start_ticks or 0}-", dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def env_with_tmpdir(env: dict, folder: Path) -> dict:
    """`env` with every temp-folder variable pointing into `folder`."""
    return {**env, "TMPDIR": str(folder), "TEMP": str(folder), "TMP": str(folder)}

