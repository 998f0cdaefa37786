"""GPIO: a vhost-user virtio-gpio device backend (asyncio, stdlib only) and the host control socket.

QEMU's ``vhost-user-gpio-pci`` forwards the device's virtqueues to us over ``gpio-vhost.sock``;
guest RAM is shared (memfd), so requests are read and answered in place. The guest's standard
``gpio-virtio`` driver sees a gpiochip whose lines, names, directions and initial values come from
the spec. Both virtqueues are served: the request queue (names, direction, value, irq type) and
the event queue (one buffer per armed line, returned when the line's edge/level fires), so
``gpiomon`` in the guest wakes on host edges.

Host control (``<shared>/gpio.sock``), JSON lines, one reply per request, in order::

    {"op": "list"}                                   -> {"ok": true, "lines": [{name, offset, direction, value, ...}]}
    {"op": "get", "line": NAME}                      -> {"ok": true, "value": 0|1}
    {"op": "set", "line": NAME, "value": 0|1}        -> {"ok": true, "value": 0|1}   (direction "in" lines only)
    {"op": "wait", "line": NAME, "for": "rising"|"falling"|"active"|"inactive", "timeout": S|null}
                                                     -> {"ok": true, "value": 0|1} | {"ok": false, "error": "timeout", ...}

Errors: ``{"ok": false, "error": CODE, "message": SENTENCE}``. Directions are the guest's view:
``in`` lines are driven by the host, ``out`` lines by the guest.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import mmap
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .perms import share
from .spec import GpioLine

log = logging.getLogger(__name__)

# vhost-user requests
GET_FEATURES, SET_FEATURES, SET_OWNER, RESET_OWNER, SET_MEM_TABLE = 1, 2, 3, 4, 5
SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE = 8, 9, 10, 11
SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR = 12, 13, 14
GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES, GET_QUEUE_NUM, SET_VRING_ENABLE = 15, 16, 17, 18
GET_CONFIG, SET_CONFIG = 24, 25
FLAG_VERSION, FLAG_REPLY = 0x1, 0x4
FEATURES = (1 << 32) | (1 << 30) | (1 << 0)  # VERSION_1, PROTOCOL_FEATURES, VIRTIO_GPIO_F_IRQ
PROTOCOL_FEATURES = 1 << 9  # CONFIG
NOFD = 0x100

# virtio-gpio
MSG_GET_NAMES, MSG_GET_DIRECTION, MSG_SET_DIRECTION, MSG_GET_VALUE, MSG_SET_VALUE, MSG_IRQ_TYPE = 1, 2, 3, 4, 5, 6
STATUS_OK, STATUS_ERR = 0, 1
DIR_NONE, DIR_OUT, DIR_IN = 0, 1, 2
IRQ_NONE, IRQ_RISING, IRQ_FALLING, IRQ_BOTH, IRQ_HIGH, IRQ_LOW = 0, 1, 2, 3, 4, 8
IRQ_INVALID, IRQ_VALID = 0, 1
DESC_NEXT, DESC_WRITE, DESC_INDIRECT = 1, 2, 4
REQUEST_Q, EVENT_Q = 0, 1


class GpioError(Exception):
    """A control request that cannot be served; ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Line:
    """One line: what the spec says and what the guest did with it."""

    name: str
    offset: int
    direction: str  # spec, guest's view: "in" (host drives) | "out" (guest drives)
    initial: int
    value: int = 0
    guest_direction: int = DIR_NONE
    irq_type: int = IRQ_NONE
    #: eventq buffer the guest armed for this line: (head, status address)
    armed: tuple[int, int] | None = None

    def reset(self) -> None:
        self.value = self.initial
        self.guest_direction = DIR_IN if self.direction == "in" else DIR_OUT
        self.irq_type, self.armed = IRQ_NONE, None


class BadRequest(Exception):
    """A malformed virtqueue element (answered with an error status, never fatal)."""


@dataclass
class Region:
    gpa: int
    size: int
    uva: int
    offset: int
    mm: mmap.mmap


@dataclass
class Vring:
    num: int = 0
    desc: int = 0  # QEMU virtual addresses (translated through the regions' uva)
    avail: int = 0
    used: int = 0
    last_avail: int = 0
    kick: int | None = None
    call: int | None = None
    enabled: bool = True
    started: bool = False


