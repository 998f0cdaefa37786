"""A generic vhost-user slave (backend) on asyncio: the socket protocol, on top of :mod:`.virtqueue`.

QEMU's ``vhost-user-*-pci`` devices forward their virtqueues to a backend over a Unix socket:
requests with a 12-byte header, file descriptors (guest memory, eventfds) as SCM_RIGHTS. Guest RAM
is shared (``memory-backend-memfd,share=on``), so the backend reads and answers buffers in place.

This module knows nothing about any device: a :class:`VhostUserDevice` supplies its feature bits,
its config space and what to do when one of its queues has buffers. Everything runs on the event
loop without blocking: the socket is non-blocking, fds arrive through ``socket.recv_fds`` retried
when the loop reports the socket readable, and kick eventfds are loop readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from .virtqueue import MAX_QUEUE_SIZE, GuestMemory, Virtqueue

log = logging.getLogger(__name__)

# vhost-user requests (QEMU docs/interop/vhost-user.rst)
GET_FEATURES, SET_FEATURES, SET_OWNER, RESET_OWNER, SET_MEM_TABLE = 1, 2, 3, 4, 5
SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE = 8, 9, 10, 11
SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR = 12, 13, 14
GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES, GET_QUEUE_NUM, SET_VRING_ENABLE = 15, 16, 17, 18
GET_CONFIG, SET_CONFIG = 24, 25
FLAG_VERSION, FLAG_REPLY = 0x1, 0x4
HEADER = struct.Struct("<III")  # request, flags, payload size
VIRTIO_F_VERSION_1 = 1 << 32
VHOST_USER_F_PROTOCOL_FEATURES = 1 << 30
PROTOCOL_F_CONFIG = 1 << 9
#: SET_VRING_KICK/CALL/ERR payload bit: no fd comes with this message
NOFD = 0x100
#: QEMU sends at most 8 fds with one message (VHOST_MEMORY_BASELINE_NREGIONS)
MAX_FDS = 8
#: the largest payload we read: a memory table of 8 regions is 264 bytes, a config 268; a size
#: beyond this is a broken or hostile peer, refused before anything is allocated for it
MAX_PAYLOAD = 4096
#: VHOST_USER_MAX_CONFIG_SIZE: GET_CONFIG never asks for more
MAX_CONFIG = 256


class VhostUserDevice(Protocol):
    """What a device model gives the slave, and what the slave tells it."""

    #: device-specific virtio feature bits (the slave adds VERSION_1 and PROTOCOL_FEATURES)
    features: int
    num_queues: int

    def config(self) -> bytes:
        """The device's config space (GET_CONFIG)."""
        ...

    def queue_started(self, vq: Virtqueue) -> None:
        """QEMU started the queue (SET_VRING_KICK)."""
        ...

    def queue_notified(self, vq: Virtqueue) -> None:
        """The guest may have posted buffers (a kick, a start or an enable)."""
        ...

    def queue_stopped(self, vq: Virtqueue) -> None:
        """The queue stopped (GET_VRING_BASE, or QEMU went away): buffers held from it are void."""
        ...


Handler = Callable[[bytes, list[int]], bytes | None]


