"""Pipes, not sockets, between QEMU and the runtime for the guest's virtio console ports.

QEMU drops what a guest writes on a virtio *console* port (``hvc0``, the SLCAN buses) whenever the
port's chardev cannot take it: hw/char/virtio-console.c ``flush_buf`` throttles only
``virtserialport`` ports and says so ("silently dropping console data on EAGAIN"). Behind a Unix
socket that happens after ~200 writes: the socket's send buffer (208 KiB by default,
``net.core.wmem_default``) counts each small write with ~1 KiB of overhead, and a guest writes one
SLCAN frame at a time. That is 0.1 s of a saturated 250 kbit/s bus; a runtime that got no CPU for
longer on a busy node lost frames (a CI run: 58 of 1,000).

A pipe packs small writes into its pages: its default 64 KiB holds ~800 lines of console text,
and the runtime sizes a bus's to 1 MiB (``fs.pipe-max-size``, no privilege needed): ~40,000 SLCAN
frames, 20 s of that bus. (The default for the console: pipe buffers count against a per-user
quota, ``fs.pipe-user-pages-soft``, 64 MiB, shared by every runtime of that UID on the node.) QEMU's ``pipe`` chardev opens
``<path>.in`` and ``<path>.out``; the runtime makes both symlinks to ``/proc/self/fd/N`` of pipes
that QEMU inherits, so each QEMU process has pipes of its own (nothing one process was sent can
reach the next, a new lease's), and the runtime reads the end of the output when QEMU exits.

The libvirt backend's QEMU is libvirtd's child, not the runtime's: it gets named pipes instead
(``ConsoleFifos``), made for each boot in the runtime's private run directory, and used only
where that QEMU runs under the runtime's UID (the private daemon).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .procs import inherited_path

log = logging.getLogger(__name__)

#: the size asked for a CAN bus's output pipe: the default fs.pipe-max-size, the most an
#: unprivileged process may set
BUS_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def pipe_paths(base: Path) -> tuple[Path, Path]:
    """What QEMU's pipe chardev with ``path=base`` opens: the guest's input, then its output."""
    return base.with_name(base.name + ".in"), base.with_name(base.name + ".out")


@dataclass(frozen=True)
class StreamPipe:
    """The runtime's ends of one stream's pipes (QEMU holds the other ends); whoever takes them
    closes them."""

    #: read: what the guest wrote
    output: int
    #: write: what the guest reads
    input: int


class StreamPipes:
    """One QEMU process's pipes, by stream name; ``base(name)`` is the ``path=`` of the stream's pipe
    chardev (QEMU appends ``.in`` and ``.out``); ``output_bytes[name]``: the size of the pipe the
    guest writes into, None for the kernel's default."""

    def __init__(self, base: Callable[[str], Path], output_bytes: dict[str, int | None]) -> None:
        self.base = base
        self._names = list(output_bytes)
        self._mine: dict[str, StreamPipe] = {}
        self._qemus: list[int] = []
        try:
            for name, size in output_bytes.items():
                self._open(name, size)
        except OSError:
            self.close()
            raise

    def _open(self, name: str, size: int | None) -> None:
        qemu_reads, runtime_writes = os.pipe()
        self._qemus.append(qemu_reads)
        runtime_reads, qemu_writes = os.pipe()
        self._qemus.append(qemu_writes)
        self._mine[name] = StreamPipe(output=runtime_reads, input=runtime_writes)
        try:
            if size is not None:
                fcntl.fcntl(runtime_reads, _F_SETPIPE_SZ, size)
        except OSError as e:  # a lower fs.pipe-max-size, or the user's pipe quota spent
            log.warning("stream %s: its pipe keeps the kernel's size, not %d bytes (%s; fs.pipe-max-size, "
                        "fs.pipe-user-pages-soft): what the guest writes beyond it while the runtime gets no "
                        "CPU is lost", name, size, e)
        for link, fd in zip(self._links(name), (qemu_reads, qemu_writes), strict=True):
            link.unlink(missing_ok=True)
            link.symlink_to(inherited_path(fd))

    def _links(self, name: str) -> tuple[Path, Path]:
        return pipe_paths(self.base(name))

    @property
    def qemu_fds(self) -> tuple[int, ...]:
        """The descriptors QEMU must inherit (``pass_fds``)."""
        return tuple(self._qemus)

    def close_qemu_ends(self) -> None:
        """QEMU has inherited its ends: drop ours of them, so the runtime reads EOF when QEMU is gone."""
        for fd in self._qemus:
            os.close(fd)
        self._qemus = []

    def remove_links(self) -> None:
        """Remove the symlinks (they serve only while QEMU opens its chardevs)."""
        for name in self._names:
            for link in self._links(name):
                link.unlink(missing_ok=True)

    def take(self, name: str) -> StreamPipe | None:
        """The runtime's ends of stream ``name`` (the caller closes them), or None if not piped."""
        return self._mine.pop(name, None)

    def close(self) -> None:
        """Close every end not taken, and the symlinks."""
        self.remove_links()
        self.close_qemu_ends()
        for pipe in self._mine.values():
            for fd in (pipe.output, pipe.input):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._mine.clear()


class ConsoleFifos:
    """Named pipes ``<base>.in`` and ``<base>.out`` (mode 0600) for a QEMU this process does not
    spawn; made fresh for each boot, opened once QEMU holds them (it opens both read-write, so
    neither open blocks), removed with ``remove``."""

    def __init__(self, base: Path) -> None:
        self.input, self.output = pipe_paths(base)
        self.remove()  # an earlier boot's: that QEMU may still hold them
        try:
            os.mkfifo(self.input, 0o600)
            os.mkfifo(self.output, 0o600)
        except OSError:
            self.remove()
            raise

    def open(self) -> StreamPipe:
        """The runtime's ends; the caller closes them. Reading ``output`` ends when QEMU exits.

        :raise OSError: ENXIO when no QEMU holds ``input`` open.
        """
        output = os.open(self.output, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            return StreamPipe(output=output, input=os.open(self.input, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError:
            os.close(output)
            raise

    def remove(self) -> None:
        for path in (self.input, self.output):
            path.unlink(missing_ok=True)