@dataclass(eq=False)
class _Waiter:
    line: Line
    test: Callable[[int, int], bool]  # (old, new) -> done
    future: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GpioDevice:
    """The virtio-gpio model, its vhost-user connection and the host control server."""

    def __init__(self, lines: list[GpioLine]) -> None:
        self.lines = [Line(line.name, i, line.direction, int(line.initial)) for i, line in enumerate(lines)]
        self.by_name = {line.name: line for line in self.lines}
        for line in self.lines:
            line.reset()
        names = b"".join(line.name.encode() + b"\0" for line in self.lines)
        self.names = names + b"\0" * (-len(names) % 4)
        self._waiters: set[_Waiter] = set()
        self._control: asyncio.Server | None = None
        self._vhost: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._regions: list[Region] = []
        self._rings = [Vring(), Vring()]
        self._clients: set[asyncio.StreamWriter] = set()
        self.requests_served = 0
        self.bad_requests = 0

    # ---- lifecycle -----------------------------------------------------------------------
    def reset(self) -> None:
        """Power-on: every line back to its spec value (a fresh board)."""
        for line in self.lines:
            old = line.value
            line.reset()
            self._changed(line, old)

    async def listen_control(self, path: Path) -> None:
        """Serve the host control socket (mode 0660) for as long as the runtime has this spec."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        old = os.umask(0o117)
        try:
            self._control = await asyncio.start_unix_server(self._serve_control, path=str(path))
        finally:
            os.umask(old)
        share(path, 0o660)  # like every shared socket: the exporter's UID may differ from ours
        self._control_path = path

    async def start_vhost(self, path: Path) -> None:
        """Listen for QEMU (before it starts: it asks for the config at realize)."""
        await self.stop_vhost()
        self.reset()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._vhost_path = path
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        srv.listen(1)
        srv.setblocking(False)
        self._vhost = srv
        asyncio.get_running_loop().add_reader(srv.fileno(), self._on_accept)

    def _on_accept(self) -> None:
        assert self._vhost is not None
        try:
            conn, _ = self._vhost.accept()
        except OSError:
            return
        self._disconnect()  # QEMU reconnected: the old session is over
        conn.setblocking(True)
        conn.settimeout(5)
        self._conn = conn
        asyncio.get_running_loop().add_reader(conn.fileno(), self._on_vhost_readable)
        log.info("gpio: QEMU connected to the vhost-user backend")

    async def stop_vhost(self) -> None:
        """QEMU is gone: drop the connection, the mappings and every armed event buffer."""
        self._disconnect()
        if self._vhost is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._vhost.fileno())
            self._vhost.close()
            self._vhost = None
            with contextlib.suppress(FileNotFoundError, AttributeError):
                self._vhost_path.unlink()

    async def close(self) -> None:
        """Stop everything and remove the control socket."""
        await self.stop_vhost()
        if self._control is not None:
            self._control.close()
            self._control = None
            with contextlib.suppress(FileNotFoundError, AttributeError):
                self._control_path.unlink()
        for writer in list(self._clients):
            writer.close()
        for w in list(self._waiters):
            if not w.future.done():
                w.future.set_exception(GpioError("closed", "the GPIO device was removed (spec changed or runtime stopping)"))

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        for q in range(2):
            self._stop_ring(q)
        self._unmap()
        for line in self.lines:
            line.armed = None

    # ---- vhost-user ----------------------------------------------------------------------
    def _on_vhost_readable(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            fds = array.array("i")
            data, anc, _, _ = conn.recvmsg(12, socket.CMSG_SPACE(8 * fds.itemsize))
            for level, kind, blob in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
            if len(data) < 12:
                for fd in fds:
                    os.close(fd)
                log.info("gpio: QEMU closed the vhost-user connection")
                self._disconnect()
                return
            req, flags, size = struct.unpack("<III", data)
            payload = b""
            while len(payload) < size:
                chunk = conn.recv(size - len(payload))
                if not chunk:
                    raise ConnectionError("short vhost-user message")
                payload += chunk
            self._handle(req, flags, payload, list(fds))
        except (OSError, ConnectionError, struct.error, ValueError) as e:
            log.warning("gpio: vhost-user connection dropped (%s)", e)
            self._disconnect()

    def _reply(self, req: int, payload: bytes) -> None:
        assert self._conn is not None
        self._conn.sendall(struct.pack("<III", req, FLAG_VERSION | FLAG_REPLY, len(payload)) + payload)

    def _handle(self, req: int, flags: int, p: bytes, fds: list[int]) -> None:
        log.debug("gpio: vhost-user request %d (%d bytes, %d fds)", req, len(p), len(fds))
        used_fds: set[int] = set()
        if req == GET_FEATURES:
            self._reply(req, struct.pack("<Q", FEATURES))
        elif req == GET_PROTOCOL_FEATURES:
            self._reply(req, struct.pack("<Q", PROTOCOL_FEATURES))
        elif req in (SET_FEATURES, SET_PROTOCOL_FEATURES, SET_OWNER, RESET_OWNER, SET_CONFIG):
            pass
        elif req == GET_QUEUE_NUM:
            self._reply(req, struct.pack("<Q", 2))
        elif req == GET_CONFIG:
            offset, size, cflags = struct.unpack_from("<III", p)
            config = struct.pack("<HxxI", len(self.lines), len(self.names))
            chunk = (config + b"\0" * size)[offset:offset + size]
            self._reply(req, struct.pack("<III", offset, size, cflags) + chunk)
        elif req == SET_MEM_TABLE:
            self._unmap()
            (n,) = struct.unpack_from("<I", p)
            for i in range(n):
                gpa, size, uva, off = struct.unpack_from("<QQQQ", p, 8 + 32 * i)
                mm = mmap.mmap(fds[i], size + off, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._regions.append(Region(gpa, size, uva, off, mm))
        elif req == SET_VRING_NUM:
            q, num = struct.unpack_from("<II", p)
            self._ring(q).num = num
        elif req == SET_VRING_BASE:
            q, base = struct.unpack_from("<II", p)
            self._ring(q).last_avail = base
        elif req == SET_VRING_ADDR:
            q, _f, desc, used, avail, _log = struct.unpack_from("<IIQQQQ", p)
            ring = self._ring(q)
            ring.desc, ring.used, ring.avail = desc, used, avail
        elif req == GET_VRING_BASE:
            (q,) = struct.unpack_from("<I", p)
            ring = self._ring(q)
            self._stop_ring(q)
            if q == EVENT_Q:
                for line in self.lines:
                    line.armed = None  # the driver re-arms after the ring is started again
            self._reply(req, struct.pack("<II", q, ring.last_avail))
        elif req in (SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR):
            (u,) = struct.unpack_from("<Q", p)
            q = u & 0xFF
            fd = None if u & NOFD or not fds else fds[0]
            if fd is not None:
                used_fds.add(fd)
            ring = self._ring(q)
            if req == SET_VRING_KICK:
                self._stop_ring(q)
                ring.kick = fd
                ring.started = True
                if fd is not None:
                    asyncio.get_running_loop().add_reader(fd, self._on_kick, q)
                self._process(q)
            elif req == SET_VRING_CALL:
                if ring.call is not None:
                    os.close(ring.call)
                ring.call = fd
            elif fd is not None:
                os.close(fd)  # SET_VRING_ERR: we never report errors that way
        elif req == SET_VRING_ENABLE:
            q, enable = struct.unpack_from("<II", p)
            self._ring(q).enabled = bool(enable)
            if enable:
                self._process(q)
        else:
            log.debug("gpio: ignoring vhost-user request %d", req)
        for fd in fds:
            if fd not in used_fds and req != SET_MEM_TABLE:
                os.close(fd)
        if req == SET_MEM_TABLE:
            for fd in fds:
                os.close(fd)  # mmap keeps its own reference

    def _ring(self, q: int) -> Vring:
        if q not in (REQUEST_Q, EVENT_Q):
            raise ValueError(f"virtqueue {q} does not exist")
        return self._rings[q]

    def _stop_ring(self, q: int) -> None:
        ring = self._rings[q]
        if ring.kick is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(ring.kick)
            os.close(ring.kick)
            ring.kick = None
        ring.started = False

    def _unmap(self) -> None:
        for r in self._regions:
            with contextlib.suppress(BufferError):
                r.mm.close()
        self._regions = []
        for ring in self._rings:
            if ring.call is not None and self._conn is None:
                os.close(ring.call)
                ring.call = None

    # ---- guest memory --------------------------------------------------------------------
    def _gpa(self, addr: int, length: int) -> tuple[mmap.mmap, int]:
        for r in self._regions:
            if r.gpa <= addr and addr + length <= r.gpa + r.size:
                return r.mm, r.offset + addr - r.gpa
        raise BadRequest(f"guest address {addr:#x}+{length} is outside guest memory")

    def _uva(self, addr: int, length: int) -> tuple[mmap.mmap, int]:
        for r in self._regions:
            if r.uva <= addr and addr + length <= r.uva + r.size:
                return r.mm, r.offset + addr - r.uva
        raise BadRequest(f"ring address {addr:#x} is outside guest memory")

    def _u16(self, uaddr: int) -> int:
        mm, off = self._uva(uaddr, 2)
        return struct.unpack_from("<H", mm, off)[0]

    def _chain(self, ring: Vring, head: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(readable, writable) buffers of a descriptor chain; BadRequest when malformed."""
        out: list[tuple[int, int]] = []
        inn: list[tuple[int, int]] = []
        idx, hops = head, 0
        while True:
            if idx >= ring.num or hops >= ring.num:
                raise BadRequest(f"descriptor {idx} out of range or chain loops")
            mm, off = self._uva(ring.desc + 16 * idx, 16)
            addr, length, flags, nxt = struct.unpack_from("<QIHH", mm, off)
            if flags & DESC_INDIRECT:
                raise BadRequest("indirect descriptors were not negotiated")
            (inn if flags & DESC_WRITE else out).append((addr, length))
            if not flags & DESC_NEXT:
                return out, inn
            idx, hops = nxt, hops + 1

    def _put_used(self, q: int, head: int, length: int) -> None:
        ring = self._rings[q]
        used_idx = self._u16(ring.used + 2)
        mm, off = self._uva(ring.used + 4 + 8 * (used_idx % ring.num), 8)
        struct.pack_into("<II", mm, off, head, length)
        mm2, off2 = self._uva(ring.used + 2, 2)
        struct.pack_into("<H", mm2, off2, (used_idx + 1) & 0xFFFF)

    def _signal(self, q: int) -> None:
        call = self._rings[q].call
        if call is not None:
            with contextlib.suppress(OSError):
                os.write(call, struct.pack("<Q", 1))

    def _on_kick(self, q: int) -> None:
        ring = self._rings[q]
        if ring.kick is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(ring.kick, 8)
        self._process(q)

    def _process(self, q: int) -> None:
        ring = self._rings[q]
        if not (ring.started and ring.enabled and ring.num and self._regions):
            return
        done = 0
        try:
            avail_idx = self._u16(ring.avail + 2)
            while ring.last_avail != avail_idx:
                head = self._u16(ring.avail + 4 + 2 * (ring.last_avail % ring.num))
                ring.last_avail = (ring.last_avail + 1) & 0xFFFF
                if q == REQUEST_Q:
                    self._put_used(q, head, self._request(ring, head))
                    done += 1
                else:
                    done += self._arm(ring, head)
        except BadRequest as e:  # the ring itself is unusable (bad addresses): wait for a reset
            self.bad_requests += 1
            log.warning("gpio: virtqueue %d is malformed (%s); waiting for the guest to reset it", q, e)
        if done:
            self._signal(q)

    def _request(self, ring: Vring, head: int) -> int:
        """Serve one request chain; returns the used length. Malformed requests get STATUS_ERR."""
        self.requests_served += 1
        try:
            out, inn = self._chain(ring, head)
        except BadRequest as e:
            self.bad_requests += 1
            log.warning("gpio: bad request chain (%s)", e)
            return 0
        if not inn or inn[0][1] < 1:
            self.bad_requests += 1
            return 0
        res_addr, res_len = inn[0]
        try:
            raw = b"".join(bytes(self._read(a, n)) for a, n in out)
            if len(raw) < 8:
                raise BadRequest(f"request is {len(raw)} bytes, not 8")
            kind, gpio, value = struct.unpack_from("<HHI", raw)
            if kind == MSG_GET_NAMES:
                body = bytes([STATUS_OK]) + self.names
                if res_len < len(body):
                    raise BadRequest("GET_NAMES response buffer too small")
                self._write(res_addr, body + b"\0" * (res_len - len(body)))
                return res_len
            if res_len < 2:
                raise BadRequest("response buffer shorter than 2 bytes")
            if gpio >= len(self.lines):
                raise BadRequest(f"line {gpio} does not exist ({len(self.lines)} lines)")
            line = self.lines[gpio]
            result = self._line_request(line, kind, value)
            self._write(res_addr, bytes([STATUS_OK, result]))
            return 2
        except BadRequest as e:
            self.bad_requests += 1
            log.info("gpio: request refused (%s)", e)
            with contextlib.suppress(BadRequest):
                self._write(res_addr, bytes([STATUS_ERR, 0])[: max(1, min(res_len, 2))])
                return min(res_len, 2)
            return 0

    def _line_request(self, line: Line, kind: int, value: int) -> int:
        if kind == MSG_GET_DIRECTION:
            return line.guest_direction
        if kind == MSG_SET_DIRECTION:
            if value not in (DIR_NONE, DIR_OUT, DIR_IN):
                raise BadRequest(f"direction {value} is not none/out/in")
            if value == DIR_OUT and line.direction == "in":
                raise BadRequest(f"line {line.name} is driven by the host (spec direction in)")
            line.guest_direction = value
            return 0
        if kind == MSG_GET_VALUE:
            return line.value
        if kind == MSG_SET_VALUE:
            if value not in (0, 1):
                raise BadRequest(f"value {value} is not 0/1")
            if line.direction == "in":
                raise BadRequest(f"line {line.name} is driven by the host (spec direction in)")
            old, line.value = line.value, value
            self._changed(line, old)
            return 0
        if kind == MSG_IRQ_TYPE:
            if value not in (IRQ_NONE, IRQ_RISING, IRQ_FALLING, IRQ_BOTH, IRQ_HIGH, IRQ_LOW):
                raise BadRequest(f"irq type {value} is not valid")
            line.irq_type = value
            if value == IRQ_NONE and line.armed is not None:
                self._fire(line, IRQ_INVALID)  # the driver waits for its buffer back
            else:
                self._level_check(line)
            return 0
        raise BadRequest(f"request type {kind} is unknown")

    def _read(self, addr: int, n: int) -> memoryview:
        mm, off = self._gpa(addr, n)
        return memoryview(mm)[off:off + n]

    def _write(self, addr: int, data: bytes) -> None:
        mm, off = self._gpa(addr, len(data))
        mm[off:off + len(data)] = data

    def _arm(self, ring: Vring, head: int) -> int:
        """An eventq buffer: keep it until the line fires; returns how many were completed now."""
        log.debug("gpio: event buffer %d", head)
        try:
            out, inn = self._chain(ring, head)
            raw = b"".join(bytes(self._read(a, n)) for a, n in out)
            if len(raw) < 2 or not inn or inn[0][1] < 1:
                raise BadRequest("event request is not a 2-byte line number + 1-byte status")
            (gpio,) = struct.unpack_from("<H", raw)
            line = self.lines[gpio] if gpio < len(self.lines) else None
            if line is None or line.armed is not None:
                self._write(inn[0][0], bytes([IRQ_INVALID]))
                self._put_used(EVENT_Q, head, 1)
                return 1
            line.armed = (head, inn[0][0])
            return int(self._level_check(line, signal=False))
        except BadRequest as e:
            self.bad_requests += 1
            log.info("gpio: event buffer refused (%s)", e)
            self._put_used(EVENT_Q, head, 0)
            return 1

    def _fire(self, line: Line, status: int = IRQ_VALID, *, signal: bool = True) -> bool:
        if line.armed is None or not self._regions:
            return False
        head, status_addr = line.armed
        line.armed = None
        try:
            self._write(status_addr, bytes([status]))
            self._put_used(EVENT_Q, head, 1)
        except BadRequest:
            return False
        if signal:
            self._signal(EVENT_Q)
        return True

    def _level_check(self, line: Line, *, signal: bool = True) -> bool:
        if (line.irq_type & IRQ_HIGH and line.value == 1) or (line.irq_type & IRQ_LOW and line.value == 0):
            return self._fire(line, signal=signal)
        return False

    # ---- value changes -------------------------------------------------------------------
    def _changed(self, line: Line, old: int) -> None:
        new = line.value
        if old != new:
            rising = new == 1
            if line.irq_type & (IRQ_RISING if rising else IRQ_FALLING):
                self._fire(line)
            else:
                self._level_check(line)
        for w in list(self._waiters):
            if w.line is line and not w.future.done() and w.test(old, new):
                w.future.set_result(new)

    def set_value(self, name: str, value: int) -> int:
        """Host drives a guest input line."""
        line = self._line(name)
        if line.direction != "in":
            raise GpioError(
                "not_host_driven",
                f"line {name!r} is an output of the guest (spec direction out); the host can only read it "
                "or wait for it (read_pin, wait_for_edge)",
            )
        if value not in (0, 1):
            raise GpioError("bad_value", f"value {value!r} is not 0 or 1")
        old, line.value = line.value, value
        self._changed(line, old)
        return value

    def _line(self, name: object) -> Line:
        line = self.by_name.get(str(name))
        if line is None:
            raise GpioError("no_line", f"no GPIO line named {name!r}; the spec has {', '.join(self.by_name)}")
        return line

    async def wait(self, name: str, until: str, timeout: float | None) -> int:
        """Wait for an edge (``rising``/``falling``) or a level (``active``/``inactive``)."""
        line = self._line(name)
        tests: dict[str, Callable[[int, int], bool]] = {
            "rising": lambda o, n: o == 0 and n == 1,
            "falling": lambda o, n: o == 1 and n == 0,
            "active": lambda o, n: n == 1,
            "inactive": lambda o, n: n == 0,
        }
        if until not in tests:
            raise GpioError("bad_wait", f"cannot wait for {until!r}; use rising, falling, active or inactive")
        if (until == "active" and line.value == 1) or (until == "inactive" and line.value == 0):
            return line.value
        waiter = _Waiter(line, tests[until])
        self._waiters.add(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            raise GpioError("timeout", f"line {name!r} did not go {until} within {timeout} s") from None
        finally:
            self._waiters.discard(waiter)

    def describe(self) -> list[dict[str, object]]:
        dirs = {DIR_NONE: "none", DIR_OUT: "out", DIR_IN: "in"}
        return [
            {"name": x.name, "offset": x.offset, "direction": x.direction, "value": x.value,
             "guest_direction": dirs.get(x.guest_direction, "?"), "irq_type": x.irq_type, "armed": x.armed is not None}
            for x in self.lines
        ]

    # ---- control socket ------------------------------------------------------------------
    async def _serve_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while line := await reader.readline():
                reply = await self._control_request(line)
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._clients.discard(writer)
            writer.close()

    async def _control_request(self, raw: bytes) -> dict[str, object]:
        try:
            try:
                req = json.loads(raw)
                if not isinstance(req, dict):
                    raise ValueError
            except ValueError:
                raise GpioError("bad_request", "send one JSON object per line, e.g. {\"op\": \"list\"}") from None
            op = req.get("op")
            rid = {"id": req["id"]} if "id" in req else {}
            if op == "list":
                return {"ok": True, "lines": self.describe(), **rid}
            if op == "get":
                return {"ok": True, "value": self._line(req.get("line")).value, **rid}
            if op == "set":
                value = req.get("value")
                value = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
                return {"ok": True, "value": self.set_value(str(req.get("line")), value), **rid}  # type: ignore[arg-type]
            if op == "wait":
                timeout = req.get("timeout")
                value = await self.wait(str(req.get("line")), str(req.get("for")),
                                        None if timeout is None else float(timeout))
                return {"ok": True, "value": value, **rid}
            raise GpioError("bad_request", f"op {op!r} is unknown; use list, get, set or wait")
        except GpioError as e:
            return {"ok": False, "error": e.code, "message": e.message}
        except Exception as e:  # a bug must cost one request, never the control socket
            log.exception("gpio: control request %r failed", raw[:200])
            return {"ok": False, "error": "internal", "message": f"the runtime failed to serve this request ({e})"}
