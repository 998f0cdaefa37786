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
copied in the pause into a second memfd (``FrozenRam``), which the kernel then keeps read-only
(memfd seals), and from it into the file, hashed, after Ready. A full disk fails the capture (no
snapshot, the reason in ``snapshot.reason``) where the guest's own page faults used to hit it
(SIGBUS in QEMU).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from pathlib import Path

from vmsidecar_contract.errors import HostError

from .oci.cache import stat_seal
from .procs import inherited_path
from .snapshots import copy_ram_chunks, hash_ram_chunks, ram_copy_runs

#: what makes a frozen copy unchangeable for as long as it exists, whoever holds it
FROZEN_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


class CaptureRam:
    """A memfd for one capturing boot's RAM; QEMU sizes it (``memory-backend-file``, ``size=``)."""

    def __init__(self, name: str, *, sealable: bool = False) -> None:
        self.fd: int | None = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0))

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


class FrozenRam:
    """The memfd a capture copies the guest's RAM into in its pause, for a guest that goes on in
    its QEMU; read-only once frozen, whoever holds it, until it is stored after Ready.

    The copy's own pages are allocated while the guest boots (``mirror``, in the background: a
    page fault and the zeroing of every 4 KiB page took half of the copy, 0.088 vs 0.045 s for the
    tiny guest's 144 MB, in the pause). So this memfd follows the guest's RAM as it grows during
    the boot rather than at the capture; it never holds more than the copy made at once would.
    """

    def __init__(self, name: str, live: CaptureRam) -> None:
        assert live.fd is not None
        self.ram = CaptureRam(name, sealable=True)
        #: the guest's RAM, through a descriptor of its own (the boot may close its own meanwhile)
        self._live: int | None = os.dup(live.fd)
        #: (start, end) of the ranges allocated ahead of the copy
        self._allocated: list[tuple[int, int]] = []
        #: one mirror, freeze or close at a time (a mirror's thread may outlive the task that awaited it)
        self._lock = threading.Lock()

    def mirror(self) -> None:
        """Allocate the pages of this copy that a copy of the guest's RAM now would write (its data,
        joined over short gaps) and that are not yet (blocking: in a thread, while the guest runs;
        nothing once frozen or closed).

        :raise OSError: the host has no memory for them (the capture's copy says so in the pause).
        """
        with self._lock:
            if self._live is None or self.ram.fd is None:
                return
            size = self._sized()
            new = _missing(ram_copy_runs(self._live, size), self._allocated)
            for start, end in new:
                os.posix_fallocate(self.ram.fd, start, end - start)
            # kept here: a memfd's SEEK_DATA does not show pages allocated but never written
            self._allocated = _merged(self._allocated + new)

    def freeze(self) -> None:
        """Copy the paused guest's RAM in (holes stay holes: a range allocated ahead that the copy
        did not write is freed) and seal the memfd against every change (blocking: in a thread, the guest
        stopped). Its digest is taken when it is stored (``copy_ram``).

        :raise HostError: the host has no memory for the copy.
        """
        with self._lock:
            assert self._live is not None and self.ram.fd is not None
            try:
                size = self._sized()
                runs = ram_copy_runs(self._live, size)  # read once: the guest is stopped
                copy_ram_chunks(self._live, self.ram.fd, runs)
                if freed := _missing(self._allocated, runs):
                    _punch(self.ram.fd, size, freed)
                fcntl.fcntl(self.ram.fd, fcntl.F_ADD_SEALS, FROZEN_SEALS)
            except OSError as e:
                raise HostError(f"the snapshot's RAM could not be copied out of the guest's ({e.strerror or e}); "
                                "give the runtime memory for a second copy of the guest's RAM while it is stored, "
                                "or set snapshot: off") from e
            finally:
                os.close(self._live)
                self._live = None

    def _sized(self) -> int:
        """The guest's RAM size (QEMU sets it as it starts), this copy's made the same."""
        assert self._live is not None and self.ram.fd is not None
        size = os.fstat(self._live).st_size
        if os.fstat(self.ram.fd).st_size != size:
            os.ftruncate(self.ram.fd, size)
        return size

    def is_sealed(self) -> bool:
        """Whether the kernel keeps this copy from changing (what the store checks before hashing it)."""
        assert self.ram.fd is not None
        return fcntl.fcntl(self.ram.fd, fcntl.F_GET_SEALS) & FROZEN_SEALS == FROZEN_SEALS

    def close(self) -> None:
        """Release both descriptors (blocking while a mirror runs)."""
        with self._lock:
            if self._live is not None:
                os.close(self._live)
                self._live = None
            self.ram.close()


def _punch(fd: int, size: int, ranges: list[tuple[int, int]]) -> None:
    """Free ``ranges`` of the memfd ``fd`` (holes again): ``MADV_REMOVE`` through a shared mapping,
    unmapped before the memfd is sealed (a writable mapping forbids ``F_SEAL_WRITE``); Python's
    ``os`` has no ``fallocate`` to punch a hole with."""
    with mmap.mmap(fd, size) as view:
        for start, end in ranges:
            view.madvise(mmap.MADV_REMOVE, start, end - start)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, the touching and overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _missing(wanted: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the sorted, disjoint ranges ``wanted`` that none of ``have`` covers."""
    out: list[tuple[int, int]] = []
    i = 0
    for start, end in wanted:
        while i < len(have) and have[i][1] <= start:
            i += 1
        j, cursor = i, start
        while j < len(have) and have[j][0] < end:
            if have[j][0] > cursor:
                out.append((cursor, have[j][0]))
            cursor = max(cursor, have[j][1])
            j += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _unwritable(dest: Path, e: OSError) -> HostError:
    return HostError(f"the snapshot's RAM could not be written into {dest.parent.parent} ({e.strerror or e}); "
                     "give the cache volume room for it, or set snapshot: off")
