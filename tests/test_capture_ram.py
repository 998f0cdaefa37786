"""The capture's RAM copy and its seal, on real memfds and files (no guest: the snapshot tests boot
the guests whose RAM this copies; here the byte-level promises).

``copy_ram`` copies the memfd a capturing guest ran on into the snapshot's RAM file and hashes it
in the same pass; ``hash_ram`` re-hashes that file before a restore. They must agree, keep holes
holes (in the file, and in the memfd, which the guest goes on running on), and see any change.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path

import pytest
from blake3 import blake3

from fixtures.faults import tmpfs
from vmsidecar_contract.errors import HostError
from vmsidecar_runtime.capture_ram import CaptureRam, FrozenRam, copy_ram
from vmsidecar_runtime.snapshots import RAM_CHUNK, RAM_DIGEST, hash_ram

MIB = 1 << 20
SIZE = 64 * MIB
#: (offset, length) of the data the "guest" wrote: within a chunk, across a chunk boundary, a
#: whole chunk, the last page; the rest is holes
WRITES = [(3 * MIB + 4096, 8192), (2 * RAM_CHUNK - 4096, 3 * 4096), (5 * RAM_CHUNK, RAM_CHUNK), (SIZE - 4096, 4096)]


def _ram() -> tuple[CaptureRam, bytes]:
    ram = CaptureRam("test-capture-ram")
    assert ram.fd is not None
    os.ftruncate(ram.fd, SIZE)
    for offset, length in WRITES:
        os.pwrite(ram.fd, os.urandom(length), offset)
    return ram, os.pread(ram.fd, SIZE, 0)


def _expected_digest(content: bytes) -> str:
    """The seal's definition, computed the plain way: BLAKE3 of the chunks' BLAKE3s."""
    chunks = b"".join(blake3(content[i:i + RAM_CHUNK]).digest() for i in range(0, len(content), RAM_CHUNK))
    return RAM_DIGEST + blake3(chunks).hexdigest()


def _allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_the_copy_is_the_ram_its_digest_is_the_seal_and_holes_stay_holes(tmp_path: Path) -> None:
    ram, content = _ram()
    assert ram.fd is not None
    memfd_allocated = _allocated(ram.fd)
    dest = tmp_path / "ram"
    sealed, _ = copy_ram(ram, dest)
    assert dest.read_bytes() == content
    assert sealed == _expected_digest(content) == hash_ram(dest)
    written = sum(length for _, length in WRITES)
    with open(dest, "rb") as f:
        assert _allocated(f.fileno()) < written + 4 * MIB, "the copy filled the RAM's holes"
    # the guest runs on in this memfd: reading it for the copy must not allocate its holes
    assert _allocated(ram.fd) == memfd_allocated
    ram.close()


@pytest.mark.parametrize("where", ["data", "hole"])
def test_a_changed_byte_anywhere_breaks_the_seal(tmp_path: Path, where: str) -> None:
    ram, _ = _ram()
    dest = tmp_path / "ram"
    sealed, _ = copy_ram(ram, dest)
    ram.close()
    offset = WRITES[2][0] + 77 if where == "data" else 9 * RAM_CHUNK + 5  # chunk 9 is all hole
    with open(dest, "r+b") as f:
        old = os.pread(f.fileno(), 1, offset)
        os.pwrite(f.fileno(), bytes([old[0] ^ 1]), offset)
    assert hash_ram(dest) != sealed


def test_an_existing_file_is_not_overwritten(tmp_path: Path) -> None:
    ram, _ = _ram()
    dest = tmp_path / "ram"
    dest.write_bytes(b"earlier")
    with pytest.raises(HostError, match="could not be written"):
        copy_ram(ram, dest)
    ram.close()
    assert dest.read_bytes() == b"earlier"


def test_a_copy_the_volume_cannot_take_is_a_clear_error_and_leaves_no_file(tmp_path: Path) -> None:
    """A real full volume: a 2 MiB tmpfs for 4 MiB of RAM data."""
    ram, _ = _ram()
    with tmpfs(tmp_path / "cache", "2m") as cache:
        dest = cache / "ram"
        with pytest.raises(HostError, match=r"No space left on device.*give the cache volume room"):
            copy_ram(ram, dest)
        assert not dest.exists()
    ram.close()


def test_the_frozen_copy_is_the_ram_at_the_freeze_and_nobody_can_change_it(tmp_path: Path) -> None:
    live, _ = _ram()
    assert live.fd is not None
    frozen = FrozenRam("test-frozen", live)
    assert frozen.ram.fd is not None
    frozen.mirror()  # while the "guest" boots: its pages are allocated ahead, still zeros
    assert _allocated(frozen.ram.fd) >= sum(length for _, length in WRITES)
    assert os.pread(frozen.ram.fd, 4096, WRITES[0][0]) == bytes(4096)
    os.pwrite(live.fd, os.urandom(3 * 4096), 30 * MIB)  # written after the last mirror
    at_freeze = os.pread(live.fd, SIZE, 0)
    frozen.freeze()
    os.pwrite(live.fd, b"after the capture", WRITES[0][0])  # the guest goes on
    assert os.pread(frozen.ram.fd, SIZE, 0) == at_freeze
    assert frozen.is_sealed()
    for change in (lambda fd: os.pwrite(fd, b"lease", 0), lambda fd: os.ftruncate(fd, 0),
                   lambda fd: os.ftruncate(fd, 2 * SIZE)):
        with pytest.raises(PermissionError):
            change(frozen.ram.fd)
    with pytest.raises(PermissionError):  # nor through a shared writable mapping
        mmap.mmap(frozen.ram.fd, SIZE)
    sealed, _ = copy_ram(frozen.ram, tmp_path / "ram")  # the store, after Ready
    assert sealed == _expected_digest(at_freeze)
    frozen.close()
    live.close()


def test_what_the_ram_no_longer_holds_is_a_hole_in_the_frozen_copy() -> None:
    """QEMU may give RAM back (a hole again in its memfd) after a mirror allocated its copy's pages."""
    live, _ = _ram()
    assert live.fd is not None
    frozen = FrozenRam("test-frozen", live)
    frozen.mirror()
    offset, length = WRITES[2]
    with mmap.mmap(live.fd, SIZE) as view:
        view.madvise(mmap.MADV_REMOVE, offset, length)
    frozen.freeze()
    assert frozen.ram.fd is not None
    assert os.pread(frozen.ram.fd, length, offset) == bytes(length)
    assert _allocated(frozen.ram.fd) < _allocated(live.fd) + 4 * MIB, "the range freed in the RAM is allocated in the copy"
    frozen.close()
    live.close()


def test_a_copy_the_host_has_no_memory_for_is_a_clear_error() -> None:
    """The kernel refuses the copy its pages (here through a seal against growth, where a full
    memory cgroup would refuse them): the cause is named, and the fix."""
    live, _ = _ram()
    frozen = FrozenRam("test-frozen", live)
    assert frozen.ram.fd is not None
    fcntl.fcntl(frozen.ram.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    with pytest.raises(HostError, match=rf"could not be copied out of the guest's \({os.strerror(errno.EPERM)}\); "
                       "give the runtime memory"):
        frozen.freeze()
    frozen.close()
    live.close()
