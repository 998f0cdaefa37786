"""A python-can Bus that is the SLCAN *device* end of a vmsidecar CAN bus socket.

The guest's ``slcand`` is the SLCAN host: it sends ``S<n>``/``O``/``C`` commands and transmits
frames as ``tIIIL…``/``TIIIIIIIIL…``/``rIIIL``/``RIIIIIIIIL`` lines ending in ``\\r``. This bus
answers commands with ``\\r`` and hands frames to python-can; frames sent on the bus are written
to the guest in the same notation, which the guest's slcan line discipline delivers to its
SocketCAN interface. Registered as the python-can interface ``vmsidecar-slcan``; the channel is
the Unix socket ``<shared>/can/<bus>.sock`` served by the runtime, optionally followed by
``;bitrate=N`` (the ``Can`` driver passes only a channel): frames are then sent no faster than a
real bus of that bitrate carries them, which is also what keeps the guest from dropping them.

The connection is opened at the tree's claim (``reconnect``) or first use, so the bus can be created
before the runtime is up (the exporter builds its driver tree at start). Behind the socket the guest
changes at every claim and recycle: a lease's tree is built while the previous lease's guest still
runs, and may still run when the next lease claims. So a connection's frames die with it: what was
received on a connection that ended (or that ``reconnect`` dropped) is never handed out after it; a
connection the runtime ended is not opened again but by the next claim; and a bus that was shut down
never connects again (its periodic sends included), whatever its lease left running.
"""

from __future__ import annotations

import contextlib
import logging
import re
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import can

from .arguments import periodic_send, room_for_periodic_send, seconds_or_none

log = logging.getLogger(__name__)

#: slcand's -s<n> speeds
SLCAN_BITRATES = (10000, 20000, 50000, 100000, 125000, 250000, 500000, 800000, 1000000)
#: the longest SLCAN line is an extended data frame with a timestamp (T + 8 + 1 + 16 + 4 = 30);
#: anything longer is not SLCAN, and is dropped up to the next CR instead of being buffered
MAX_LINE = 64
#: received frames kept for python-can's recv (a guest writing faster than the test reads loses
#: the oldest; a minute of a saturated 1 Mbit/s bus is ~500,000, so this is seconds of backlog)
RX_LIMIT = 10_000
#: at most one drop warning per this many seconds (a flood must not become a log flood)
WARN_EVERY = 10.0
#: a frame line exactly as an SLCAN host writes it: kind and id (3 hex digits, 8 for T/R), DLC, then
#: hex (the data, and maybe a 4-digit timestamp); int(x, 16) alone would also take a sign, spaces,
#: "0x" and "_" from the guest
FRAME = re.compile(rb"([tr][0-9A-Fa-f]{3}|[TR][0-9A-Fa-f]{8})([0-8])([0-9A-Fa-f]*)")


def encode(msg: can.Message) -> bytes:
    """One SLCAN transmit line for ``msg`` (classic CAN only)."""
    if msg.is_fd:
        raise can.CanOperationError("SLCAN carries classic CAN only; send is_fd=False frames")
    dlc = msg.dlc if msg.is_remote_frame else len(msg.data)
    if not 0 <= dlc <= 8:
        raise can.CanOperationError(f"a classic CAN frame carries 0-8 bytes, not {dlc}")
    if msg.is_extended_id:
        head = ("R" if msg.is_remote_frame else "T") + f"{msg.arbitration_id & 0x1FFFFFFF:08X}"
    else:
        if msg.arbitration_id > 0x7FF:
            raise can.CanOperationError(
                f"standard id {msg.arbitration_id:#x} does not fit 11 bits; set is_extended_id=True"
            )
        head = ("r" if msg.is_remote_frame else "t") + f"{msg.arbitration_id:03X}"
    body = "" if msg.is_remote_frame else bytes(msg.data).hex().upper()
    return f"{head}{dlc}{body}\r".encode()


