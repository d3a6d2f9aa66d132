"""The staging directory of ``ckpt.torch.save_state_dict``: who writes into it, when it
is committed, and when a left-over one (a crashed save's) may be removed. Private; the
rules are documented in python/README.md ("save_state_dict").

A save of ``<parent>/<base>`` writes into ``<parent>/.<base>.partial-<token>/`` (the
token: 32 hex digits, the same on every rank of one save). Every rank that writes into
it first puts its owner file ``.owner-<rank>.json`` there (host name, boot id, process
id and start time) and touches it every :data:`HEARTBEAT_S` seconds until its part is
written; the committing rank removes the owner files, then renames the directory to
``<base>``.

A staging directory is **live** (never removed) when one of its owner files names a
process on this host (same host name and boot id) that is still running (same pid, same
start time), or names another host and was touched less than :data:`STALE_AFTER_S`
seconds ago (the process cannot be asked there); one with no owner file at all (or an
owner file being written) is live while anything in it changed less than
:data:`STALE_AFTER_S` seconds ago. Every other one is **stale**: its save crashed (an
owner on this host whose process is gone is dead at once, however recent its file). Rank 0 of each save removes the stale staging directories beside its
output (names ``.<anything>.partial-<32 hex digits>`` only, never its own save's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
from typing import List, Optional

HEARTBEAT_S = 30.0
"""How often a writing rank touches its owner file."""

STALE_AFTER_S = 15 * 60.0
"""How long an owner file (or a staging directory without one) may go untouched before
the save is taken for dead where its process cannot be asked (another host)."""

_NAME = re.compile(r"^\..+\.partial-[0-9a-f]{32}$")


def staging_name(base: str, token: str) -> str:
    return f".{base}.partial-{token}"


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields after its ')'.
    rest = stat[stat.rfind(")") + 2:].split()
    return rest[19] if len(rest) > 19 else None


def owner_record() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid": pid,
        "start_time": _start_time(pid),
    }


class Owner:
    """This rank's owner file in a staging directory, touched every
    :data:`HEARTBEAT_S` seconds (by a daemon thread) until :meth:`stop`."""

    def __init__(self, staging: str, rank: int) -> None:
        self.path = os.path.join(staging, f".owner-{rank}.json")
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({**owner_record(), "rank": rank}, f)
        os.replace(tmp, self.path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ckpt-save-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)  # never creates it again once the commit removed it
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()


def _process_alive(rec: dict) -> Optional[bool]:
    """Whether the owner's process runs, when it is on this host; None elsewhere."""
    if rec.get("host") != socket.gethostname():
        return None
    boot = _boot_id()
    if rec.get("boot_id") and boot and rec["boot_id"] != boot:
        return False  # this host rebooted since
    pid = rec.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    except OSError:
        return None
    started = rec.get("start_time")
    now = _start_time(pid)
    if started and now and started != now:
        return False  # the pid was reused
    return True


def is_live(staging: str, now: Optional[float] = None) -> bool:
    """Whether a save may still be writing ``staging`` (see the module's rules)."""
    now = time.time() if now is None else now
    try:
        names = os.listdir(staging)
    except FileNotFoundError:
        return False
    owners = [n for n in names if n.startswith(".owner-") and n.endswith(".json")]
    if not owners:
        newest = 0.0
        for p in [staging] + [os.path.join(staging, n) for n in names]:
            try:
                newest = max(newest, os.stat(p).st_mtime)
            except OSError:
                continue
        return now - newest < STALE_AFTER_S
    for n in owners:
        p = os.path.join(staging, n)
        try:
            mtime = os.stat(p).st_mtime
            with open(p) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            return True  # being written or removed right now: not ours to judge
        alive = _process_alive(rec) if isinstance(rec, dict) else None
        if alive is True or (alive is None and now - mtime < STALE_AFTER_S):
            return True
    return False


def remove_stale(parent: str, keep: str) -> List[str]:
    """Removes the stale staging directories in ``parent`` (not ``keep``); returns them."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for n in names:
        p = os.path.join(parent, n)
        if not _NAME.match(n) or os.path.abspath(p) == os.path.abspath(keep):
            continue
        if os.path.isdir(p) and not os.path.islink(p) and not is_live(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def fsync_dir(path: str) -> None:
    """Makes a rename in ``path`` durable (where the platform allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
