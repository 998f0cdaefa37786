"""The virtio-gpio device model (virtio spec 5.17): lines, the request queue and the event queue.

The guest's standard ``gpio-virtio`` driver sees a gpiochip whose lines, names, directions and
initial values come from the spec. The request queue serves GET_NAMES, GET/SET_DIRECTION,
GET/SET_VALUE and IRQ_TYPE. The event queue holds one buffer per armed line and returns it
(status VALID) when the line's edge or level fires, or INVALID when the guest disarms the line:
that is what ``gpiomon`` waits on.

A malformed request is answered with ``STATUS_ERR`` (or a zero-length used element when not even
the response buffer is usable); nothing the guest writes can raise out of this model. Host-side
changes (:meth:`VirtioGpio.drive`) go through the same edge logic and are reported to listeners.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from vmsidecar_contract.errors import GuestError, NotFoundError, RequestError
from vmsidecar_contract.spec import GpioLine

from .virtqueue import Virtqueue, bad_virtqueue

log = logging.getLogger(__name__)

VIRTIO_GPIO_F_IRQ = 1 << 0
MSG_GET_NAMES, MSG_GET_DIRECTION, MSG_SET_DIRECTION, MSG_GET_VALUE, MSG_SET_VALUE, MSG_IRQ_TYPE = 1, 2, 3, 4, 5, 6
STATUS_OK, STATUS_ERR = 0, 1
DIR_NONE, DIR_OUT, DIR_IN = 0, 1, 2
IRQ_NONE, IRQ_RISING, IRQ_FALLING, IRQ_BOTH, IRQ_HIGH, IRQ_LOW = 0, 1, 2, 3, 4, 8
IRQ_TYPES = (IRQ_NONE, IRQ_RISING, IRQ_FALLING, IRQ_BOTH, IRQ_HIGH, IRQ_LOW)
IRQ_INVALID, IRQ_VALID = 0, 1
REQUEST_Q, EVENT_Q = 0, 1
REQUEST = struct.Struct("<HHI")  # type, gpio, value
#: what one request or event chain may be: the Linux driver posts 2 descriptors (request, response)
#: of a few bytes, GET_NAMES' response is the names (at most a few KiB); anything bigger is hostile
#: and refused before a byte of it is copied
MAX_CHAIN_DESCRIPTORS = 4
MAX_CHAIN_BYTES = 64 * 1024
#: chains served per turn of the event loop: a guest posting without pause cannot hold the runtime
BATCH = 64
#: at most one warning about refused requests per this many seconds (a flood must not fill the log)
WARN_EVERY = 10.0

#: called as ``listener(line, old, new)`` after every value change, host- or guest-made
Listener = Callable[["Line", int, int], None]


@dataclass
class Line:
    """One line: what the spec says and what the guest did with it."""

    name: str
    offset: int
    direction: str  # the spec's, i.e. the guest's view: "in" (host drives) | "out" (guest drives)
    initial: int
    value: int = 0
    guest_direction: int = DIR_NONE
    irq_type: int = IRQ_NONE
    #: the event buffer the guest armed for this line: (head, guest address of its status byte)
    armed: tuple[int, int] | None = None

    def reset(self) -> None:
        """Power-on state: the spec's initial value, direction as wired, no irq."""
        self.value = self.initial
        self.guest_direction = DIR_IN if self.direction == "in" else DIR_OUT
        self.irq_type, self.armed = IRQ_NONE, None


