"""The size limit every guest disk is held to, and how a refusal names the disk.

One runtime setting, ``--max-disk-size`` / ``VMSIDECAR_MAX_DISK_SIZE`` (default 64 GiB), bounds
both sizes of a disk:

* the virtual size, the disk the guest sees (qcow2 ``size``, a raw disk's length). A qcow2 header
  can claim petabytes in a few kilobytes, and the guest could then fill the host through its
  overlay;
* the bytes a pulled or flashed disk takes on the host once decompressed, which stops a
  decompression bomb before it fills the volume.

:class:`Limits` carries them to every entry point; its defaults are the setting, read when a
check runs (``serve`` applies its flag with :func:`configure` after the modules are imported).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from vmsidecar_contract.errors import HostError

KIB, MIB, GIB, TIB, PIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50
_FACTORS = {"": 1, "K": KIB, "M": MIB, "G": GIB, "T": TIB, "P": PIB}
#: the setting's default: far above the disks of test rigs, far below a node's volume
DEFAULT_MAX_DISK_SIZE = 64 * GIB
MAX_DISK_SIZE_ENV = "VMSIDECAR_MAX_DISK_SIZE"
MAX_DISK_SIZE_FLAG = "--max-disk-size"
#: how messages name the setting
SETTING = f"{MAX_DISK_SIZE_FLAG} ({MAX_DISK_SIZE_ENV})"

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:IB?|B)?", re.IGNORECASE)
_configured: int | None = None


def parse_size(text: str) -> int:
    """Bytes from ``64G``, ``64GiB``, ``10Gi`` (Kubernetes), ``1.5 TiB``, ``512M`` or a byte count
    (binary units either way); the one size parser of the runtime's settings.

    :raise ValueError: for anything else, or zero.
    """
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 64GiB, 512MiB or a number of bytes")
    size = int(float(match.group(1)) * _FACTORS[match.group(2).upper()])
    if size == 0:
        raise ValueError(f"{text!r} is not a size; give a positive size")
    return size


def setting_error(source: str, text: str) -> HostError:
    """The refusal of a value of the setting that is not a size (``source``: the flag or the env var)."""
    return HostError(
        f"{source} {text!r} is not a size; give a positive size such as 64G, 512M or 1T (binary units), "
        f"or leave it out for the {human_size(DEFAULT_MAX_DISK_SIZE)} default"
    )


def configure(max_disk_size: int | None) -> None:
    """Set the limit from ``serve``'s flag (it wins over the environment); ``None`` goes back to it."""
    global _configured
    _configured = max_disk_size


def max_disk_size() -> int:
    """The setting: the serve flag, else ``VMSIDECAR_MAX_DISK_SIZE``, else 64 GiB.

    :raise HostError: when the environment variable is not a size.
    """
    if _configured is not None:
        return _configured
    text = os.environ.get(MAX_DISK_SIZE_ENV, "")
    if not text.strip():
        return DEFAULT_MAX_DISK_SIZE
    try:
        return parse_size(text)
    except ValueError:
        raise setting_error(MAX_DISK_SIZE_ENV, text) from None


class Limits:
    """Size limits for one image: explicit numbers, or (``None``, the default) the runtime's setting."""

    __slots__ = ("_disk_bytes", "_virtual_size")

    def __init__(self, max_virtual_size: int | None = None, max_disk_bytes: int | None = None) -> None:
        self._virtual_size = max_virtual_size
        self._disk_bytes = max_disk_bytes

    @property
    def max_virtual_size(self) -> int:
        """The largest disk a guest may see."""
        return self._virtual_size if self._virtual_size is not None else max_disk_size()

    @property
    def max_disk_bytes(self) -> int:
        """The most bytes a disk may take on the host once decompressed."""
        return self._disk_bytes if self._disk_bytes is not None else max_disk_size()

    def where_set(self, virtual: bool) -> tuple[str, str]:
        """For a refusal: where the limit was set (`` set by --max-disk-size (…)``) and how to raise it,
        when it comes from the setting; else two empty strings."""
        if (self._virtual_size if virtual else self._disk_bytes) is not None:
            return "", ""
        return f" set by {SETTING}", f", or have the runtime started with a larger {MAX_DISK_SIZE_FLAG}"

    def __repr__(self) -> str:
        return f"Limits(max_virtual_size={self._virtual_size}, max_disk_bytes={self._disk_bytes})"


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
    if n > PIB << 30:  # a hostile size field: JSON integers have no bound, and no float holds some of them
        return f"over {PIB << 30 >> 50} PiB"
    for unit, factor in (("PiB", PIB), ("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= factor:
            return f"{n / factor:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"
