"""The run's memory cgroup, parent side: where runs get their cgroups, and one capped cgroup per run.

Which hierarchy is used, and what the cap covers, is in the package docstring (``Mechanism.memory``).
"""

from __future__ import annotations

import functools
import os
import secrets


def _own_cgroup(fstype: str, controller: str | None) -> str | None:
    """Directory of this process's cgroup in the hierarchy mounted as *fstype* (v1: the one
    holding *controller*), or None if that hierarchy is not mounted here."""
    with open("/proc/self/cgroup") as f:
        own = [line.rstrip("\n").split(":", 2) for line in f]
    path = next((p for hid, ctl, p in own if (hid == "0" if controller is None else controller in ctl.split(","))), None)
    if path is None:
        return None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            kind, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3]
            if kind == fstype and (controller is None or controller in options.split(",")):
                rel = os.path.relpath(path, fields[3])  # fields[3]: the part of the hierarchy mounted
                if not rel.startswith(".."):
                    return os.path.normpath(os.path.join(fields[4], rel))
    return None


def _memory_delegated(path: str) -> bool:
    """Whether cgroup v2 children of *path* get the memory controller. Enabling it is refused
    while *path* itself holds processes (v2's "no internal processes" rule)."""
    with open(os.path.join(path, "cgroup.subtree_control")) as f:
        if "memory" in f.read().split():
            return True
    try:
        with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
        return True
    except OSError:
        return False


@functools.cache
def _cgroup_parent() -> tuple[str, int] | None:
    """(directory, version) under which runs get their memory cgroups: the caller's own cgroup,
    v2 preferred; None if neither hierarchy lets us make a capped child there."""
    try:
        v2 = _own_cgroup("cgroup2", None)
        if v2 is not None and _memory_delegated(v2):
            return v2, 2
        v1 = _own_cgroup("cgroup", "memory")
        if v1 is not None and os.access(v1, os.W_OK):
            return v1, 1
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Cgroup:
    """A fresh memory cgroup for one run, capped at *limit* bytes of RAM (+ swap)."""

    def __init__(self, parent: str, version: int, limit: int):
        self.version = version
        self.path = os.path.join(parent, f"rzero-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.path)
        try:
            if version == 2:
                self._write("memory.max", limit)
                self._write("memory.swap.max", 0, optional=True)
            else:
                self._write("memory.limit_in_bytes", limit)
                self._write("memory.memsw.limit_in_bytes", limit, optional=True)  # RAM + swap; after RAM
            # Opened here; the sandboxed child writes ``0`` (itself) once the host filesystem is out
            # of its view. Moving a whole process (cgroup.procs) waits for an RCU grace period
            # (~10 ms); v1's per-thread ``tasks`` file moving its writer does not, and the child
            # is single-threaded then. v2 has no such file for a memory (domain) cgroup.
            self.join_fd = os.open(os.path.join(self.path, "cgroup.procs" if version == 2 else "tasks"),
                                   os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            os.rmdir(self.path)
            raise

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        path = os.path.join(self.path, name)
        if optional and not os.path.exists(path):
            return  # the swap files exist only where the kernel accounts swap
        with open(path, "w") as f:
            f.write(str(value))

    def oom_kills(self) -> int:
        with open(os.path.join(self.path, "memory.events" if self.version == 2 else "memory.oom_control")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        os.close(self.join_fd)
        try:
            os.rmdir(self.path)
        except OSError:
            pass  # only if a process of the run survived every kill: the cgroup, and its cap, stay