class VirtioGpio:
    """The virtio-gpio device: a :class:`~.vhost_user.VhostUserDevice` plus the host's side of the lines."""

    features = VIRTIO_GPIO_F_IRQ
    num_queues = 2

    def __init__(self, lines: list[GpioLine]) -> None:
        self.lines = [Line(line.name, i, line.direction, int(line.initial)) for i, line in enumerate(lines)]
        self.by_name = {line.name: line for line in self.lines}
        for line in self.lines:
            line.reset()
        names = b"".join(line.name.encode() + b"\0" for line in self.lines)
        self.names = names + b"\0" * (-len(names) % 4)  # the config's names_size is a multiple of 4
        self.requests_served = 0
        #: chains refused (malformed, too long, too large, outside memory) and queues broken
        self.bad_requests = 0
        self.broken_queues = 0
        self._warned_at: dict[str, float] = {}
        self._resuming: set[int] = set()
        #: the event queue while QEMU has it started (host edges complete buffers on it)
        self._eventq: Virtqueue | None = None
        self._listeners: list[Listener] = []

    # ---- the host's side ---------------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(line, old, new)`` after every value change."""
        self._listeners.append(listener)

    def reset(self) -> None:
        """Power-on: every line back to its spec value (a fresh board)."""
        for line in self.lines:
            old = line.value
            line.reset()
            self._changed(line, old)

    def line(self, name: object) -> Line:
        """The line called ``name``.

        :raise NotFoundError: (``no_line``) when the spec has no such line.
        """
        line = self.by_name.get(str(name))
        if line is None:
            raise NotFoundError(f"no GPIO line named {name!r}; the spec has {', '.join(self.by_name)}",
                                code="no_line")
        return line

    def drive(self, name: str, value: object) -> int:
        """The host drives a guest input line; returns the new value.

        :raise NotFoundError: (``no_line``) for an unknown line.
        :raise RequestError: (``not_host_driven``) for a guest output, (``bad_value``) for a value not 0/1.
        """
        line = self.line(name)
        if line.direction != "in":
            raise RequestError(
                f"line {name!r} is an output of the guest (spec direction out); the host can only read it "
                "or wait for it (read_pin, wait_for_edge)", code="not_host_driven")
        if value not in (0, 1):  # 1.0 counts: JSON through Jumpstarter may turn ints into floats
            raise RequestError(f"value {value!r} is not 0 or 1", code="bad_value")
        old, line.value = line.value, 1 if value == 1 else 0
        self._changed(line, old)
        return line.value

    def _changed(self, line: Line, old: int) -> None:
        new = line.value
        if old != new:
            if line.irq_type & (IRQ_RISING if new == 1 else IRQ_FALLING):
                self._fire(line)
            else:
                self._level_check(line)
        for listener in list(self._listeners):
            listener(line, old, new)

    # ---- VhostUserDevice ---------------------------------------------------------------------
    def config(self) -> bytes:
        """``struct virtio_gpio_config``: ngpio, padding, gpio_names_size."""
        return struct.pack("<HxxI", len(self.lines), len(self.names))

    def queue_started(self, vq: Virtqueue) -> None:
        """Remember the event queue: host edges complete its buffers."""
        if vq.index == EVENT_Q:
            self._eventq = vq

    def queue_stopped(self, vq: Virtqueue) -> None:
        """A stopped event queue voids the armed buffers; the driver re-arms after the restart."""
        if vq.index == EVENT_Q:
            self._eventq = None
            for line in self.lines:
                line.armed = None

    def queue_notified(self, vq: Virtqueue) -> None:
        """Take the buffers the guest posted, ``BATCH`` per turn of the loop; interrupt it once per
        turn if any was completed. A ring the guest broke is left alone until QEMU restarts it."""
        if not vq.ready:
            return
        done = served = 0
        try:
            while (head := vq.pop()) is not None:
                if vq.index == REQUEST_Q:
                    vq.push(head, self._request(vq, head))
                    done += 1
                else:
                    done += self._arm(vq, head)
                served += 1
                if served >= BATCH:
                    self._resume_later(vq)
                    break
        except GuestError as e:  # the ring itself is unusable: the virtio NEEDS_RESET case
            vq.broken = str(e)
            self.broken_queues += 1
            self._warn("broken", f"virtqueue {vq.index} is broken ({e}); ignoring it until the guest resets "
                       f"the device; {self.broken_queues} broken so far")
        if done:
            vq.notify()

    def _resume_later(self, vq: Virtqueue) -> None:
        if vq.index not in self._resuming:
            self._resuming.add(vq.index)
            asyncio.get_running_loop().call_soon(self._resume, vq)

    def _resume(self, vq: Virtqueue) -> None:
        self._resuming.discard(vq.index)
        self.queue_notified(vq)

    def _refused(self, what: str, error: GuestError) -> None:
        """Count a refused chain; warn now and then with the count (never once per request)."""
        self.bad_requests += 1
        self._warn("refused", f"{what} refused ({error}); {self.bad_requests} refused so far")

    def _warn(self, kind: str, message: str) -> None:
        """Log a ``kind`` of trouble now and then: the guest can repeat any of them in a loop (refused
        requests; a ring broken, the device reset, the ring broken again)."""
        now = time.monotonic()
        if now - self._warned_at.get(kind, -WARN_EVERY) >= WARN_EVERY:
            self._warned_at[kind] = now
            log.warning("gpio: %s", message)

    # ---- the request queue ---------------------------------------------------------------------
    def _request(self, vq: Virtqueue, head: int) -> int:
        """Serve one request chain; returns the used length. Malformed requests get STATUS_ERR."""
        self.requests_served += 1
        try:
            readable, writable = vq.chain(head, max_descriptors=MAX_CHAIN_DESCRIPTORS, max_bytes=MAX_CHAIN_BYTES)
        except GuestError as e:
            self._refused("request chain", e)
            return 0
        if not writable or writable[0][1] < 1:
            self._refused("request chain", bad_virtqueue("no response buffer"))
            return 0
        res_addr, res_len = writable[0]
        try:
            vq.memory.locate(res_addr, res_len)  # before a response of res_len bytes is built
            response = self._response(vq.read_all(readable), res_len)
            vq.memory.write(res_addr, response)
            return len(response)
        except GuestError as e:
            self._refused("request", e)
            status = bytes([STATUS_ERR, 0])[: min(res_len, 2)]
            try:
                vq.memory.write(res_addr, status)
            except GuestError:
                return 0
            return len(status)

    def _response(self, raw: bytes, res_len: int) -> bytes:
        """The response bytes to a request (status first).

        :raise GuestError: (``bad_virtqueue``) when the request or its buffer is unusable.
        """
        if len(raw) < REQUEST.size:
            raise bad_virtqueue(f"request is {len(raw)} bytes, not {REQUEST.size}")
        kind, gpio, value = REQUEST.unpack_from(raw)
        if kind == MSG_GET_NAMES:
            body = bytes([STATUS_OK]) + self.names
            if res_len < len(body):
                raise bad_virtqueue("GET_NAMES response buffer too small")
            return body + b"\0" * (res_len - len(body))
        if res_len < 2:
            raise bad_virtqueue("response buffer shorter than 2 bytes")
        if gpio >= len(self.lines):
            raise bad_virtqueue(f"line {gpio} does not exist ({len(self.lines)} lines)")
        return bytes([STATUS_OK, self._line_request(self.lines[gpio], kind, value)])

    def _line_request(self, line: Line, kind: int, value: int) -> int:
        """Apply one per-line request; returns the response value byte.

        :raise GuestError: (``bad_virtqueue``) for an unknown type, a bad value, or a host-driven line.
        """
        if kind == MSG_GET_DIRECTION:
            return line.guest_direction
        if kind == MSG_GET_VALUE:
            return line.value
        if kind == MSG_SET_DIRECTION:
            if value not in (DIR_NONE, DIR_OUT, DIR_IN):
                raise bad_virtqueue(f"direction {value} is not none/out/in")
            if value == DIR_OUT and line.direction == "in":
                raise bad_virtqueue(f"line {line.name} is driven by the host (spec direction in)")
            line.guest_direction = value
            return 0
        if kind == MSG_SET_VALUE:
            if value not in (0, 1):
                raise bad_virtqueue(f"value {value} is not 0/1")
            if line.direction == "in":
                raise bad_virtqueue(f"line {line.name} is driven by the host (spec direction in)")
            old, line.value = line.value, value
            self._changed(line, old)
            return 0
        if kind == MSG_IRQ_TYPE:
            if value not in IRQ_TYPES:
                raise bad_virtqueue(f"irq type {value} is not valid")
            line.irq_type = value
            if value == IRQ_NONE and line.armed is not None:
                self._fire(line, IRQ_INVALID)  # the driver waits for its buffer back
            else:
                self._level_check(line)
            return 0
        raise bad_virtqueue(f"request type {kind} is unknown")

    # ---- the event queue -----------------------------------------------------------------------
    def _arm(self, vq: Virtqueue, head: int) -> int:
        """Keep an event buffer until its line fires; returns how many buffers were completed now."""
        try:
            readable, writable = vq.chain(head, max_descriptors=MAX_CHAIN_DESCRIPTORS, max_bytes=MAX_CHAIN_BYTES)
            raw = vq.read_all(readable)
            if len(raw) < 2 or not writable or writable[0][1] < 1:
                raise bad_virtqueue("event request is not a 2-byte line number + 1-byte status")
            (gpio,) = struct.unpack_from("<H", raw)
            line = self.lines[gpio] if gpio < len(self.lines) else None
            if line is None or line.armed is not None:
                vq.memory.write(writable[0][0], bytes([IRQ_INVALID]))
                vq.push(head, 1)
                return 1
            line.armed = (head, writable[0][0])
            return int(self._level_check(line, notify=False))
        except GuestError as e:
            self._refused("event buffer", e)
            vq.push(head, 0)
            return 1

    def _fire(self, line: Line, status: int = IRQ_VALID, *, notify: bool = True) -> bool:
        """Complete the line's armed event buffer with ``status``; True if one was completed."""
        vq = self._eventq
        if line.armed is None or vq is None or not vq.memory.mapped:
            return False
        head, status_addr = line.armed
        line.armed = None
        try:
            vq.memory.write(status_addr, bytes([status]))
            vq.push(head, 1)
        except GuestError:
            return False
        if notify:
            vq.notify()
        return True

    def _level_check(self, line: Line, *, notify: bool = True) -> bool:
        """Fire a level-triggered line whose level holds now."""
        if (line.irq_type & IRQ_HIGH and line.value == 1) or (line.irq_type & IRQ_LOW and line.value == 0):
            return self._fire(line, notify=notify)
        return False
