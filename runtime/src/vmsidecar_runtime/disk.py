"""Guest disks: read-only bases, per-boot qcow2 overlays, and flashing a new base safely.

A flashed image is streamed into a temp file, decompressed on the fly, verified (length, digest)
and checked, and only then renamed into place. Until that rename nothing changes: a truncated,
garbage or unsafe stream leaves the previous disk as it was. Sniffing, decompression, size
limits and the image checks are :mod:`vmsidecar_runtime.image`, the same code a pull
goes through; this module adds what is flash's own (the async stream, length and digest).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vmsidecar_contract.errors import DigestMismatchError, HostError, ImageError

from . import confinement
from .image import checks  # a module: this one has its own async check_image
from .image.decompress import ChunkStream, open_decompressed
from .image.limits import DEFAULT_LIMITS, Limits, Origin
from .image.sniff import DiskFormat
from .image.write import write_disk
from .procs import spawn
from .threads import run_abortable

#: how messages about a flashed image name it and end their fix
FLASHED = Origin("the flashed image", "flash the result")


@dataclass(frozen=True)
class DiskImage:
    """A read-only base disk the VM can boot from."""

    path: Path
    format: str  # "qcow2" | "raw"
    digest: str  # "sha256:…" of the uncompressed content
    source: str  # the reference or "flash"
    #: the image's ``io.vmsidecar.*`` annotations (readiness); none for files and flashed streams
    annotations: Mapping[str, str] = field(default_factory=dict, compare=False)
    #: the OCI manifest the disk came from (what a snapshot artifact's ``subject`` names); none for
    #: files and flashed streams
    manifest_digest: str | None = field(default=None, compare=False)


class NoSpace(HostError):
    """The volume had no room for a file the runtime makes."""


def chain_over(backing: DiskImage) -> tuple[Path, ...]:
    """The files an overlay made over ``backing`` stands on: ``backing`` and its own backing chain
    (a cache image's or a frozen overlay's, whose headers no QEMU writes)."""
    return (backing.path, *checks.backing_chain(backing.path))


async def run_tool(*argv: str, read: tuple[Path, ...] = (), write: tuple[Path, ...] = ()) -> tuple[int, str, str]:
    """Run qemu-img (list exec) in a Landlock domain that opens only the files ``read`` (read-only)
    and ``write`` (``confinement.tool_rules``) and return (rc, stdout, stderr). A caller that gives
    up (cancelled) takes the program down with it: killed and reaped before the cancellation goes
    on, so nothing keeps writing a file the runtime abandoned.

    :raise HostError: when the program is not installed.
    """
    try:
        with confinement.domain(confinement.tool_rules(argv[0], read=read, write=write)) as ruleset:
            proc = await spawn(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                               stderr=asyncio.subprocess.PIPE, confine=ruleset)
    except FileNotFoundError:
        raise HostError(f"{argv[0]} is not installed; install qemu-utils") from None
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.communicate()  # to its end: the pipes close and the child is reaped
        raise
    await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def check_image(path: Path, fmt: str, label: str | None = None, *, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse an image QEMU must not boot (see :func:`vmsidecar_runtime.image.checks.check_image`).

    :raise ImageError: naming what is wrong (empty, corrupt, backing or data file, too large) and
        what to do.
    :raise HostError: when qemu-img is not installed.
    """
    origin = Origin(label or f"disk image {path.name}", "use the result")
    # a thread of its own, and a caller that gives up kills qemu-img (threads.run_abortable): the
    # loop's pool must not wait on qemu-img reading a lease holder's image to its own deadline
    await run_abortable(checks.check_image, path, fmt, origin, limits, name="image-check")


