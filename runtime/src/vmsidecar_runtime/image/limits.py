"""The size limits every guest disk is held to, and how a refusal names the disk.

Limits (generous: the disks of test rigs are far below them):

* ``MAX_VIRTUAL_SIZE`` = 1 TiB, the disk size the guest sees. A qcow2 header can claim petabytes
  in a few kilobytes, and the guest could then fill the host through its overlay.
* ``MAX_DISK_BYTES`` = 256 GiB, the bytes a disk takes on the host once decompressed (for a raw
  disk that is also its virtual size). It stops a decompression bomb before it fills the volume.

Both are the defaults of :class:`Limits`, which every entry point takes.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB, MIB, GIB, TIB, PIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50
#: the largest disk a guest may see (qcow2 ``size``, a raw disk's length)
MAX_VIRTUAL_SIZE = 1 * TIB
#: the largest disk file written on the host, once decompressed
MAX_DISK_BYTES = 256 * GIB


@dataclass(frozen=True)
class Limits:
    """Size limits for one image; the defaults are the module's constants."""

    max_virtual_size: int = MAX_VIRTUAL_SIZE
    max_disk_bytes: int = MAX_DISK_BYTES


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Origin:
    """Where an image comes from, for messages: ``what`` it is, and how to ``resend`` a fixed one.

    ``Origin("the flashed image", "flash the result")`` gives "the flashed image is a qcow2
    overlay that names a backing file (…); flatten it with … and flash the result".
    """

    what: str
    resend: str


def human_size(n: int) -> str:
    """``2 PiB``, ``1.5 GiB``, ``512 bytes``: sizes in messages."""
    for unit, factor in (("PiB", PIB), ("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= factor:
            return f"{n / factor:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"