class VhostUserSlave:
    """Serves one device to one QEMU at a time over a listening Unix socket."""

    def __init__(self, device: VhostUserDevice) -> None:
        self.device = device
        self.memory = GuestMemory()
        self.queues = [Virtqueue(i, self.memory) for i in range(device.num_queues)]
        self._path: Path | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._session: asyncio.Task[None] | None = None
        self._handlers: dict[int, Handler] = {
            GET_FEATURES: self._get_features, GET_PROTOCOL_FEATURES: self._get_protocol_features,
            GET_QUEUE_NUM: self._get_queue_num, GET_CONFIG: self._get_config, SET_MEM_TABLE: self._set_mem_table,
            SET_VRING_NUM: self._set_vring_num, SET_VRING_BASE: self._set_vring_base,
            SET_VRING_ADDR: self._set_vring_addr, GET_VRING_BASE: self._get_vring_base,
            SET_VRING_KICK: self._set_vring_kick, SET_VRING_CALL: self._set_vring_call,
            SET_VRING_ERR: self._set_vring_err, SET_VRING_ENABLE: self._set_vring_enable,
        }

    # ---- lifecycle -------------------------------------------------------------------------
    async def listen(self, path: Path) -> None:
        """Listen on ``path`` (before QEMU starts: it asks for the config at realize)."""
        await self.close()
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.setblocking(False)
        listener.bind(str(path))
        listener.listen(1)
        self._path, self._listener = path, listener
        self._accepting = asyncio.create_task(self._accept_loop(listener), name=f"vhost-user {path.name}")

    async def close(self) -> None:
        """Stop listening, end the session and remove the socket file."""
        await _cancel(self._accepting)
        self._accepting = None
        await _cancel(self._session)
        self._session = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            await _cancel(self._session)  # QEMU reconnected: the old session is over
            log.info("vhost-user: QEMU connected to %s", self._path)
            self._session = asyncio.create_task(self._serve(conn), name="vhost-user session")

    async def _serve(self, conn: socket.socket) -> None:
        """One QEMU connection: requests in order, each answered before the next is read."""
        loop = asyncio.get_running_loop()
        try:
            while (message := await _receive(conn)) is not None:
                request, payload, fds = message
                reply = self._dispatch(request, payload, fds)
                if reply is not None:
                    await loop.sock_sendall(conn, HEADER.pack(request, FLAG_VERSION | FLAG_REPLY, len(reply)) + reply)
            log.info("vhost-user: QEMU closed the connection")
        except (OSError, ValueError, struct.error) as e:  # a broken peer ends its session, never the runtime
            log.warning("vhost-user: connection dropped (%s)", e)
        finally:
            conn.close()
            self._forget_session(loop)

    def _forget_session(self, loop: asyncio.AbstractEventLoop) -> None:
        for vq in self.queues:
            vq.forget(loop)
            self.device.queue_stopped(vq)
        self.memory.unmap()

    def _dispatch(self, request: int, payload: bytes, fds: list[int]) -> bytes | None:
        """Run one request's handler; fds it did not take are closed here."""
        log.debug("vhost-user: request %d (%d bytes, %d fds)", request, len(payload), len(fds))
        handler = self._handlers.get(request)
        try:
            # SET_FEATURES, SET_PROTOCOL_FEATURES, SET_OWNER, RESET_OWNER, SET_CONFIG and anything
            # newer need nothing from us: we offer no feature that changes how we behave.
            return handler(payload, fds) if handler is not None else None
        finally:
            for fd in fds:
                os.close(fd)

    def _queue(self, index: int) -> Virtqueue:
        if not 0 <= index < len(self.queues):
            raise ValueError(f"virtqueue {index} does not exist ({len(self.queues)} queues)")
        return self.queues[index]

    # ---- handlers: (payload, fds) -> reply payload or None; an fd kept is removed from fds --------
    def _get_features(self, _p: bytes, _fds: list[int]) -> bytes:
        return struct.pack("<Q", VIRTIO_F_VERSION_1 | VHOST_USER_F_PROTOCOL_FEATURES | self.device.features)

    def _get_protocol_features(self, _p: bytes, _fds: list[int]) -> bytes:
        return struct.pack("<Q", PROTOCOL_F_CONFIG)

    def _get_queue_num(self, _p: bytes, _fds: list[int]) -> bytes:
        return struct.pack("<Q", len(self.queues))

    def _get_config(self, p: bytes, _fds: list[int]) -> bytes:
        offset, size, flags = struct.unpack_from("<III", p)
        if offset + size > MAX_CONFIG:
            raise ValueError(f"GET_CONFIG asks for {size} bytes at {offset}; the config space is {MAX_CONFIG} bytes")
        config = self.device.config() + b"\0" * (offset + size)
        return struct.pack("<III", offset, size, flags) + config[offset:offset + size]

    def _set_mem_table(self, p: bytes, fds: list[int]) -> None:
        self.memory.set_table(p, fds)

    def _set_vring_num(self, p: bytes, _fds: list[int]) -> None:
        index, num = struct.unpack_from("<II", p)
        if not 0 < num <= MAX_QUEUE_SIZE:
            raise ValueError(f"virtqueue {index} size {num} is not 1..{MAX_QUEUE_SIZE}")
        self._queue(index).num = num

    def _set_vring_base(self, p: bytes, _fds: list[int]) -> None:
        index, base = struct.unpack_from("<II", p)
        self._queue(index).last_avail = base

    def _set_vring_addr(self, p: bytes, _fds: list[int]) -> None:
        index, _flags, desc, used, avail, _log = struct.unpack_from("<IIQQQQ", p)
        vq = self._queue(index)
        vq.desc, vq.used, vq.avail = desc, used, avail

    def _get_vring_base(self, p: bytes, _fds: list[int]) -> bytes:
        (index,) = struct.unpack_from("<I", p)
        vq = self._queue(index)
        vq.stop(asyncio.get_running_loop())
        self.device.queue_stopped(vq)
        return struct.pack("<II", index, vq.last_avail)

    def _vring_fd(self, p: bytes, fds: list[int]) -> tuple[Virtqueue, int | None]:
        """The queue a KICK/CALL/ERR message names and its fd (taken out of ``fds``), if any."""
        (u,) = struct.unpack_from("<Q", p)
        vq = self._queue(u & 0xFF)
        return vq, None if u & NOFD or not fds else fds.pop(0)

    def _set_vring_kick(self, p: bytes, fds: list[int]) -> None:
        vq, fd = self._vring_fd(p, fds)
        loop = asyncio.get_running_loop()
        vq.stop(loop)
        vq.kick, vq.started = fd, True
        if fd is not None:  # without a kick fd the guest's buffers are seen on enable and on our own events
            os.set_blocking(fd, False)  # the reader drains it; a spurious wake-up must not block the loop
            loop.add_reader(fd, self._on_kick, vq)
        self.device.queue_started(vq)
        self.device.queue_notified(vq)

    def _set_vring_call(self, p: bytes, fds: list[int]) -> None:
        vq, fd = self._vring_fd(p, fds)
        if vq.call is not None:
            os.close(vq.call)
        vq.call = fd

    def _set_vring_err(self, p: bytes, fds: list[int]) -> None:
        _vq, fd = self._vring_fd(p, fds)
        if fd is not None:
            os.close(fd)  # we never report errors that way

    def _set_vring_enable(self, p: bytes, _fds: list[int]) -> None:
        index, enable = struct.unpack_from("<II", p)
        vq = self._queue(index)
        vq.enabled = bool(enable)
        if vq.enabled:
            self.device.queue_notified(vq)

    def _on_kick(self, vq: Virtqueue) -> None:
        if vq.kick is not None:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(vq.kick)
        self.device.queue_notified(vq)


