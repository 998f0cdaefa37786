"""Streaming decompression of guest disks: zstd, gzip or xz, with bounded memory.

:func:`open_decompressed` takes the declared compression or sniffs zstd/gzip/xz from the first
bytes and returns a reader of the decompressed bytes. Memory stays bounded whatever the
compression ratio, a truncated stream is an error (zstandard alone would end silently), and more
than ``max_disk_bytes`` stops it. The decoders' own memory is capped too: a zstd frame may ask
for a 2 GiB window (``--long=31``) and an xz block for a 4 GiB dictionary in a few bytes, and
the sender of the stream is not trusted; past :data:`MAX_ZSTD_WINDOW` or :data:`MAX_XZ_MEMORY`
the stream is refused before the decoder allocates. The readers are blocking (flash bridges its
async stream into a worker thread).
"""

from __future__ import annotations

import gzip
import io
import lzma
import zlib
from collections.abc import Callable
from typing import IO, Literal, cast

import zstandard

from vmsidecar_contract.errors import ImageError, VmsidecarError

from .limits import DEFAULT_LIMITS, MIB, Limits, Origin, human_size
from .sniff import ByteSource, Compression, read_at_least, sniff_compression

CHUNK = 1 << 20
_ZSTD_MAGIC = 0xFD2FB528
#: skippable frames' magic numbers are 0x184D2A50 to 0x184D2A5F
_SKIPPABLE_MAGIC = 0x184D2A50
#: the largest zstd window decoded (zstd's own default limit; ``-19`` uses 8 MiB, ``--long`` 128 MiB)
MAX_ZSTD_WINDOW = 128 * MIB
#: the most memory the xz decoder may use (``xz -9`` needs 65 MiB; ``--lzma2=dict=1536MiB`` 1.5 GiB)
MAX_XZ_MEMORY = 256 * MIB


class DecoderMemoryError(Exception):
    """The stream asks its decoder for more memory than allowed; the message says how much."""


class RawSource(io.RawIOBase):
    """A read-only raw stream whose ``read`` is a :class:`ByteSource`'s (a blocking stream never
    returns the ``None`` of a non-blocking one); subclasses implement ``readinto``, or ``read``
    (:class:`ChunkStream`)."""

    def readable(self) -> bool:
        """Always: these streams are read-only."""
        return True

    def read(self, size: int = -1, /) -> bytes:
        """Up to ``size`` bytes (all that is left for a negative one), ``b""`` at the end."""
        return super().read(size) or b""


