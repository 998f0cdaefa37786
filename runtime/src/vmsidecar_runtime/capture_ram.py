"""The RAM of a cold boot that captures a templated snapshot: a memfd, copied into the snapshot.

The capture of a templated snapshot writes device state only (``x-ignore-shared``), so the
capturing boot's RAM must be shared memory that outlives QEMU. It was the staging directory's
``ram`` file itself, mapped shared; but then every page the booting guest touches is a page-cache
page of a file on the cache's disk, allocated by the filesystem and written back while the guest
boots. Measured with plain QEMU on the same disk, against anonymous RAM: the tiny guest booted
0.3-0.5 s slower (Debian 0.7-1.3 s), the same file on tmpfs 0.1 s. A memfd is such memory and
any filesystem's; QEMU maps it through ``/proc/self/fd/N`` (it inherits the descriptor). At the
capture the pages the guest touched are copied into the snapshot's RAM file (sparse: holes stay
holes) and hashed for its seal in the same pass; where the guest goes on in its QEMU, they are
copied into a second memfd in the pause (``seal_into``) and from it into the file after Ready. A
full disk fails the capture (no snapshot, the reason in ``snapshot.reason``) where the guest's
own page faults used to hit it (SIGBUS in QEMU).
"""

from __future__ import annotations

import os
from pathlib import Path

from vmsidecar_contract.errors import HostError

from .oci.cache import stat_seal
from .procs import inherited_path
from .snapshots import hash_ram_chunks


class CaptureRam:
    """A memfd for one capturing boot's RAM; QEMU sizes it (``memory-backend-file``, ``size=``)."""

    def __init__(self, name: str) -> None:
        self.fd: int | None = os.memfd_create(name, os.MFD_CLOEXEC)

    @property
    def qemu_path(self) -> Path:
        """The path QEMU opens: its own copy of the descriptor (the same number: ``pass_fds``)."""
        assert self.fd is not None
        return inherited_path(self.fd)

    def close(self) -> None:
        """Release the memfd (a QEMU still running on it keeps its own mapping)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def copy_ram(ram: CaptureRam, dest: Path) -> tuple[str, dict]:
    """``ram`` into ``dest`` (a new file; the pages the guest never touched stay holes), hashed for
    the seal in the same pass (blocking: in a thread, ``ram`` unchanging meanwhile: the guest
    stopped, or the frozen copy of its RAM); returns the seal digest and ``dest``'s stat seal
    (``SnapshotStore.commit``'s ``hashed``).

    One pass over the chunks on every core, where a copy (``sendfile``) beside a second reading of
    the memfd for the hash took 0.13 s for the tiny guest's 144 MB.

    :raise HostError: naming why the file could not be written, and the fix.
    """
    assert ram.fd is not None
    try:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise _unwritable(dest, e) from e
    try:
        os.ftruncate(out, os.fstat(ram.fd).st_size)
        sealed = hash_ram_chunks(ram.fd, copy_to=out)
        st = os.fstat(out)
    except OSError as e:
        os.close(out)
        dest.unlink(missing_ok=True)
        raise _unwritable(dest, e) from e
    os.close(out)
    return sealed, stat_seal(st)


def seal_into(ram: CaptureRam, frozen: CaptureRam) -> str:
    """``ram`` copied into the empty memfd ``frozen`` (holes stay holes), hashed in the same pass;
    returns the seal digest (blocking: in a thread, the guest stopped).

    :raise HostError: the host has no memory for the copy.
    """
    assert ram.fd is not None and frozen.fd is not None
    try:
        os.ftruncate(frozen.fd, os.fstat(ram.fd).st_size)
        return hash_ram_chunks(ram.fd, copy_to=frozen.fd)
    except OSError as e:
        raise HostError(f"the snapshot's RAM could not be copied out of the guest's ({e.strerror or e}); "
                        "give the runtime memory for a second copy of the guest's RAM while it is stored, "
                        "or set snapshot: off") from e


def _unwritable(dest: Path, e: OSError) -> HostError:
    return HostError(f"the snapshot's RAM could not be written into {dest.parent.parent} ({e.strerror or e}); "
                     "give the cache volume room for it, or set snapshot: off")