async def create_overlay(base: DiskImage, overlay: Path, *, size: int | None = None) -> None:
    """Create a fresh qcow2 overlay over ``base`` (the base is only ever read).

    ``size``: the base's virtual size, given when qemu-img must not open the base (a disk QEMU
    holds open and locked; qemu-img's ``-u``).

    :raise HostError: when qemu-img fails (disk full, permissions).
    """
    with contextlib.suppress(FileNotFoundError):
        overlay.unlink()
    unchecked = ["-u", str(overlay), str(size)] if size is not None else [str(overlay)]
    # made here, empty, so that qemu-img needs no right to make files in the state directory
    os.close(os.open(overlay, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
    rc, _, err = await run_tool(
        "qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base.path), "-F", base.format, *unchecked,
        read=chain_over(base), write=(overlay,),
    )
    if rc != 0:
        overlay.unlink(missing_ok=True)
        error = NoSpace if os.strerror(errno.ENOSPC) in err else HostError
        raise error(f"cannot create the disk overlay {overlay} ({err.strip()}); free space or fix permissions")


@dataclass(frozen=True)
class ReceivedImage:
    """A verified image in a temp file, ready to be renamed into place."""

    path: Path
    format: str
    digest: str
    size: int
    compression: str | None


class _AsyncChunks(ChunkStream):
    """A blocking reader over an async byte stream, for the worker thread that writes the image.

    The image pipeline (:mod:`.image`) reads; the request body arrives on the event
    loop. Each read that needs data runs one ``__anext__`` on that loop and waits for it, so
    memory stays bounded by one chunk and the loop is never blocked. After :meth:`abandon`
    (the flash was cancelled) reads fail and the worker unwinds.
    """

    def __init__(self, chunks: AsyncIterable[bytes], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._chunks: AsyncIterator[bytes] = aiter(chunks)
        self._loop = loop
        self._pending = memoryview(b"")
        self._waiting: concurrent.futures.Future[bytes | None] | None = None
        self._abandoned = False
        self.count = 0


    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes; a whole chunk is handed on as it is (no copy)."""
        if size is None or size < 0:
            return self.readall()
        while not self._pending:
            chunk = self._next()
            if chunk is None:
                return b""
            if not chunk:
                continue  # an empty chunk is not the end of the stream
            self.count += len(chunk)
            self._pending = memoryview(chunk)
            if len(chunk) <= size:
                self._pending = memoryview(b"")
                return chunk
        data = bytes(self._pending[:size])
        self._pending = self._pending[size:]
        return data

    def _next(self) -> bytes | None:
        if self._abandoned:
            raise _cancelled()
        self._waiting = asyncio.run_coroutine_threadsafe(_next_chunk(self._chunks), self._loop)
        try:
            return self._waiting.result()
        except concurrent.futures.CancelledError:
            raise _cancelled() from None
        except OSError as e:  # aiohttp sets ConnectionResetError on the body when the sender goes away
            raise ImageError(
                f"the image stream was cut off after {self.count} bytes (the sender disconnected); the previous "
                "disk is kept; flash again"
            ) from e

    def abandon(self) -> None:
        """Make the worker stop at its next read (call on the event loop)."""
        self._abandoned = True
        if self._waiting is not None:
            self._waiting.cancel()


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


def _cancelled() -> ImageError:
    return ImageError("the flash was cancelled before the image was complete; the previous disk is kept; flash again")


async def receive_image(
    chunks: AsyncIterable[bytes],
    dest_dir: Path,
    *,
    expected_size: int | None = None,
    expected_digest: str | None = None,
    format_hint: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> ReceivedImage:
    """Stream an image into ``dest_dir``, decompressing, hashing, verifying and checking it.

    ``expected_size`` is the length of the stream as sent (e.g. Content-Length); ``expected_digest``
    the sha256 of the uncompressed image. The work runs in a thread (decompression and qemu-img
    would otherwise stall the event loop); the stream is still read on the loop.

    :raise ImageError: for a truncated, garbage, corrupt, unsafe (backing or data file), too large
        or mismatching image (nothing is kept).
    :raise HostError: when the disk is full or qemu-img is missing.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir / f".incoming-{os.getpid()}-{secrets.token_hex(6)}"
    source = _AsyncChunks(chunks, asyncio.get_running_loop())
    try:
        return await asyncio.to_thread(
            _receive, source, tmp, expected_size, expected_digest, format_hint, limits  # type: ignore[arg-type]
        )
    except BaseException:
        source.abandon()  # cancelled: the worker is still running; it stops and cleans up at its next read
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _receive(
    source: _AsyncChunks,
    tmp: Path,
    expected_size: int | None,
    expected_digest: str | None,
    format_hint: DiskFormat | None,
    limits: Limits,
) -> ReceivedImage:
    """The blocking part of :func:`receive_image` (worker thread); removes ``tmp`` on any error."""
    try:
        compression, stream = open_decompressed(source, "auto", FLASHED, limits)
        disk = write_disk(stream, tmp, declared=format_hint, origin=FLASHED, limits=limits)
        if expected_size is not None and source.count != expected_size:
            raise ImageError(
                f"the image stream was truncated ({source.count} of {expected_size} bytes arrived); "
                "flash again and check the source"
            )
        if expected_digest and expected_digest != disk.digest:
            raise DigestMismatchError(
                f"the flashed image has digest {disk.digest} but {expected_digest} was expected; "
                "the data was corrupted on the way or the digest is wrong"
            )
        checks.check_image(tmp, disk.format, FLASHED, limits)
        return ReceivedImage(tmp, disk.format, disk.digest, disk.size, compression)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise HostError(f"no space left in {tmp.parent} while flashing; free space or use a larger volume") from e
        raise


def install_image(received: ReceivedImage, dest_dir: Path) -> DiskImage:
    """Make a received image a read-only base: rename it to its digest name, mode 0444."""
    final = dest_dir / f"{received.digest.replace(':', '-')}.{received.format}"
    os.chmod(received.path, 0o444)
    os.replace(received.path, final)
    return DiskImage(final, received.format, received.digest, "flash")
