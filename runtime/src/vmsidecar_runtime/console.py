"""Console hub: one guest byte stream, drained always, ring-buffered, fanned out to many readers.

The backend serves each stream on a private socket, or on pipes (the QEMU backend's virtio
consoles, ``stream_pipes.py``); the hub attaches while the guest is still paused (``-S``), so the
scrollback holds every byte from the first one. Clients of the shared socket get the scrollback,
then live output; whatever they write goes to the guest. A reader that stops reading is dropped
rather than allowed to stall the guest: QEMU blocks a vCPU when its serial port's chardev cannot
write.

When the guest moves to a new backend process (a capture continues the boot from the snapshot
just taken), the hub holds the clients' input and lets the old process read what it was sent
before the guest pauses, and reads the old process's output to its end: no byte typed or printed
around a capture is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from . import metrics
from .perms import share
from .stream_pipes import StreamPipe

log = logging.getLogger(__name__)

#: chunks a slow client may fall behind before it is disconnected
CLIENT_QUEUE_CHUNKS = 1024
#: bytes a slow client may fall behind before it is disconnected: chunks are up to 64 KiB, so the
#: chunk bound alone would let each client that never reads hold 64 MiB of the runtime's memory
CLIENT_QUEUE_BYTES = 1 << 20
#: clients of one stream at once: each may hold up to CLIENT_QUEUE_BYTES of the runtime's memory, and a
#: lease holder opens one per driver call
MAX_CLIENTS = 64
#: console output waiting for the log's thread (a slow or hung disk): past it, output is not logged
#: (it still reaches the scrollback and every client) and the log says how much was lost
LOG_BACKLOG_BYTES = 4 << 20
#: at most one warning of a kind per this many seconds
WARN_EVERY = 10.0
#: input held while the guest moves to a new backend process (a tty line is 4 KiB; more is dropped)
HELD_INPUT_BYTES = 64 << 10


class RotatingByteLog:
    """Byte log with size rotation (``name``, ``name.1`` … ``name.N``), begun empty: what an earlier
    process or lease wrote is not kept (a lease's console may carry its secrets)."""

    def __init__(self, path: Path, max_bytes: int = 1 << 20, backups: int = 3) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._remove_backups()
        # unbuffered: a write that fails (a full volume) keeps nothing back to fail again at the
        # next flush, or at the close a rotation does
        self._fh = open(path, "wb", buffering=0)  # noqa: SIM115 - lives as long as the hub

    def reset(self) -> None:
        """Empty the log and remove its rotated files (the file replaced by an empty one when it
        cannot be truncated: nothing of it may stay).

        :raise OSError: the empty file cannot be made (the old one is gone all the same)."""
        self._remove_backups()
        try:
            if self._fh.closed:
                raise OSError("the log file is closed")
            self._fh.seek(0)
            self._fh.truncate()
        except OSError:
            self._fh.close()
            self.path.unlink(missing_ok=True)
            self._fh = open(self.path, "wb", buffering=0)  # noqa: SIM115

    def _remove_backups(self) -> None:
        for i in range(1, self.backups + 1):
            self.path.with_name(f"{self.path.name}.{i}").unlink(missing_ok=True)

    def write(self, data: bytes) -> None:
        """Append bytes, rotating first when the file would pass ``max_bytes``.

        :raise OSError: they cannot be written (the next write tries again, on a file reopened if
            a rotation could not make one)."""
        if self._fh.closed:
            self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115
        if self._fh.tell() + len(data) > self.max_bytes:
            self._rotate()
        view = memoryview(data)
        while view:
            view = view[self._fh.write(view) or 0:]

    def _rotate(self) -> None:
        self._fh.close()
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


class _ClientQueue(asyncio.Queue[bytes | None]):
    """One client's backlog, bounded in chunks and in bytes (:meth:`offer` raises ``QueueFull``),
    and its connection."""

    def __init__(self, conn: socket.socket) -> None:
        super().__init__(CLIENT_QUEUE_CHUNKS)
        self.pending = 0
        self.conn = conn
        #: the hub let go of this client (too slow, or a new lease): none of its input goes on
        self.dropped = False

    def offer(self, data: bytes) -> None:
        if self.pending + len(data) > CLIENT_QUEUE_BYTES:
            raise asyncio.QueueFull
        self.put_nowait(data)
        self.pending += len(data)

    def taken(self, data: bytes) -> None:
        self.pending -= len(data)


async def _connect(path: Path, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await asyncio.open_unix_connection(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            if loop.time() > deadline:
                raise TimeoutError(f"console socket {path} did not accept within {timeout} s") from None
            await asyncio.sleep(0.02)


async def _open_pipes(pipe: StreamPipe) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.BaseTransport]:
    """A stream reader on the guest's output pipe, a stream writer on its input pipe, and the
    output's transport (the writer closes only the input)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    with contextlib.ExitStack() as undo:  # closes what no transport owns yet, should a step fail
        output = undo.enter_context(open(pipe.output, "rb", buffering=0))
        input_ = undo.enter_context(open(pipe.input, "wb", buffering=0))
        output_transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), output)
        undo.pop_all()
        undo.callback(input_.close)
        undo.callback(output_transport.close)
        input_transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, input_)
        undo.pop_all()
    return reader, asyncio.StreamWriter(input_transport, protocol, None, loop), output_transport


def _drop(queue: _ClientQueue) -> None:
    """Let go of a client: what it has not read yet is replaced by the end marker, nothing it
    typed is sent on from now on, and its connection is shut (a send it is stalled in fails)."""
    queue.dropped = True
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)
    with contextlib.suppress(OSError):
        queue.conn.shutdown(socket.SHUT_RDWR)


#: the bytes of a console's scrollback a hub keeps (and a snapshot's capture records)
SCROLLBACK = 256 * 1024


class ConsoleHub:
    """Serves one guest stream on a Unix socket with scrollback and several readers."""

    def __init__(
        self,
        name: str,
        listen_path: Path,
        *,
        log_path: Path | None = None,
        scrollback: int = SCROLLBACK,
        replay: bool = True,
    ) -> None:
        self.name = name
        self.listen_path = listen_path
        self.scrollback = scrollback
        #: whether a new client first gets the scrollback (consoles) or only live bytes (CAN, channels)
        self.replay = replay
        self._buffer = bytearray()
        self._log = RotatingByteLog(log_path) if log_path else None
        #: log bytes not yet on disk; one task at a time writes them in a thread, in order
        self._log_pending: list[bytes] = []
        self._log_pending_bytes = 0
        #: output not logged since the log's last write (the backlog was full)
        self._log_dropped = 0
        #: the log is to be emptied before the next write (:meth:`forget_log`)
        self._log_reset = False
        self._log_task: asyncio.Task[None] | None = None
        self._clients: set[_ClientQueue] = set()
        self._watchers: set[Callable[[bytes], None]] = set()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._client_tasks: set[asyncio.Task[None]] = set()
        #: when each kind of warning was last logged (a flood of connections or failed writes is not a
        #: flood of log lines: one every WARN_EVERY seconds)
        self._warned_at: dict[str, float] = {}
        self._dropped_since_warning = 0
        self._upstream: asyncio.StreamWriter | None = None
        #: the output pipe's transport when the backend serves this stream through pipes
        self._upstream_output: asyncio.BaseTransport | None = None
        #: client input waiting for the next backend process (``hold_input``), else None
        self._held: bytearray | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.bytes_seen = 0
        self.first_byte_at: float | None = None

    # ---- the shared-dir side -------------------------------------------------------------
    async def listen(self) -> None:
        """Start serving clients on ``listen_path`` (mode 0660)."""
        self.listen_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.listen_path.unlink()
        # no umask juggling (it is per process: a worker thread's mkdir would lose its x bits); the
        # process umask keeps others from connecting until share() sets 0660 (perms.restrict_umask)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.setblocking(False)
            listener.bind(str(self.listen_path))
            listener.listen(100)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        share(self.listen_path, 0o660)
        self._accepting = asyncio.create_task(self._accept(listener), name=f"accept-{self.name}")

    async def _accept(self, listener: socket.socket) -> None:
        # Plain sockets rather than asyncio's streams: a stream transport whose send fails (the
        # client went away with output unread) stops reading at once, and what the client typed
        # before it went away, still in the socket, was lost. Here input is read to its end.
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of descriptors: the clients that have one go on
                log.warning("console %s: cannot accept a client: %s", self.name, e)
                await asyncio.sleep(0.5)
                continue
            if len(self._client_tasks) >= MAX_CLIENTS:
                self._refuse(conn)
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self._serve_client(conn))
            self._client_tasks.add(task)
            task.add_done_callback(self._client_tasks.discard)

    def _refuse(self, conn: socket.socket) -> None:
        """Tell a connection past the cap why it ends, and end it (a new socket's buffer holds the line)."""
        if self._may_warn("refused"):
            log.warning("console %s: refusing clients: %d are connected, the most it serves", self.name,
                        MAX_CLIENTS)
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(f"\r\nvmsidecar: the {self.name} console serves at most {MAX_CLIENTS} clients at once; "
                      "close one and connect again\r\n".encode())
            conn.shutdown(socket.SHUT_WR)
        conn.close()

    def _may_warn(self, kind: str) -> bool:
        """Whether a warning of ``kind`` may be logged now (then not again for WARN_EVERY seconds)."""
        now = time.monotonic()
        if now - self._warned_at.get(kind, -WARN_EVERY) < WARN_EVERY:
            return False
        self._warned_at[kind] = now
        return True

    async def _serve_client(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        queue = _ClientQueue(conn)
        if self.replay and self._buffer:
            queue.offer(bytes(self._buffer[-CLIENT_QUEUE_BYTES:]))
        self._clients.add(queue)
        pump = asyncio.create_task(self._pump_to_client(queue))
        try:
            while (data := await loop.sock_recv(conn, 4096)) and not queue.dropped:
                if self._held is not None:
                    self._held += data[: max(0, HELD_INPUT_BYTES - len(self._held))]
                elif self._upstream is not None and not self._upstream.is_closing():
                    self._upstream.write(data)
                    await self._upstream.drain()
            # EOF on input is a half-close (`echo cmd | console`): keep sending output until the
            # client goes away, is dropped as too slow, or the scrollback is cleared.
            await pump
        except (ConnectionError, OSError):
            pass
        finally:
            self._clients.discard(queue)
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            conn.close()

    async def _pump_to_client(self, queue: _ClientQueue) -> None:
        """Send the client its output until it goes away or is dropped. A failed send ends only
        this: what the client typed before it went away is still read (``_serve_client``)."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError, OSError):
            while (chunk := await queue.get()) is not None:
                queue.taken(chunk)
                await loop.sock_sendall(queue.conn, chunk)

    # ---- the guest side ------------------------------------------------------------------
    async def attach(self, upstream: Path | StreamPipe | socket.socket, *, timeout: float = 10.0) -> None:
        """Start draining the backend's end of this stream: its socket (connected, retried until
        ``timeout``), a connection to it (held since the backend started), or the runtime's ends
        of its pipes (those two closed by this hub from now on).

        :raise TimeoutError: when the socket does not accept within ``timeout``.
        """
        await self.detach()
        if isinstance(upstream, StreamPipe):
            reader, writer, self._upstream_output = await _open_pipes(upstream)
        elif isinstance(upstream, socket.socket):
            reader, writer = await asyncio.open_unix_connection(sock=upstream)
        else:
            reader, writer = await _connect(upstream, timeout)
        self._upstream = writer
        self._drain_task = asyncio.create_task(self._drain(reader), name=f"drain-{self.name}")

    async def _drain(self, reader: asyncio.StreamReader) -> None:
        try:
            while data := await reader.read(65536):
                self._feed(data)
        except (ConnectionError, OSError):
            pass

    def _feed(self, data: bytes) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = asyncio.get_running_loop().time()
        self.bytes_seen += len(data)
        metrics.console_bytes.inc(len(data))
        self._buffer += data
        if len(self._buffer) > self.scrollback:
            del self._buffer[: len(self._buffer) - self.scrollback]
        if self._log:
            if self._log_pending_bytes + len(data) > LOG_BACKLOG_BYTES:
                if not self._log_dropped:
                    log.warning("console %s: the log's disk is too slow; output is not logged until it "
                                "catches up", self.name)
                self._log_dropped += len(data)
            else:
                self._log_pending.append(data)
                self._log_pending_bytes += len(data)
            self._start_log_task()
        for watcher in list(self._watchers):
            watcher(data)
        for queue in list(self._clients):
            try:
                queue.offer(data)
            except asyncio.QueueFull:
                # (a lease holder opening streams it never reads would make one line each)
                self._dropped_since_warning += 1
                if self._may_warn("dropped"):
                    log.warning("console %s: dropping a client that stopped reading (%d dropped since this "
                                "line was last logged, once in %.0f s at most)", self.name,
                                self._dropped_since_warning, WARN_EVERY)
                    self._dropped_since_warning = 0
                metrics.console_dropped_readers.inc()
                self._clients.discard(queue)
                _drop(queue)

    def forget_log(self) -> None:
        """Empty the log file (a new lease): what is not written yet is dropped, and the file is
        emptied in the writing task, after any write already under way."""
        if self._log:
            self._log_pending, self._log_pending_bytes, self._log_dropped = [], 0, 0
            self._log_reset = True
            self._start_log_task()

    def _start_log_task(self) -> None:
        if self._log_task is None or self._log_task.done():
            self._log_task = asyncio.create_task(self._write_log(), name=f"log-{self.name}")

    async def _write_log(self) -> None:
        """File writes (and rotation) happen in a thread: a slow disk must not stall the drain."""
        assert self._log is not None
        while self._log_pending or self._log_reset or self._log_dropped:
            try:
                if self._log_reset:
                    self._log_reset = False
                    await asyncio.to_thread(self._log.reset)
                    continue
                batch, self._log_pending, self._log_pending_bytes = b"".join(self._log_pending), [], 0
                if self._log_dropped:
                    batch += (f"\r\n[vmsidecar: {self._log_dropped} bytes of console output not logged: the "
                              "log's disk was too slow]\r\n").encode()
                    self._log_dropped = 0
                await asyncio.to_thread(self._log.write, batch)
            except OSError as e:  # a full disk loses log lines, never console output
                if self._may_warn("log"):
                    log.warning("console %s: cannot write the log (%s)", self.name, e)

    def hold_input(self) -> None:
        """From now on client input waits in the hub, for the backend process that comes next."""
        if self._held is None:
            self._held = bytearray()

    async def input_consumed(self, timeout: float) -> bool:
        """Wait until the backend has read all input sent to it; False if it has not within ``timeout``
        (a guest that does not read its console)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._unread_input():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.01)  # the kernel tells no one when a peer reads: poll
        return True

    def _unread_input(self) -> int:
        """Bytes sent to the backend that it has not read: our buffer, then the socket's send queue
        or the pipe's content."""
        writer = self._upstream
        if writer is None or writer.is_closing():
            return 0
        unread = writer.transport.get_write_buffer_size()
        sock, pipe = writer.get_extra_info("socket"), writer.get_extra_info("pipe")
        if sock is not None:  # a Unix stream socket's send queue holds what the peer has not read
            unread += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        elif pipe is not None:
            unread += struct.unpack("i", fcntl.ioctl(pipe.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        return unread

    async def output_read(self, timeout: float) -> bool:
        """Wait until this hub has fed everything the backend wrote so far (the guest is paused);
        False if output still arrives after ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._unread_output():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.005)
        for _ in range(2):  # the transport has read it; the drain task feeds it on the next turns
            await asyncio.sleep(0)
        return True

    def _unread_output(self) -> int:
        """Bytes the backend wrote that the runtime has not read: in the socket's receive queue or
        the pipe."""
        if self._drain_task is None or self._drain_task.done():
            return 0
        if self._upstream_output is not None:
            stream = self._upstream_output.get_extra_info("pipe")
        else:
            stream = self._upstream.get_extra_info("socket") if self._upstream is not None else None
        if stream is None:
            return 0
        try:
            return int(struct.unpack("i", fcntl.ioctl(stream.fileno(), termios.FIONREAD, b"\0" * 4))[0])
        except (OSError, ValueError):  # closed meanwhile
            return 0

    def release_input(self) -> None:
        """Send the held input to the backend (dropped if none is attached: a new boot)."""
        held, self._held = self._held, None
        if held and self._upstream is not None and not self._upstream.is_closing():
            self._upstream.write(bytes(held))

    async def detach(self, read_to_end: float = 0.0) -> None:
        """Stop draining; clients stay connected. With ``read_to_end`` (the backend has exited), first
        read what it wrote before it went, for up to that many seconds."""
        if self._drain_task is not None:
            if read_to_end:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._drain_task), read_to_end)
            self._drain_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain_task
            self._drain_task = None
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
        if self._upstream_output is not None:
            self._upstream_output.close()
            self._upstream_output = None

    # ---- scrollback and watchers ---------------------------------------------------------
    def tail(self, nbytes: int = 2048) -> str:
        """The last bytes of scrollback as text (for error messages and state)."""
        return bytes(self._buffer[-nbytes:]).decode(errors="replace")

    def new_boot(self) -> None:
        """Start the scrollback of a new boot: a client that connects from now on never gets an
        earlier boot's output. Connected clients stay (like a serial cable across a power cycle)."""
        self._buffer.clear()
        self._held = None  # input typed for an earlier boot never reaches this one
        self.bytes_seen = 0
        self.first_byte_at = None

    def boot_output(self) -> bytes:
        """This boot's scrollback (what a new reader gets first)."""
        return bytes(self._buffer)

    def preload(self, data: bytes) -> None:
        """Start a boot's scrollback with ``data`` (a restored guest's pristine boot output)."""
        self._buffer[:] = data[-self.scrollback:]

    def clear(self, *, disconnect_clients: bool = False) -> None:
        """Forget the scrollback; with ``disconnect_clients`` also drop every client (a new lease
        must not see the previous one's output, not even what a slow client has not read yet)."""
        self.new_boot()
        if disconnect_clients:
            for queue in list(self._clients):
                self._clients.discard(queue)
                _drop(queue)

    @contextlib.contextmanager
    def watch(self, callback: Callable[[bytes], None]) -> Iterator[None]:
        """Call ``callback`` with every new chunk while the context is open."""
        self._watchers.add(callback)
        try:
            yield
        finally:
            self._watchers.discard(callback)

    async def close(self) -> None:
        """Stop everything and remove the shared socket."""
        await self.detach()
        self.clear(disconnect_clients=True)
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for task in list(self._client_tasks):  # each ends once its dropped client's pump has
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), 2)
        with contextlib.suppress(FileNotFoundError):
            self.listen_path.unlink()
        if self._log_task is not None:
            await self._log_task
        if self._log:
            self._log.close()
