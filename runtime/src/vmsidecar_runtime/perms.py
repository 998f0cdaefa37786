"""Who may use the shared directory: the runtime's user and one peer (the exporter), never everyone.

Sockets are 0660 and the directory 2770. When the runtime runs as root next to an exporter with
another UID (upstream's pool pods: runtime UID 0, exporter UID 65532, no fsGroup), set
``VMSIDECAR_SOCKET_OWNER=UID[:GID]`` and the runtime hands its sockets to that user; the directory
stays root's (0755), so that user connects but adds, renames and removes nothing in it: a link it
planted there (``.runtime.lock``, a socket's name between its bind and its chown) was followed by
the root runtime, which then truncated or chowned the link's target.
"""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path

from vmsidecar_contract.errors import HostError, SpecError

#: ``prctl(PR_SET_DUMPABLE, …)`` (linux/prctl.h)
_PR_SET_DUMPABLE = 4

ENV = "VMSIDECAR_SOCKET_OWNER"
#: ids from 0 up to, not including, (uid_t) -1
MAX_ID = 2**32 - 1


def socket_owner() -> tuple[int, int] | None:
    """``(uid, gid)`` from ``VMSIDECAR_SOCKET_OWNER``, or None.

    :raise SpecError: when the variable is not ``UID`` or ``UID:GID``.
    """
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    uid, _, gid = value.partition(":")
    try:
        ids = int(uid), int(gid or uid)
    except ValueError:
        ids = (-1, -1)
    # -1 is chown's "leave it as it is" (the sockets stayed root's), 2**32 - 1 the same as a uid_t
    if not all(0 <= i < MAX_ID for i in ids):
        raise SpecError(f"{ENV}={value!r} is not UID or UID:GID; use numbers, e.g. 65532 or 65532:65532")
    return ids


def handing_to_owner() -> bool:
    """Whether this root runtime hands its sockets to another user (``VMSIDECAR_SOCKET_OWNER``)."""
    return os.geteuid() == 0 and socket_owner() is not None


def share(path: Path, mode: int) -> None:
    """Set ``mode`` and, when running as root with an owner configured, hand ``path`` (a socket) to
    that owner; never through a symbolic link (the file itself is changed, by an ``O_PATH`` handle).

    :raise HostError: ``path`` is a symbolic link.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise HostError(f"{path} is a symbolic link where the runtime made a socket; something else "
                            "writes into the shared directory: give the runtime a directory of its own")
        inode = f"/proc/self/fd/{fd}"
        os.chmod(inode, mode)
        owner = socket_owner()
        if owner is not None and os.geteuid() == 0:
            os.chown(inode, *owner)
    finally:
        os.close(fd)


def share_dir(path: Path) -> None:
    """The shared directory's mode: 2770 for the runtime's user and group; a root runtime that hands
    its sockets to an owner keeps it root's, 0755 (that user connects, but writes nothing there).

    :raise HostError: ``path`` is a symbolic link or not a directory.
    :raise PermissionError: the directory is another user's (a volume mounted as the directory itself).
    """
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise HostError(f"the shared directory {path} is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
                        "give the runtime a directory of its own (--shared-dir)")
    if handing_to_owner():
        os.chown(path, 0, 0, follow_symlinks=False)
        os.chmod(path, 0o755)
    else:
        os.chmod(path, 0o2770)


def forbid_inspection() -> None:
    """Keep processes of the runtime's own UID out of it: its ``/proc`` files (``environ``, ``fd``,
    ``mem``) and ``ptrace`` need CAP_SYS_PTRACE from now on, and it leaves no core dump. QEMU runs as
    that UID, and a guest escaped into it would read the registry credentials there first.

    :raise OSError: the kernel refused (never on Linux).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def restrict_umask() -> int:
    """Take write permission for others out of the process umask; returns the new umask.

    Called once at start, before any thread exists. A socket's mode at ``bind`` is 0777 minus the
    umask and ``connect`` needs write permission, so no one outside the owner and group can
    connect before ``share`` sets 0660. This replaces a temporary ``umask(0o117)`` around each
    bind: the umask is per process, and a directory a worker thread created in that instant (the
    image cache, during the API socket's bind) came out 0660, unusable by a runtime that is not root.
    """
    # a root runtime handing its sockets to another user makes what it creates in the shared
    # directory (its subdirectories) writable by no one else either
    wanted = 0o022 if handing_to_owner() else 0o002
    current = os.umask(0o077)
    os.umask(current | wanted)
    return current | wanted
