"""Streaming decompression of guest disks: zstd, gzip or xz, with bounded memory.

:func:`open_decompressed` takes the declared compression or sniffs zstd/gzip/xz from the first
bytes and returns a reader of the decompressed bytes. Memory stays bounded whatever the
compression ratio, a truncated stream is an error (zstandard alone would end silently), and more
than ``max_disk_bytes`` stops it. The readers are blocking (flash bridges its async stream into
a worker thread).
"""

from __future__ import annotations

import gzip
import io
import lzma
import zlib
from typing import BinaryIO, Literal

import zstandard

from vmsidecar_contract.errors import ImageError, VmsidecarError

from .limits import DEFAULT_LIMITS, KIB, Limits, Origin, human_size
from .sniff import Compression, read_at_least, sniff_compression

CHUNK = 1 << 20
#: zstd expands at most ~32768x (a 4-byte RLE block is 128 KiB), so 1 KiB in is ≤ 32 MiB out
_ZSTD_SLICE = 1 * KIB
#: ``zstd --long=31`` frames need a 2 GiB window; zstandard's default limit is 128 MiB
_ZSTD_MAX_WINDOW = 1 << 31


class ChunkStream(io.RawIOBase):
    """A raw stream whose subclasses implement ``read`` (handing on whole chunks without a copy);
    ``readinto``, which the io machinery calls, goes through it."""

    def readable(self) -> bool:
        """Always: these streams are read-only."""
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        """Fill ``buffer`` from ``read``."""
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _Prefixed(io.RawIOBase):
    """``head`` (already read to sniff it) followed by the rest of ``rest``."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        super().__init__()
        self._head = memoryview(head)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _ZstdReader(io.RawIOBase):
    """zstd frames one after another, with bounded memory; a frame cut off is an error.

    zstandard's ``stream_reader`` ends silently on a truncated frame and ``decompressobj`` has no
    output bound, so this feeds ``decompressobj`` slices small enough that no slice can expand
    past ~32 MiB, and watches for the end of each frame.
    """

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
        self._frame = self._dctx.decompressobj()
        self._input = memoryview(b"")
        self._output = memoryview(b"")
        self._in_frame = False  # bytes went into the current frame and it has not ended yet
        self._raw_done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while not self._output:
            if not self._input:
                if self._raw_done:
                    if self._in_frame:
                        raise EOFError("the stream ended in the middle of a frame (truncated)")
                    return 0
                self._input = memoryview(self._raw.read(CHUNK))
                self._raw_done = not self._input
                continue
            piece, self._input = self._input[:_ZSTD_SLICE], self._input[_ZSTD_SLICE:]
            self._in_frame = True
            self._output = memoryview(self._frame.decompress(piece))
            if self._frame.eof:  # the next frame (if any) starts in what this one left over
                self._input = memoryview(bytes(self._frame.unused_data) + bytes(self._input))
                self._frame = self._dctx.decompressobj()
                self._in_frame = False
        n = min(len(buffer), len(self._output))
        buffer[:n] = self._output[:n]
        self._output = self._output[n:]
        return n


class _Decoded(ChunkStream):
    """The decompressed stream: counts it against the limit and turns decoder errors into ImageError."""

    def __init__(self, inner: BinaryIO, compression: Compression | None, origin: Origin, limits: Limits) -> None:
        super().__init__()
        self._inner = inner
        self.compression = compression
        self._origin = origin
        self._limits = limits
        self.count = 0


    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` decompressed bytes (overridden to hand them on without another copy)."""
        if size is None or size < 0:
            return self.readall()
        try:
            data = self._inner.read(size)
        except VmsidecarError:
            raise  # the source's own verdict (digest mismatch, a cut-off upload) stands
        except (OSError, EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError) as exc:
            raise self._unreadable(exc) from exc
        self.count += len(data)
        if self.count > self._limits.max_disk_bytes:
            once = " once decompressed" if self.compression else ""
            named, raise_it = self._limits.where_set(virtual=False)
            raise ImageError(
                f"{self._origin.what} is larger than {human_size(self._limits.max_disk_bytes)}{once}, the limit "
                f"for a disk on this host{named}; build a smaller disk (a sparse qcow2 holds only what was "
                f"written) and {self._origin.resend}{raise_it}",
                code="disk_too_large",
            )
        return data

    def _unreadable(self, exc: BaseException) -> ImageError:
        what, resend = self._origin.what, self._origin.resend
        if self.compression is None:
            return ImageError(f"{what} could not be read ({exc}); check the source and {resend}")
        detail = "the stream ended early (truncated)" if isinstance(exc, EOFError) else str(exc)
        return ImageError(
            f"{what} could not be decompressed ({self.compression}: {detail}); its bytes are not complete "
            f"{self.compression} data, so compress the disk again and {resend}",
            code="bad_compression",
        )


def open_decompressed(
    raw: BinaryIO,
    compression: Compression | Literal["auto"] | None,
    origin: Origin,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[Compression | None, BinaryIO]:
    """The compression used and a reader of the decompressed bytes of ``raw``.

    ``auto`` sniffs zstd, gzip or xz from the first bytes (anything else is read as it is).
    Concatenated frames/members/streams are read as one. Reads raise :class:`ImageError`: code
    ``bad_compression`` for bytes that do not decompress or end early, ``disk_too_large`` past
    ``limits.max_disk_bytes``; errors that are already a vmsidecar error pass unchanged.
    """
    if compression == "auto":
        head = read_at_least(raw, 8)
        compression = sniff_compression(head)
        raw = _Prefixed(head, raw)  # type: ignore[assignment]
    inner: BinaryIO
    if compression == "zstd":
        inner = _ZstdReader(raw)  # type: ignore[assignment]
    elif compression == "gzip":
        inner = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
    elif compression == "xz":
        inner = lzma.LZMAFile(raw)  # type: ignore[assignment]  # noqa: SIM115 - the returned reader owns it
    else:
        inner = raw
    return compression, _Decoded(inner, compression, origin, limits)  # type: ignore[return-value]