class ChunkStream(RawSource):
    """A raw stream whose subclasses implement ``read`` (handing on whole chunks without a copy);
    ``readinto``, which the io machinery calls, goes through it."""

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        """Fill ``buffer`` from ``read``."""
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _Prefixed(RawSource):
    """``head`` (already read to sniff it) followed by the rest of ``rest``."""

    def __init__(self, head: bytes, rest: ByteSource) -> None:
        super().__init__()
        self._head = memoryview(head)
        self._rest = rest

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _ZstdFrames(ChunkStream):
    """A zstd stream passed on unchanged, its frames followed on the way, so that its end is known to
    fall between two frames: a stream cut off in a frame raises :class:`EOFError`.

    zstandard's ``stream_reader`` (which decodes into the caller's buffer, so its memory is bounded
    whatever the ratio) ends silently on a truncated frame, and no library reports where a frame
    ends without decoding it. This walks the frame format (RFC 8878, section 3.1): a frame's header
    (sized and read by zstandard), then blocks of 3-byte headers (last-block flag, type, size) up to
    the last, then the optional 4-byte checksum; skippable frames (zstd:chunked's metadata) are a
    magic number, a 4-byte size and that many bytes. A frame whose window passes
    :data:`MAX_ZSTD_WINDOW` is refused here, before the decoder sees its header.
    """

    def __init__(self, raw: ByteSource) -> None:
        super().__init__()
        self._raw = raw
        self._skip = 0  # bytes of the current block, checksum or skippable frame still to pass
        self._head = bytearray()  # the header being collected
        self._need = 4  # its whole length
        self._next: Callable[[bytes], None] = self._magic  # what reads it once whole
        self._checksum = False

    def read(self, size: int = -1, /) -> bytes:
        """Up to ``size`` bytes of the stream, as they came."""
        data = self._raw.read(CHUNK if size is None or size < 0 else size)
        if data:
            self._follow(memoryview(data))
        elif not self._between_frames():
            raise EOFError("the stream ended in the middle of a frame (truncated)")
        return data

    def _between_frames(self) -> bool:
        return not self._skip and not self._head and self._next == self._magic

    def _follow(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            if self._skip:
                step = min(self._skip, len(data) - pos)
                self._skip -= step
                pos += step
                continue
            take = min(self._need - len(self._head), len(data) - pos)
            self._head += data[pos:pos + take]
            pos += take
            if len(self._head) == self._need:
                head, self._head = bytes(self._head), bytearray()
                self._next(head)

    def _expect(self, length: int, reader: Callable[[bytes], None], keep: bytes = b"") -> None:
        self._head, self._need, self._next = bytearray(keep), length, reader

    def _magic(self, head: bytes) -> None:
        magic = int.from_bytes(head, "little")
        if magic == _ZSTD_MAGIC:
            self._expect(5, self._frame_header_size, keep=head)  # the size is in the 5th byte
        elif magic & 0xFFFFFFF0 == _SKIPPABLE_MAGIC:
            self._expect(8, self._skippable, keep=head)
        else:
            raise zstandard.ZstdError(f"no zstd frame starts here (the bytes {head.hex()} are not a zstd magic number)")

    def _frame_header_size(self, head: bytes) -> None:
        self._expect(zstandard.frame_header_size(head), self._frame_header, keep=head)

    def _frame_header(self, head: bytes) -> None:
        params = zstandard.get_frame_parameters(head)
        if params.window_size > MAX_ZSTD_WINDOW:
            raise DecoderMemoryError(f"a zstd window of {human_size(params.window_size)}")
        self._checksum = bool(params.has_checksum)
        self._expect(3, self._block)

    def _block(self, head: bytes) -> None:
        header = int.from_bytes(head, "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise zstandard.ZstdError("a zstd block of the reserved type 3")
        self._skip = 1 if kind == 1 else size  # an RLE block is one byte repeated `size` times
        if last:
            self._skip += 4 * self._checksum
            self._expect(4, self._magic)
        else:
            self._expect(3, self._block)

    def _skippable(self, head: bytes) -> None:
        self._skip = int.from_bytes(head[4:], "little")
        self._expect(4, self._magic)


class _ZstdReader(RawSource):
    """zstd frames one after another, decoded into the caller's buffer; a frame cut off is an error
    (:class:`_ZstdFrames` watches the frames go by)."""

    def __init__(self, raw: ByteSource) -> None:
        super().__init__()
        decoder = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW)
        frames = cast("IO[bytes]", _ZstdFrames(raw))  # the reader calls only `read`, which a raw stream has
        self._reader = decoder.stream_reader(frames, read_size=CHUNK, read_across_frames=True, closefd=False)

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        # Fills the buffer as far as the stream goes: every caller loops per read
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and (n := self._reader.readinto(view[filled:])):
            filled += n
        return filled


def _xz_decoder() -> lzma.LZMADecompressor:
    return lzma.LZMADecompressor(memlimit=MAX_XZ_MEMORY)


class _XzReader(RawSource):
    """xz (or legacy lzma) streams one after another, as :class:`lzma.LZMAFile` reads them, with the
    decoder's memory capped (``LZMAFile`` takes no ``memlimit``)."""

    def __init__(self, raw: ByteSource) -> None:
        super().__init__()
        self._raw = raw
        self._decoder = _xz_decoder()
        self._done = False

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        data = b""
        while not data and not self._done:
            data = self._decode(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _decode(self, size: int) -> bytes:
        try:
            if not self._decoder.eof:
                block = self._raw.read(CHUNK) if self._decoder.needs_input else b""
                if self._decoder.needs_input and not block:
                    raise EOFError("the stream ended before its end marker (truncated)")
                return self._decoder.decompress(block, size)
            # xz stream padding (null bytes) may sit between and after streams; LZMAFile stops reading
            # there and drops every later stream of the disk without a word
            block = self._decoder.unused_data.lstrip(b"\0")
            while not block:
                chunk = self._raw.read(CHUNK)
                if not chunk:
                    self._done = True
                    return b""
                block = chunk.lstrip(b"\0")
            self._decoder = _xz_decoder()  # the next stream
            try:
                return self._decoder.decompress(block, size)
            except lzma.LZMAError as exc:
                if _over_memlimit(exc):
                    raise
                self._done = True  # trailing bytes that are no stream (padding): ignored, as LZMAFile does
                return b""
        except lzma.LZMAError as exc:
            if _over_memlimit(exc):
                raise DecoderMemoryError(f"more than {human_size(MAX_XZ_MEMORY)} of memory") from exc
            raise


def _over_memlimit(exc: lzma.LZMAError) -> bool:
    return "Memory usage limit" in str(exc)


class _Decoded(ChunkStream):
    """The decompressed stream: counts it against the limit and turns decoder errors into ImageError."""

    def __init__(self, inner: ByteSource, compression: Compression | None, origin: Origin, limits: Limits) -> None:
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
        except DecoderMemoryError as exc:
            raise ImageError(
                f"{self._origin.what} is {self.compression} data whose decoder would need {exc}, past the caps of "
                f"this runtime (a zstd window up to {human_size(MAX_ZSTD_WINDOW)}, an xz decoder up to "
                f"{human_size(MAX_XZ_MEMORY)}); compress the disk again with default settings (`zstd -19` "
                f"without --long=28 or more, `xz -6`) and {self._origin.resend}",
                code="unsupported_compression",
            ) from exc
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
    raw: ByteSource,
    compression: Compression | Literal["auto"] | None,
    origin: Origin,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[Compression | None, ByteSource]:
    """The compression used and a reader of the decompressed bytes of ``raw``.

    ``auto`` sniffs zstd, gzip or xz from the first bytes (anything else is read as it is).
    Concatenated frames/members/streams are read as one. Reads raise :class:`ImageError`: code
    ``bad_compression`` for bytes that do not decompress or end early, ``disk_too_large`` past
    ``limits.max_disk_bytes``; errors that are already a vmsidecar error pass unchanged.
    """
    if compression == "auto":
        head = read_at_least(raw, 8)
        compression = sniff_compression(head)
        raw = _Prefixed(head, raw)
    inner: ByteSource
    if compression == "zstd":
        inner = _ZstdReader(raw)
    elif compression == "gzip":
        # read front to back, GzipFile never seeks (the stub asks for seek all the same)
        inner = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[call-overload]
    elif compression == "xz":
        inner = _XzReader(raw)
    else:
        inner = raw
    return compression, _Decoded(inner, compression, origin, limits)
