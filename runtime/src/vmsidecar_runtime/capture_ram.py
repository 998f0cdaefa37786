"""The RAM of a cold boot that captures a templated snapshot: a memfd, copied into the snapshot.

The capture of a templated snapshot writes device state only (``x-ignore-shared``), so the
capturing boot's RAM must be shared memory that outlives QEMU. It was the staging directory's
``ram`` file itself, mapped shared; but then every page the booting guest touches is a page-cache
page of a file on the cache's disk, allocated by the filesystem and written back while the guest
boots. Measured with plain QEMU on the same disk, against anonymous RAM: the tiny guest booted
0.3-0.5 s slower (Debian 0.7-1.3 s), the same file on tmpfs 0.1 s. A memfd is such memory and
any filesystem's; QEMU maps it through ``/proc/self/fd/N`` (it inherits the descriptor), and at
the capture the pages the guest touched are copied into the snapshot's RAM file (sparse: holes
stay holes), ~0.1 s for the tiny guest's 140 MB. A full disk now fails the capture (no snapshot,
the reason in ``snapshot.reason``, the guest boots again uncaptured) where the guest's own page
faults used to hit it (SIGBUS in QEMU).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vmsidecar_contract.errors import HostError

from .oci.cache import stat_seal
from .procs import inherited_path
from .snapshots import RAM_DIGEST, hash_ram


class CaptureRam:
    """A memfd for one capturing boot's RAM; QEMU sizes it (``memory-backend-file``, ``size=``)."""

    def __init__(self, name: str) -> None:
        self.fd: int | None = os.memfd_create(name, os.MFD_CLOEXEC)

    @property
    def qemu_path(self) -> Path:
        """The path QEMU opens: its own copy of the descriptor (the same number: ``pass_fds``)."""
        assert self.fd is not None
        return inherited_path(self.fd)

    def copy_to(self, dest: Path) -> None:
        """Write the RAM into ``dest`` (a new file), the guest's untouched pages as holes.

        Blocking: call it in a thread, with the guest stopped.

        :raise OSError: the file cannot be written (e.g. ENOSPC); ``dest`` is removed.
        """
        assert self.fd is not None
        size = os.fstat(self.fd).st_size
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(out, size)
            offset = 0
            while offset < size:
                try:
                    start = os.lseek(self.fd, offset, os.SEEK_DATA)
                except OSError:  # ENXIO: no data after offset
                    break
                end = os.lseek(self.fd, start, os.SEEK_HOLE)
                os.lseek(out, start, os.SEEK_SET)
                while start < end:
                    sent = os.sendfile(out, self.fd, start, end - start)
                    if sent == 0:
                        raise OSError(f"the capture's RAM ended at {start} of {size} bytes")
                    start += sent
                offset = end
        except BaseException:
            os.close(out)
            dest.unlink(missing_ok=True)
            raise
        os.close(out)

    def close(self) -> None:
        """Release the memfd (a QEMU still running on it keeps its own mapping)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def copy_ram(ram: CaptureRam, dest: Path) -> tuple[str, dict]:
    """``ram`` into ``dest``, hashed for the seal at the same time (blocking: in a thread, the guest
    stopped); returns the seal digest and ``dest``'s stat seal (``SnapshotStore.commit``'s ``hashed``).

    :raise HostError: naming why the file could not be written, and the fix.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        digest = pool.submit(hash_ram, ram.qemu_path)  # reads the memfd while the copy writes the file
        try:
            ram.copy_to(dest)
            st = dest.stat()
        except OSError as e:
            raise HostError(f"the snapshot's RAM could not be written into {dest.parent.parent} "
                            f"({e.strerror or e}); give the cache volume room for it, or set snapshot: off") from e
        sealed = digest.result()
    if sealed == RAM_DIGEST:  # hash_ram's "could not be read"
        raise HostError("the capture's RAM could not be read back for its seal; no snapshot is stored")
    return sealed, stat_seal(st)
