"""Who may use the shared directory: the runtime's user and one peer (the exporter), never everyone.

Sockets are 0660 and the directory 0770. When the runtime runs as root next to an exporter with
another UID (upstream's pool pods: runtime UID 0, exporter UID 65532, no fsGroup), set
``VMSIDECAR_SOCKET_OWNER=UID[:GID]`` and the runtime hands its sockets and directory to that user.
"""

from __future__ import annotations

import os
from pathlib import Path

from vmsidecar_contract.errors import SpecError

ENV = "VMSIDECAR_SOCKET_OWNER"


def socket_owner() -> tuple[int, int] | None:
    """``(uid, gid)`` from ``VMSIDECAR_SOCKET_OWNER``, or None.

    :raise SpecError: when the variable is not ``UID`` or ``UID:GID``.
    """
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    uid, _, gid = value.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        raise SpecError(f"{ENV}={value!r} is not UID or UID:GID; use numbers, e.g. 65532 or 65532:65532") from None


def share(path: Path, mode: int) -> None:
    """Set ``mode`` and, when running as root with an owner configured, hand ``path`` to that owner."""
    os.chmod(path, mode)
    owner = socket_owner()
    if owner is not None and os.geteuid() == 0:
        os.chown(path, *owner)


def restrict_umask() -> int:
    """Take write permission for others out of the process umask; returns the new umask.

    Called once at start, before any thread exists. A socket's mode at ``bind`` is 0777 minus the
    umask and ``connect`` needs write permission, so no one outside the owner and group can
    connect before ``share`` sets 0660. This replaces a temporary ``umask(0o117)`` around each
    bind: the umask is per process, and a directory a worker thread created in that instant (the
    image cache, during the API socket's bind) came out 0660, unusable by a runtime that is not root.
    """
    current = os.umask(0o077)
    os.umask(current | 0o002)
    return current | 0o002