async def _receive(conn: socket.socket) -> tuple[int, bytes, list[int]] | None:
    """One message: (request, payload, fds), or None at end of stream.

    QEMU sends a message's fds with its first bytes, so they arrive with the header.

    :raise ValueError: when the stream ends inside a message.
    """
    header, fds = await _recv_fds(conn, HEADER.size)
    if not header:
        return None
    try:
        header += await _recv_exactly(conn, HEADER.size - len(header))
        request, _flags, size = HEADER.unpack(header)
        if size > MAX_PAYLOAD:
            raise ValueError(f"vhost-user request {request} announces {size} bytes (at most {MAX_PAYLOAD})")
        return request, await _recv_exactly(conn, size), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


async def _recv_fds(conn: socket.socket, size: int) -> tuple[bytes, list[int]]:
    """Up to ``size`` bytes and the fds sent with them, waiting on the loop (never blocking it)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, size, MAX_FDS)
            return data, fds
        except (BlockingIOError, InterruptedError):
            pass
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(conn.fileno(), _wake, readable)
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())


def _wake(future: asyncio.Future[None]) -> None:
    # the loop may call a reader again before the waiting coroutine has run and removed it
    if not future.done():
        future.set_result(None)


async def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes (the rest of a message: payloads never carry fds)."""
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        chunk = await loop.sock_recv(conn, size - len(data))
        if not chunk:
            raise ValueError(f"vhost-user message cut short ({len(data)} of {size} bytes)")
        data += chunk
    return data


async def _cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel a task and wait until it has finished cleaning up."""
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