def decode(line: bytes, channel: Any = None) -> can.Message | None:
    """A frame from one SLCAN line (without ``\\r``); None for anything that is not a frame."""
    m = FRAME.fullmatch(line)
    if m is None:
        return None
    head, dlc, hexes = m[1], int(m[2]), m[3]
    extended, remote = head[:1] in b"TR", head[:1] in b"rR"
    ident = int(head[1:], 16)
    size = 0 if remote else 2 * dlc
    if ident > (0x1FFFFFFF if extended else 0x7FF) or len(hexes) not in (size, size + 4):
        return None  # an id wider than 11/29 bits; data not of DLC bytes (+ a timestamp)
    data = bytes.fromhex(hexes[:size].decode())
    return can.Message(timestamp=time.time(), arbitration_id=ident, is_extended_id=extended,
                       is_remote_frame=remote, dlc=dlc, data=data, channel=channel, is_rx=True)


class _PeriodicSend(can.broadcastmanager.ThreadBasedCyclicSendTask):
    """python-can's thread-based periodic send, except that its wait for the next frame ends at
    ``stop``: python-can's thread sleeps out the period after a stop, so a lease's send with a
    period of hours kept its thread and bus for hours after the lease, and the exporter's threads
    (every lease's) piled up. Its loop is python-can 4's ``_run`` with that one wait changed.

    ``kept`` from its making until its ``stop``: a task made unstarted, or ended by its duration or
    a failed send, still holds its frames for whoever may start it again, so the bus's cap counts it.
    """

    def __init__(self, bus: VmsidecarSlcanBus, lock: threading.Lock, messages: Sequence[can.Message] | can.Message,
                 period: float, duration: float | None, on_error: Callable[[Exception], bool],
                 modifier_callback: Callable[[can.Message], None] | None) -> None:
        self._woken = threading.Event()
        self.kept = True
        super().__init__(bus, lock, messages, period, duration, on_error, False, modifier_callback)

    def stop(self) -> None:
        self.kept = False
        self._end()

    def _end(self) -> None:
        super().stop()
        self._woken.set()

    def start(self) -> None:
        def start() -> None:
            self.kept = True
            self._woken.clear()
            super(_PeriodicSend, self).start()

        bus = self.bus
        assert isinstance(bus, VmsidecarSlcanBus)
        bus._start_periodic_send(self, start)

    def _run(self) -> None:
        index = 0
        due = time.perf_counter()
        while not self.stopped:
            if self.end_time is not None and time.perf_counter() >= self.end_time:
                self._end()
                break
            try:
                if self.modifier_callback is not None:
                    self.modifier_callback(self.messages[index])
                with self.send_lock:
                    self.bus.send(self.messages[index])
            except Exception as exc:
                if self.on_error is None or not self.on_error(exc):
                    self._end()
                    break
            due += self.period
            index = (index + 1) % len(self.messages)
            self._woken.wait(max(0.0, due - time.perf_counter()))


