"""Stream a blob through digest verification and decompression into one disk file.

One pass: the blob bytes are hashed and counted as they arrive, decompressed on the fly, and
the disk bytes hashed as they are written to a temporary file. Nothing written here is visible
to anyone until :mod:`.cache` moves it into place, which happens only after every check passed.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import struct
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import zstandard

from vmsidecar_runtime.errors import DigestMismatchError, HostError, ImageError

from .mediatypes import (
    DISK_SUFFIXES,
    Compression,
    DiskFormat,
    sniff_compression,
    sniff_format,
    title_format,
)

CHUNK = 1 << 20
Progress = Callable[[int, int | None], None]


class BlobReader(io.RawIOBase):
    """A read-only file over an iterator of chunks that hashes and counts what passes through.

    It refuses to read past ``size`` bytes (when known), so a lying server cannot fill the disk.
    """

    def __init__(
        self,
        chunks: Iterable[bytes],
        *,
        digest: str | None,
        size: int | None,
        where: str,
        progress: Progress | None = None,
    ) -> None:
        super().__init__()
        self._chunks: Iterator[bytes] = iter(chunks)
        self._pending = memoryview(b"")
        self._hash = hashlib.sha256()
        self.expected_digest = digest
        self.expected_size = size
        self.where = where
        self.count = 0
        self._progress = progress
        self._head = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._take(chunk)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _take(self, chunk: bytes) -> None:
        self.count += len(chunk)
        if self.expected_size is not None and self.count > self.expected_size:
            raise DigestMismatchError(
                f"{self.where} sent more than the {self.expected_size} bytes its descriptor names; "
                "the content was altered or the manifest is wrong, so push the image again"
            )
        self._hash.update(chunk)
        if len(self._head) < 16:
            self._head += chunk[:16]
        self._pending = memoryview(chunk)
        if self._progress is not None:
            self._progress(self.count, self.expected_size)

    def peek_head(self, n: int) -> bytes:
        """The first ``n`` bytes of the blob without consuming them (``n`` ≤ 16)."""
        while len(self._head) < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            rest = bytes(self._pending)
            self._take(chunk)
            self._pending = memoryview(rest + chunk)
        return self._head[:n]

    def drain(self) -> None:
        """Read (and hash) whatever is left of the blob."""
        self._pending = memoryview(b"")
        for chunk in self._chunks:
            self._take(chunk)
            self._pending = memoryview(b"")

    @property
    def digest(self) -> str:
        """``sha256:HEX`` of every byte read so far."""
        return "sha256:" + self._hash.hexdigest()

    def verify(self) -> None:
        """Check size and digest of the whole blob (call after :meth:`drain`).

        :raise DigestMismatchError: when the bytes are not the ones the descriptor names.
        """
        if self.expected_size is not None and self.count != self.expected_size:
            raise DigestMismatchError(
                f"{self.where} is {self.count} bytes but its descriptor says {self.expected_size}; "
                "the content was truncated or altered, so push the image again"
            )
        if self.expected_digest is not None and self.digest != self.expected_digest:
            raise DigestMismatchError(
                f"{self.where} has digest {self.digest} but its descriptor names {self.expected_digest}; "
                "the content was altered in storage or in transit, so push the image again"
            )


@dataclass(frozen=True)
class UnpackedDisk:
    """A verified disk in a temporary file."""

    path: Path
    format: DiskFormat
    digest: str
    size: int


def decompressing_reader(raw: BinaryIO, compression: Compression | None) -> BinaryIO:
    """Wrap ``raw`` so that reads return decompressed bytes."""
    if compression == "zstd":
        dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        return dctx.stream_reader(raw, read_across_frames=True, closefd=False)  # type: ignore[return-value]
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if compression == "xz":
        return lzma.LZMAFile(raw)  # type: ignore[return-value]
    return raw


def unpack_blob(
    reader: BlobReader,
    out: Path,
    *,
    kind: str,
    compression: Compression | str | None,
    format_hint: DiskFormat | None,
    title: str | None = None,
) -> UnpackedDisk:
    """Decompress (and for ``tar`` layers, extract) the disk from ``reader`` into ``out``.

    The blob is always read to its end and verified, even after a decompression error, so that
    a tampered blob is reported as a digest mismatch rather than as garbage.

    :raise DigestMismatchError: the blob is not what its descriptor names.
    :raise ImageError: the blob is not valid compressed data (``bad_compression``), a tar layer
        has no disk or several (``no_disk``/``several_disks``), or the disk is unsafe
        (``unsafe_disk``).
    """
    if compression == "auto":
        compression = sniff_compression(reader.peek_head(8))
    fmt_from_name = format_hint
    try:
        stream = decompressing_reader(reader, compression)  # type: ignore[arg-type]
        if kind == "tar":
            found = _extract_tar(stream, out, reader.where)
            if found is None:
                reader.drain()
                reader.verify()
                raise ImageError(
                    f"{reader.where} is a containerDisk layer with no .qcow2, .raw or .img file under "
                    "/disk; build the image with the disk at /disk/<name>.qcow2",
                    code="no_disk",
                )
            name, digest, size = found
            fmt_from_name = fmt_from_name or title_format(name)[0]
        else:
            digest, size = _copy(stream, out)
            if title and not fmt_from_name:
                fmt_from_name = title_format(title)[0]
        reader.drain()
    except (DigestMismatchError, HostError):
        raise
    except ImageError:
        # the content looked wrong: make sure it is the content the digest names before saying so
        _drain_quietly(reader)
        reader.verify()
        raise
    except (OSError, EOFError, zstandard.ZstdError, lzma.LZMAError, tarfile.TarError) as exc:
        _drain_quietly(reader)
        reader.verify()
        raise ImageError(
            f"{reader.where} could not be decompressed ({compression or 'uncompressed'}: {exc}); "
            "the layer's media type does not match its bytes, so push the image again",
            code="bad_compression",
        ) from exc
    reader.verify()
    fmt = check_disk(out, fmt_from_name, reader.where)
    return UnpackedDisk(path=out, format=fmt, digest=digest, size=size)


def _drain_quietly(reader: BlobReader) -> None:
    try:
        reader.drain()
    except DigestMismatchError:
        raise
    except Exception:  # the stream itself broke; verify() reports the short read
        pass


def _copy(stream: BinaryIO, out: Path) -> tuple[str, int]:
    hasher = hashlib.sha256()
    size = 0
    try:
        f = open(out, "xb")  # noqa: SIM115 - the write errors below need their own message
    except OSError as exc:
        raise _write_error(out, exc) from exc
    with f:
        while True:
            chunk = stream.read(CHUNK)
            if not chunk:
                break
            hasher.update(chunk)
            try:
                f.write(chunk)
            except OSError as exc:
                raise _write_error(out, exc) from exc
            size += len(chunk)
    return "sha256:" + hasher.hexdigest(), size


def _write_error(path: Path, exc: OSError) -> HostError:
    return HostError(
        f"cannot write {path} ({exc.strerror or exc}); free space in the cache directory or point the "
        "cache somewhere larger",
        code="cache_write_failed",
    )


def _extract_tar(stream: BinaryIO, out: Path, where: str) -> tuple[str, str, int] | None:
    """Copy the one disk file under ``disk/`` of a tar stream to ``out``; ``None`` if there is none."""
    found: tuple[str, str, int] | None = None
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            name = disk_member_name(member.name, where)
            if name is None:
                continue
            if not member.isreg():
                raise ImageError(
                    f"{where} has /disk/{name} as a link or special file, not a regular file; "
                    "copy the disk itself into /disk when building the image",
                    code="unsafe_disk",
                )
            if found is not None:
                raise ImageError(
                    f"{where} has several disk files under /disk ({found[0]}, {name}); "
                    "keep exactly one .qcow2, .raw or .img file there",
                    code="several_disks",
                )
            src = tar.extractfile(member)
            assert src is not None  # a regular file always has content
            digest, size = _copy(src, out)
            found = (name, digest, size)
        # tarfile stops at the end-of-archive marker; the rest (padding) is drained by the caller
    return found


def disk_member_name(member: str, where: str) -> str | None:
    """The file name when a tar member is a disk under ``disk/`` (or ``/disk/``), else ``None``.

    :raise ImageError: (code ``unsafe_path``) for a member under ``disk/`` that climbs out with ``..``.
    """
    parts = [p for p in PurePosixPath(member.lstrip("/")).parts if p != "."]
    if len(parts) < 2 or parts[0] != "disk":
        return None
    if ".." in parts or len(parts) != 2:
        if ".." in parts:
            raise ImageError(
                f"{where} has the tar entry {member!r}, which climbs out of /disk; "
                "rebuild the image with the disk at /disk/<name>.qcow2",
                code="unsafe_path",
            )
        return None
    name = parts[1]
    if name.startswith(".wh.") or not any(name.lower().endswith(s) for s in DISK_SUFFIXES):
        return None
    return name


def check_disk(path: Path, declared: DiskFormat | None, where: str) -> DiskFormat:
    """Decide the disk format from its first bytes and refuse unsafe qcow2 images.

    A disk declared raw stays raw; a disk declared qcow2 must carry the qcow2 magic. A qcow2
    disk must not name a backing file or an external data file (either would make QEMU open
    a host path chosen by the image author).

    :raise ImageError: (code ``bad_disk``) for a format mismatch; (code ``unsafe_disk``) for a
        qcow2 backing or data file.
    """
    with open(path, "rb") as f:
        head = f.read(104)
    sniffed = sniff_format(head)
    if declared == "qcow2" and sniffed != "qcow2":
        raise ImageError(
            f"{where} is declared qcow2 but does not start with the qcow2 magic; push it again with "
            "the raw media type or convert it with qemu-img convert -O qcow2",
            code="bad_disk",
        )
    fmt: DiskFormat = declared or sniffed
    if fmt == "qcow2":
        check_qcow2_header(head, where)
    return fmt


def check_qcow2_header(head: bytes, where: str) -> None:
    """Refuse qcow2 headers naming a backing file or an external data file.

    :raise ImageError: (code ``unsafe_disk``) when the image depends on another host file.
    """
    if len(head) < 20:
        raise ImageError(f"{where} is too short to be a qcow2 image; push a complete disk", code="bad_disk")
    version, backing_offset = struct.unpack(">IQ", head[4:16])
    if backing_offset != 0:
        raise ImageError(
            f"{where} is a qcow2 overlay that names a backing file; flatten it with "
            "qemu-img convert -O qcow2 and push the result",
            code="unsafe_disk",
        )
    if version >= 3 and len(head) >= 80:
        (incompatible,) = struct.unpack(">Q", head[72:80])
        if incompatible & 0x4:
            raise ImageError(
                f"{where} is a qcow2 image with an external data file; convert it with "
                "qemu-img convert -O qcow2 and push the result",
                code="unsafe_disk",
            )
