"""Guest memory and split virtqueues, as a vhost-user backend sees them.

QEMU shares the guest's RAM (``memory-backend-memfd,share=on``) and tells the backend where the
rings are (in QEMU's own virtual addresses) and where buffers are (guest-physical addresses). A
device model takes chains off a :class:`Virtqueue`, reads and writes their buffers in place,
pushes them back as used and notifies the guest. Everything the guest wrote is untrusted: a bad
address or chain raises :class:`~vmsidecar_contract.errors.GuestError` with code ``bad_virtqueue``,
which device models answer, never let escape.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import struct
from dataclasses import dataclass

from vmsidecar_contract.errors import GuestError

# split virtqueue descriptor flags
DESC_NEXT, DESC_WRITE, DESC_INDIRECT = 1, 2, 4
DESC = struct.Struct("<QIHH")  # addr, len, flags, next

#: the ``code`` of the GuestError raised for a malformed ring or descriptor chain
BAD_VIRTQUEUE = "bad_virtqueue"
#: the largest split queue the virtio spec allows (QEMU's own limit is 1024)
MAX_QUEUE_SIZE = 32768


def bad_virtqueue(message: str) -> GuestError:
    """The error for a guest buffer we cannot use; devices answer it, they never let it escape."""
    return GuestError(message, code=BAD_VIRTQUEUE)


@dataclass(frozen=True)
class MemoryRegion:
    """One region of the memory table: guest-physical and QEMU-virtual ranges over one mapping."""

    gpa: int
    size: int
    uva: int
    offset: int
    mm: mmap.mmap


class GuestMemory:
    """The guest's RAM as QEMU shared it (SET_MEM_TABLE), addressed by guest-physical or QEMU address."""

    def __init__(self) -> None:
        self._regions: list[MemoryRegion] = []

    @property
    def mapped(self) -> bool:
        """True once a memory table is mapped."""
        return bool(self._regions)

    def set_table(self, payload: bytes, fds: list[int]) -> None:
        """Replace the mappings with the regions of a SET_MEM_TABLE payload; consumes ``fds``.

        :raise ValueError: when the payload names more regions than fds came with it.
        """
        self.unmap()
        (count,) = struct.unpack_from("<I", payload)
        if count > len(fds):
            raise ValueError(f"memory table has {count} regions but {len(fds)} fds")
        try:
            for i in range(count):
                gpa, size, uva, offset = struct.unpack_from("<QQQQ", payload, 8 + 32 * i)
                # a mapping past the end of the file would SIGBUS the runtime on first touch
                if (have := os.fstat(fds[i]).st_size) < size + offset:
                    raise ValueError(f"memory region {i} ({size} bytes at offset {offset}) is larger than its "
                                     f"file ({have} bytes)")
                mm = mmap.mmap(fds[i], size + offset, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._regions.append(MemoryRegion(gpa, size, uva, offset, mm))
        finally:
            for fd in fds:
                os.close(fd)  # each mapping holds its own reference to the memfd
            fds.clear()

    def unmap(self) -> None:
        """Drop every mapping (QEMU is gone, or a new table replaces this one)."""
        for region in self._regions:
            region.mm.close()
        self._regions = []

    def locate(self, addr: int, length: int, *, virtual: bool = False) -> tuple[mmap.mmap, int]:
        """The mapping and offset of ``length`` bytes at a guest-physical (or QEMU-virtual) address.

        :raise GuestError: (``bad_virtqueue``) when the range is not inside one region.
        """
        for r in self._regions:
            base = r.uva if virtual else r.gpa
            if base <= addr and addr + length <= base + r.size:
                return r.mm, r.offset + addr - base
        kind = "ring address" if virtual else "guest address"
        raise bad_virtqueue(f"{kind} {addr:#x}+{length} is outside guest memory")

    def read(self, gpa: int, length: int) -> bytes:
        """Copy bytes out of guest memory (a copy: the guest may change them under us)."""
        mm, off = self.locate(gpa, length)
        return mm[off:off + length]

    def write(self, gpa: int, data: bytes) -> None:
        """Write bytes into guest memory."""
        mm, off = self.locate(gpa, len(data))
        mm[off:off + len(data)] = data


class Virtqueue:
    """One split virtqueue as the guest driver laid it out; ring addresses are QEMU-virtual."""

    def __init__(self, index: int, memory: GuestMemory) -> None:
        self.index = index
        self.memory = memory
        self.num = 0
        self.desc = self.avail = self.used = 0
        self.last_avail = 0
        self.kick: int | None = None
        self.call: int | None = None
        # Enabled unless QEMU says otherwise: QEMU 7.2's vhost-user-gpio starts rings with
        # SET_VRING_KICK and only sometimes sends SET_VRING_ENABLE.
        self.enabled = True
        self.started = False
        #: why the guest broke this queue (the virtio NEEDS_RESET case): no buffer is taken from it
        #: until QEMU restarts it (a device reset re-sends SET_VRING_KICK) or the session ends
        self.broken: str | None = None

    @property
    def ready(self) -> bool:
        """Started, enabled, sized, not broken, and its memory mapped: buffers can be taken and returned."""
        return self.started and self.enabled and 0 < self.num <= MAX_QUEUE_SIZE and self.memory.mapped \
            and self.broken is None

    def _u16(self, uva: int) -> int:
        mm, off = self.memory.locate(uva, 2, virtual=True)
        return struct.unpack_from("<H", mm, off)[0]

    def pop(self) -> int | None:
        """The head of the next available chain, or None when the guest has posted nothing new.

        :raise GuestError: (``bad_virtqueue``) when the ring is outside guest memory.
        """
        avail_idx = self._u16(self.avail + 2)
        if self.last_avail == avail_idx:
            return None
        # a driver never has more than the ring's size outstanding; an index further ahead would
        # have us serve (and loop over) up to 65535 stale heads
        if (ahead := (avail_idx - self.last_avail) & 0xFFFF) > self.num:
            raise bad_virtqueue(f"avail index {avail_idx} is {ahead} ahead of {self.last_avail} on a ring of {self.num}")
        head = self._u16(self.avail + 4 + 2 * (self.last_avail % self.num))
        self.last_avail = (self.last_avail + 1) & 0xFFFF
        return head

    def chain(self, head: int, *, max_descriptors: int, max_bytes: int
              ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(readable, writable) ``(gpa, length)`` buffers of a descriptor chain, at most
        ``max_descriptors`` of them and ``max_bytes`` in all: checked here, before a device reads or
        allocates anything for them (:meth:`GuestMemory.read` and ``write`` check each address).

        :raise GuestError: (``bad_virtqueue``) when the chain leaves the table, loops, is indirect, or
            is longer or larger than allowed.
        """
        readable: list[tuple[int, int]] = []
        writable: list[tuple[int, int]] = []
        total = 0
        idx = head
        for _ in range(min(self.num, max_descriptors)):  # a chain longer than the table must loop
            if idx >= self.num:
                raise bad_virtqueue(f"descriptor {idx} is out of range (queue size {self.num})")
            mm, off = self.memory.locate(self.desc + DESC.size * idx, DESC.size, virtual=True)
            addr, length, flags, nxt = DESC.unpack_from(mm, off)
            if flags & DESC_INDIRECT:
                raise bad_virtqueue("indirect descriptors were not negotiated")
            total += length
            if total > max_bytes:
                raise bad_virtqueue(f"descriptor chain from {head} holds more than {max_bytes} bytes")
            (writable if flags & DESC_WRITE else readable).append((addr, length))
            if not flags & DESC_NEXT:
                return readable, writable
            idx = nxt
        if max_descriptors < self.num:
            raise bad_virtqueue(f"descriptor chain from {head} is longer than {max_descriptors} descriptors")
        raise bad_virtqueue(f"descriptor chain from {head} loops")

    def read_all(self, buffers: list[tuple[int, int]]) -> bytes:
        """The concatenated contents of the readable buffers of a chain (checked by :meth:`chain`)."""
        return b"".join(self.memory.read(addr, length) for addr, length in buffers)

    def push(self, head: int, length: int) -> None:
        """Return a chain to the guest as used, ``length`` bytes written (no notification yet)."""
        used_idx = self._u16(self.used + 2)
        mm, off = self.memory.locate(self.used + 4 + 8 * (used_idx % self.num), 8, virtual=True)
        struct.pack_into("<II", mm, off, head, length)
        # the element before the index: the guest reads the index, then trusts the element
        mm, off = self.memory.locate(self.used + 2, 2, virtual=True)
        struct.pack_into("<H", mm, off, (used_idx + 1) & 0xFFFF)

    def notify(self) -> None:
        """Interrupt the guest (the call eventfd; QEMU or KVM injects the irq)."""
        if self.call is not None:
            with contextlib.suppress(BlockingIOError):  # counter saturated: an interrupt is pending anyway
                os.eventfd_write(self.call, 1)

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop taking buffers: forget the kick eventfd (GET_VRING_BASE or disconnect); a restart
        clears what the guest broke."""
        if self.kick is not None:
            loop.remove_reader(self.kick)
            os.close(self.kick)
            self.kick = None
        self.started = False
        self.broken = None

    def forget(self, loop: asyncio.AbstractEventLoop) -> None:
        """The session is over: stop and drop everything QEMU gave for this queue."""
        self.stop(loop)
        if self.call is not None:
            os.close(self.call)
            self.call = None
        self.num = self.desc = self.avail = self.used = self.last_avail = 0
        self.enabled = True