class VmsidecarSlcanBus(can.BusABC):
    """python-can interface ``vmsidecar-slcan``: channel = path of the runtime's CAN bus socket."""

    def __init__(self, channel: Any, bitrate: int | None = None, **kwargs: Any) -> None:
        if not channel:
            raise can.CanInitializationError("channel must be the CAN bus socket, e.g. /shared/vmsidecar/can/can0.sock")
        path, _, opts = str(channel).partition(";")
        for opt in filter(None, opts.split(";")):
            key, _, value = opt.partition("=")
            if key != "bitrate" or not value.isdigit():
                raise can.CanInitializationError(f"channel option {opt!r} is not bitrate=N")
            bitrate = int(value)
        self.channel = path
        self._next_tx = 0.0
        self.channel_info = f"vmsidecar SLCAN bus on {self.channel}"
        self.bitrate = bitrate
        # raw lines, decoded when read: a flood of frames nobody reads costs a split, not a Message each
        self._rx: deque[tuple[float, bytes]] = deque(maxlen=RX_LIMIT)
        self._rx_ready = threading.Condition()
        #: what the guest sent that this bus did not keep: frames pushed out of a full backlog,
        #: lines longer than MAX_LINE and their bytes
        self.dropped_frames = self.dropped_lines = self.dropped_bytes = 0
        self._warned_at = 0.0
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader: threading.Thread | None = None
        #: the runtime ended the connection (the guest behind it changed): none until ``reconnect``
        self._ended = False
        #: periodic sends made on this bus, also those upstream's ``Can`` driver makes without
        #: ``send_periodic`` (BusABC.shutdown stops only the ones that one recorded)
        self._cyclic: weakref.WeakSet[_PeriodicSend] = weakref.WeakSet()
        self._periodic_lock = threading.Lock()  # one periodic frame on the socket at a time
        # no connection yet: whoever is behind the socket now may be the previous lease's guest
        super().__init__(channel=channel, **kwargs)

    # ---- connection ----------------------------------------------------------------------
    def _shut_down(self) -> can.CanOperationError:
        return can.CanOperationError(f"the CAN bus {self.channel} is shut down (its lease ended); it does "
                                     "not connect again")

    def _connect(self) -> socket.socket:
        """This bus's connection, opened if it has none.

        :raise can.CanOperationError: the bus is shut down, or its connection ended (the next
            lease may be behind the socket by now: only the tree's claim connects again).
        :raise OSError: the socket is not served (the runtime is not up).
        """
        with self._lock:
            if self._closed.is_set():  # (under the lock: shutdown closes what was opened before)
                raise self._shut_down()
            if self._sock is not None:
                return self._sock
            if self._ended:
                raise can.CanOperationError(
                    f"the connection to the CAN bus {self.channel} ended (the VM was recycled or the runtime "
                    "restarted): the guest behind it is no longer this lease's; the bus connects again at "
                    "its lease's next claim")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.channel)
            except OSError:
                sock.close()
                raise
            self._sock = sock
            self._forget_received()  # (a reader of an earlier connection may have queued since its drop)
            self._reader = threading.Thread(target=self._read_loop, args=(sock,), daemon=True,
                                            name=f"slcan-{self.channel}")
            self._reader.start()
            return sock

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            if self._sock is sock:
                self._sock = None
                self._ended = True
                # the runtime ends a connection when the guest behind it changes (claim, recycle):
                # what the old guest sent must not be the next one's first frames, and what this
                # bus sends must not reach the next one
                self._forget_received()
        with contextlib.suppress(OSError):
            sock.close()

    def _forget_received(self) -> None:
        with self._rx_ready:
            self._rx.clear()

    def reconnect(self) -> None:
        """Drop the connection and every frame received on it, then connect anew (quietly when the
        socket is not served: the next use tries again).

        The driver calls this when its tree has claimed the VM: nothing of the guest before the
        claim is handed out after it, and what the lease's guest sends from then on is kept.
        """
        with self._lock:
            sock, self._sock, self._ended = self._sock, None, False
            self._forget_received()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # ends its reader, which then finds it already dropped
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError):
            self._connect()

    @property
    def rx_limit(self) -> int:
        """How many received frames wait for ``recv`` at most (the oldest go first)."""
        return RX_LIMIT

    def backlog(self) -> int:
        """Received lines not yet taken by ``recv``."""
        return len(self._rx)

    def _read_loop(self, sock: socket.socket) -> None:
        # Linear in what the guest sends: each chunk is split once; only an unfinished line of at
        # most MAX_LINE bytes is carried over, and a longer one is skipped up to its CR.
        partial = b""
        skipping = False
        try:
            while not self._closed.is_set():
                chunk = sock.recv(65536)
                if not chunk:
                    break
                *ended, rest = chunk.split(b"\r")
                if ended:
                    if skipping:  # the CR that ends an overlong line (counted when it began)
                        self.dropped_bytes += len(ended[0])
                        del ended[0]
                    else:
                        ended[0] = partial + ended[0]
                    partial, skipping = b"", False
                if skipping:
                    self.dropped_bytes += len(rest)
                else:
                    partial += rest
                    if len(partial) > MAX_LINE:
                        self._overlong(len(partial))
                        partial, skipping = b"", True
                replies = self._take(ended, sock)
                if replies:
                    sock.sendall(replies)
        except OSError:
            pass
        finally:
            self._drop(sock)

    def _take(self, lines: list[bytes], sock: socket.socket) -> bytes:
        """Queue the frames among ``lines`` read from ``sock``; the acknowledgements owed for the
        commands among them. Nothing when ``sock`` is no longer this bus's connection."""
        now = time.time()
        replies = 0
        frames = []
        for raw in lines:
            if len(raw) > MAX_LINE:
                self._overlong(len(raw))
                continue
            line = raw.strip(b"\n\x07")
            if line and line[:1] in b"tTrR":
                frames.append((now, line))
            elif line[:1] in b"SsOCVNFZMmLl":  # (an empty line too, as slcand expects)
                replies += 1  # a command of the SLCAN host (slcand): acknowledge it
        if frames:
            with self._rx_ready:  # (the lock _drop and reconnect empty the queue under)
                if self._sock is not sock:
                    return b""  # read just before its connection was dropped: an earlier guest's
                pushed_out = max(0, len(self._rx) + len(frames) - RX_LIMIT)
                self._rx.extend(frames)
                self._rx_ready.notify_all()
            if pushed_out:
                self.dropped_frames += pushed_out
                self._warn()
        return b"\r" * replies

    def _overlong(self, size: int) -> None:
        self.dropped_lines += 1
        self.dropped_bytes += size
        self._warn()

    def _warn(self, *, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("CAN bus %s: dropped what the guest sent beyond this bus's limits: %d frames nobody read "
                        "(more than %d waiting; call recv sooner), %d overlong lines (%d bytes; an SLCAN line is "
                        "at most %d bytes)", self.channel, self.dropped_frames, RX_LIMIT, self.dropped_lines,
                        self.dropped_bytes, MAX_LINE)

    # ---- python-can ----------------------------------------------------------------------
    def _pace(self, msg: can.Message) -> None:
        """Wait for the previous frame to be "on the wire" at the bus bitrate (no stuffing counted)."""
        if not self.bitrate:
            return
        bits = (67 if msg.is_extended_id else 47) + (0 if msg.is_remote_frame else 8 * len(msg.data))
        now = time.monotonic()
        if self._next_tx > now and self._closed.wait(self._next_tx - now):
            raise self._shut_down()
        self._next_tx = max(now, self._next_tx) + bits / self.bitrate

    def send(self, msg: can.Message, timeout: float | None = None) -> None:
        limit = seconds_or_none(timeout)
        data = encode(msg)
        self._pace(msg)
        wait = 5.0 if limit is None else limit
        deadline = time.monotonic() + wait
        while True:
            try:
                sock = self._connect()
                if self._writable(sock, deadline):  # (sendall blocks while the guest does not read)
                    sock.sendall(data)
                    return
            except OSError as e:
                if self._closed.is_set():
                    raise self._shut_down() from e
                if time.monotonic() >= deadline:
                    raise can.CanOperationError(
                        f"cannot reach the CAN bus socket {self.channel} ({e.strerror or e}); the runtime "
                        "serves it while its spec has this bus"
                    ) from e
                if self._closed.wait(0.1):
                    raise self._shut_down() from e
                continue
            raise can.CanTimeoutError(f"the frame was not sent within {wait:g} s: the guest is not reading the "
                                      f"CAN bus {self.channel} (its buffer is full)")

    def _writable(self, sock: socket.socket, deadline: float) -> bool:
        """Whether ``sock`` takes bytes before ``deadline`` (a frame is ≤ 30 bytes: room for it).

        :raise can.CanOperationError: the bus was shut down meanwhile.
        :raise OSError: the socket was dropped meanwhile (the reader saw it end).
        """
        fd = sock.fileno()
        if fd < 0:
            raise OSError("the CAN bus socket was closed")
        poll = select.poll()
        poll.register(fd, select.POLLOUT)  # (a hang-up answers too: sendall then says why)
        while True:  # (one look even at timeout 0: python-can's "try once, without blocking")
            if self._closed.is_set():
                raise self._shut_down()
            left = deadline - time.monotonic()
            if poll.poll(max(0, int(min(left, 0.25) * 1000))):
                return True
            if time.monotonic() >= deadline:
                return False

    def _recv_internal(self, timeout: float | None) -> tuple[can.Message | None, bool]:
        # None (what upstream's CanClient.recv sends by default): until a frame arrives or the bus is
        # shut down. A shut-down bus raises rather than answering None: python-can's recv(None)
        # would ask again at once, forever.
        limit = seconds_or_none(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            if self._closed.is_set():
                raise self._shut_down()
            if self._sock is None:
                with contextlib.suppress(OSError):
                    self._connect()  # the runtime (or its socket) is up now
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            with self._rx_ready:  # (closed looked at under the lock shutdown notifies with)
                if not self._rx and left > 0 and not self._closed.is_set():
                    self._rx_ready.wait(left)
                item = self._rx.popleft() if self._rx else None
            if item is not None:
                msg = decode(item[1], self.channel)
                if msg is not None:
                    msg.timestamp = item[0]
                    return msg, False
                continue  # a t/T/r/R line that is not a frame: skip it
            if deadline is not None and time.monotonic() >= deadline:
                return None, False

    def flush_tx_buffer(self) -> None:
        """Nothing is buffered on this side: frames go to the socket at once."""

    def _send_periodic_internal(
        self,
        msgs: Sequence[can.Message] | can.Message,
        period: float,
        duration: float | None = None,
        autostart: bool = True,
        modifier_callback: Callable[[can.Message], None] | None = None,
    ) -> can.broadcastmanager.CyclicSendTaskABC:
        with self._lock:  # (shutdown stops, under this lock, every task started before it)
            if self._closed.is_set():
                raise self._shut_down()
            # python-can takes any float: NaN failed inside it, zero or less sent as fast as the bus
            # goes, years held a thread for years
            period, duration = periodic_send(msgs, period, duration, kept=self._kept(), channel=self.channel)
            # a send that fails (the bus shut down, its connection ended) ends the task with a warning,
            # not an exception left unhandled in its thread
            task = _PeriodicSend(self, self._periodic_lock, msgs, period, duration, self._periodic_send_failed,
                                 modifier_callback)
            self._cyclic.add(task)
        if autostart:
            task.start()
        return task

    def _kept(self, besides: object = None) -> int:
        """Periodic sends kept on this bus but ``besides``, running or not (called under ``_lock``)."""
        return sum(1 for task in self._cyclic if task is not besides and task.kept)

    def _start_periodic_send(self, task: _PeriodicSend, start: Callable[[], None]) -> None:
        """Start (or restart: upstream's exported ``Can._start_task``) ``task`` within the cap, and
        never on a bus that was shut down."""
        with self._lock:
            if self._closed.is_set():
                raise self._shut_down()
            room_for_periodic_send(self._kept(task), self.channel)
            start()

    def _periodic_send_failed(self, exc: Exception) -> bool:
        log.warning("a periodic send on the CAN bus %s stopped: %s", self.channel, exc)
        return False

    def shutdown(self) -> None:
        with self._lock:  # after this no _connect opens a socket, and no periodic send starts
            self._closed.set()
            sock, self._sock = self._sock, None
            tasks = list(self._cyclic)
        for task in tasks:
            with contextlib.suppress(Exception):
                task.stop()
        deadline = time.monotonic() + 1.0  # (woken at once; one may be in a paced send)
        for task in tasks:
            if task.thread is not None:
                task.thread.join(max(0.0, deadline - time.monotonic()))
        with self._rx_ready:
            self._rx.clear()
            self._rx_ready.notify_all()  # a recv waiting for a frame ends now
        if self.dropped_frames or self.dropped_lines:
            self._warn(final=True)  # the totals, whatever the rate limit held back
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv and a blocked sendall
            self._drop(sock)
        super().shutdown()
