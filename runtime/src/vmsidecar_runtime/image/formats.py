"""Disk images: sniff → decompress → write → check, for every path that accepts a guest disk.

Pull (:mod:`vmsidecar_runtime.oci.unpack`), flash (:mod:`vmsidecar_runtime.disk`) and push
(:mod:`vmsidecar_runtime.oci.pack`) all go through this module, so a rule added here holds for
all of them. The checks used to exist twice and only the pull copy refused backing files: a
flashed qcow2 naming ``/etc/hostname`` as its backing file made QEMU open that host file.

The pipeline works on blocking readers (flash bridges its async stream into a worker thread):

1. :func:`open_decompressed` takes the declared compression or sniffs zstd/gzip/xz from the
   first bytes and returns a reader of the decompressed bytes. Memory stays bounded whatever the
   compression ratio, a truncated stream is an error, and more than ``max_disk_bytes`` stops it.
2. :func:`write_disk` decides the format from the first decompressed bytes (qcow2 magic, MBR/GPT
   boot signature, ext2/3/4 superblock), refuses a qcow2 header that names another host file or
   claims too large a disk before anything is written, then writes and hashes the disk.
3. :func:`check_image` checks the written file: not empty; for qcow2 the header again (now
   reading the names for the message), ``qemu-img info`` (backing file, data file, virtual
   size) and ``qemu-img check``. qemu-img is only run once the header is known to name no other
   file, and always with an explicit ``-f`` (never format probing).

Limits (generous: the disks of test rigs are far below them):

* ``MAX_VIRTUAL_SIZE`` = 1 TiB, the disk size the guest sees. A qcow2 header can claim petabytes
  in a few kilobytes, and the guest could then fill the host through its overlay.
* ``MAX_DISK_BYTES`` = 256 GiB, the bytes a disk takes on the host once decompressed (for a raw
  disk that is also its virtual size). It stops a decompression bomb before it fills the volume.

Both are the defaults of :class:`Limits`, which every entry point takes. Every refusal is an
:class:`~vmsidecar_contract.errors.ImageError` naming the cause and the fix; callers remove their
temporary file on any error, so nothing half-checked is ever kept.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import lzma
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

import zstandard

from vmsidecar_contract.errors import HostError, ImageError, VmsidecarError
from vmsidecar_runtime import procs

DiskFormat = Literal["qcow2", "raw"]
Compression = Literal["zstd", "gzip", "xz"]

KIB, MIB, GIB, TIB, PIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50
#: the largest disk a guest may see (qcow2 ``size``, a raw disk's length)
MAX_VIRTUAL_SIZE = 1 * TIB
#: the largest disk file written on the host, once decompressed
MAX_DISK_BYTES = 256 * GIB

QCOW2_MAGIC = b"QFI\xfb"
COMPRESSION_MAGIC: dict[Compression, bytes] = {
    "zstd": b"\x28\xb5\x2f\xfd",
    "gzip": b"\x1f\x8b",
    "xz": b"\xfd7zXZ\x00",
}
#: enough decompressed bytes to see every signature (the ext superblock magic is at 1080)
SNIFF_BYTES = 2048
CHUNK = 1 << 20

#: qcow2 v3 incompatible feature bit 2: the guest's data lives in another file the header names
QCOW2_EXTERNAL_DATA_FILE = 1 << 2
_QCOW2_DATA_FILE_EXTENSION = 0x44415441
_QCOW2_V2_HEADER = 72
_QCOW2_V3_HEADER = 104
#: the header, its extensions and (where qemu-img writes it) the backing file name fit in here
_QCOW2_HEAD = 64 * KIB
#: zstd expands at most ~32768x (a 4-byte RLE block is 128 KiB), so 1 KiB in is ≤ 32 MiB out
_ZSTD_SLICE = 1 * KIB
#: ``zstd --long=31`` frames need a 2 GiB window; zstandard's default limit is 128 MiB
_ZSTD_MAX_WINDOW = 1 << 31


@dataclass(frozen=True)
class Limits:
    """Size limits for one image; the defaults are the module's constants."""

    max_virtual_size: int = MAX_VIRTUAL_SIZE
    max_disk_bytes: int = MAX_DISK_BYTES


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Origin:
    """Where an image comes from, for messages: ``what`` it is, and how to ``resend`` a fixed one.

    ``Origin("the flashed image", "flash the result")`` gives "the flashed image is a qcow2
    overlay that names a backing file (…); flatten it with … and flash the result".
    """

    what: str
    resend: str


class _Sha256(Protocol):
    name: str

    def hexdigest(self) -> str: ...


def sha256_digest(content: bytes | _Sha256) -> str:
    """``sha256:<hex>`` of ``content``: bytes, or a ``hashlib.sha256()`` fed with streamed data.

    :raise ValueError: for a hash object that is not sha256 (its digest would be mislabelled).
    """
    hasher = hashlib.sha256(content) if isinstance(content, bytes | bytearray | memoryview) else content
    if hasher.name != "sha256":
        raise ValueError(f"sha256_digest() needs a sha256 hash object, not {hasher.name}")
    return "sha256:" + hasher.hexdigest()


def human_size(n: int) -> str:
    """``2 PiB``, ``1.5 GiB``, ``512 bytes``: sizes in messages."""
    for unit, factor in (("PiB", PIB), ("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= factor:
            return f"{n / factor:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"


# ---- sniffing ---------------------------------------------------------------------------------


def sniff_compression(head: bytes) -> Compression | None:
    """The compression of a stream from its first bytes (6 are enough), or ``None``."""
    for name, magic in COMPRESSION_MAGIC.items():
        if head.startswith(magic):
            return name
    return None


def sniff_format(head: bytes) -> DiskFormat | None:
    """``qcow2`` for the qcow2 magic, ``raw`` for a bootable disk's signature, else ``None``.

    Raw signatures: the MBR (or GPT's protective MBR) boot signature at 510, the ext2/3/4
    superblock magic at 1080. ``head`` should hold :data:`SNIFF_BYTES` bytes when the data does.
    """
    if head.startswith(QCOW2_MAGIC):
        return "qcow2"
    if len(head) >= 512 and head[510:512] == b"\x55\xaa":
        return "raw"
    if len(head) >= 1082 and head[1080:1082] == b"\x53\xef":
        return "raw"
    return None


def decide_format(head: bytes, declared: DiskFormat | None, origin: Origin, *, guess_raw: bool = False) -> DiskFormat:
    """The format to boot a disk as, from its first bytes and what its sender declared.

    Declared raw stays raw: probing a raw disk is QEMU's classic hole (a guest that writes a
    qcow2 header into its raw disk would make the host open a file of its choosing on the next
    boot). Declared qcow2 must carry the magic. Undeclared: qcow2 by magic, raw by signature; a
    disk with neither is raw only with ``guess_raw`` (a pull whose file or layer name says it is
    a disk image), else refused.

    :raise ImageError: (code ``bad_disk``) for a declared qcow2 without the magic, and for data
        that does not look like a disk without ``guess_raw``.
    """
    sniffed = sniff_format(head)
    if declared == "qcow2" and sniffed != "qcow2":
        raise ImageError(
            f"{origin.what} is declared qcow2 but does not start with the qcow2 magic; declare it raw, or "
            f"convert it with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
            code="bad_disk",
        )
    if declared is not None:
        return declared
    if sniffed is not None:
        return sniffed
    if guess_raw:
        return "raw"
    raise ImageError(
        f"{origin.what} is not a disk image (no qcow2 header, no MBR/GPT boot signature, no ext4 "
        "superblock); send a qcow2 or raw disk image, optionally zstd/gzip/xz-compressed",
        code="bad_disk",
    )


# ---- decompression ----------------------------------------------------------------------------


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


class _Decoded(io.RawIOBase):
    """The decompressed stream: counts it against the limit and turns decoder errors into ImageError."""

    def __init__(self, inner: BinaryIO, compression: Compression | None, origin: Origin, limits: Limits) -> None:
        super().__init__()
        self._inner = inner
        self.compression = compression
        self._origin = origin
        self._limits = limits
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

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
            raise ImageError(
                f"{self._origin.what} is larger than {human_size(self._limits.max_disk_bytes)}{once}, the limit "
                f"for a disk on this host; build a smaller disk (a sparse qcow2 holds only what was written) "
                f"and {self._origin.resend}",
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
        head = _read_at_least(raw, 8)
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


def _read_at_least(stream: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes: fewer only at the end of the stream (a read may return a short chunk)."""
    parts: list[bytes] = []
    have = 0
    while have < n:
        data = stream.read(n - have)
        if not data:
            break
        parts.append(data)
        have += len(data)
    return b"".join(parts)


# ---- writing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenDisk:
    """A disk written to a file by :func:`write_disk` (still to be checked with :func:`check_image`)."""

    path: Path
    format: DiskFormat
    digest: str  # sha256 of the (decompressed) bytes written
    size: int


def write_disk(
    stream: BinaryIO,
    out: Path,
    *,
    declared: DiskFormat | None,
    origin: Origin,
    limits: Limits = DEFAULT_LIMITS,
    guess_raw: bool = False,
) -> WrittenDisk:
    """Copy a (decompressed) disk stream to the new file ``out``, hashing it.

    The format is decided from the first bytes (see :func:`decide_format`), and a qcow2 header
    that names a backing or data file, or claims too large a disk, is refused before ``out`` is
    created, so a refusal costs no disk space. The caller removes ``out`` on any error.

    :raise ImageError: (code ``bad_disk``) empty, not a disk, declared qcow2 without the magic,
        a qcow2 header too short; (code ``unsafe_disk``) a backing or data file; (code
        ``disk_too_large``) past the limits; and the stream's own errors.
    :raise OSError: when ``out`` cannot be created or written (the caller says where to free space).
    """
    head = _read_at_least(stream, SNIFF_BYTES)
    if not head:
        raise _empty(origin)
    fmt = decide_format(head, declared, origin, guess_raw=guess_raw)
    if fmt == "qcow2":
        check_qcow2_header(parse_qcow2_header(head, origin), origin, limits)
    hasher = hashlib.sha256()
    size = 0
    with open(out, "xb") as f:
        chunk = head
        while chunk:
            hasher.update(chunk)
            f.write(chunk)
            size += len(chunk)
            chunk = stream.read(CHUNK)
    return WrittenDisk(out, fmt, sha256_digest(hasher), size)


# ---- checking ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Qcow2Header:
    """What matters for safety in a qcow2 header.

    ``backing_file``/``data_file`` are ``None`` when there is none, else the name (``""`` when
    the name lies beyond the bytes that were parsed).
    """

    version: int
    virtual_size: int
    backing_file: str | None
    data_file: str | None
    backing_offset: int = 0
    backing_size: int = 0


def parse_qcow2_header(data: bytes, origin: Origin) -> Qcow2Header:
    """Parse the start of a qcow2 file (the magic is already known to be there).

    :raise ImageError: (code ``bad_disk``) for a header too short for its version, or an
        unknown version.
    """
    if len(data) < _QCOW2_V2_HEADER:
        raise _too_short(origin)
    version, backing_offset, backing_size = struct.unpack_from(">IQI", data, 4)
    (virtual_size,) = struct.unpack_from(">Q", data, 24)
    if version not in (2, 3):
        raise ImageError(
            f"{origin.what} is a qcow2 image of version {version}, which QEMU does not read; "
            f"rebuild it with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
            code="bad_disk",
        )
    backing: str | None = None
    if backing_offset:
        end = backing_offset + backing_size
        backing = _printable(data[backing_offset:end]) if end <= len(data) else ""
    data_file: str | None = None
    if version == 3:
        if len(data) < _QCOW2_V3_HEADER:
            raise _too_short(origin)
        (incompatible,) = struct.unpack_from(">Q", data, 72)
        if incompatible & QCOW2_EXTERNAL_DATA_FILE:
            (header_length,) = struct.unpack_from(">I", data, 100)
            name = _extension(data, max(header_length, _QCOW2_V3_HEADER), _QCOW2_DATA_FILE_EXTENSION)
            data_file = _printable(name) if name is not None else ""
    return Qcow2Header(version, virtual_size, backing, data_file, backing_offset, backing_size)


def check_qcow2_header(header: Qcow2Header, origin: Origin, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a qcow2 header that names another host file or claims too large a disk.

    Either file would be opened by QEMU on the host, at a path the image's author chose.

    :raise ImageError: (code ``unsafe_disk``) for a backing or external data file; (code
        ``disk_too_large``) for a virtual size past the limit.
    """
    if header.backing_file is not None:
        raise _backing_file(header.backing_file, origin)
    if header.data_file is not None:
        raise _data_file(header.data_file, origin)
    check_virtual_size(header.virtual_size, origin, limits)


def check_virtual_size(size: int, origin: Origin, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a disk larger than the guest may see.

    :raise ImageError: (code ``disk_too_large``) past ``limits.max_virtual_size``.
    """
    if size > limits.max_virtual_size:
        raise ImageError(
            f"{origin.what} has a virtual size of {human_size(size)}, more than the "
            f"{human_size(limits.max_virtual_size)} limit; build a smaller disk (or shrink its file systems, "
            f"then `qemu-img resize --shrink`) and {origin.resend}",
            code="disk_too_large",
        )


def check_image(path: Path, fmt: DiskFormat | str, origin: Origin, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a disk file QEMU must not boot: empty, too large, corrupt, or opening other host files.

    Blocking (it runs ``qemu-img``); call it in a thread from asyncio.

    :raise ImageError: (code ``bad_disk``) empty, no qcow2 magic, corrupt; (code
        ``unsafe_disk``) a qcow2 with a backing file or an external data file; (code
        ``disk_too_large``) past the virtual size limit.
    :raise HostError: when qemu-img is not installed.
    """
    size = path.stat().st_size
    if size == 0:
        raise _empty(origin)
    if fmt == "raw":
        check_virtual_size(size, origin, limits)
        return
    with open(path, "rb") as f:
        data = f.read(_QCOW2_HEAD)
        if not data.startswith(QCOW2_MAGIC):
            raise ImageError(
                f"{origin.what} is meant to be qcow2 but has no qcow2 magic; "
                f"convert it with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
                code="bad_disk",
            )
        header = parse_qcow2_header(data, origin)
        if header.backing_file == "":  # the name lies past the first 64 KiB: read it for the message
            f.seek(header.backing_offset)
            header = dataclasses.replace(header, backing_file=_printable(f.read(min(header.backing_size, 4096))))
    check_qcow2_header(header, origin, limits)
    # The header is the format's own word; qemu-img's reading of it is the one QEMU will act on.
    info = _qemu_img_info(path, origin)
    backing = info.get("full-backing-filename") or info.get("backing-filename")
    if backing:
        raise _backing_file(_printable(str(backing).encode()), origin)
    specific = info.get("format-specific")
    specific_data = specific.get("data") if isinstance(specific, dict) else None
    data_file = specific_data.get("data-file") if isinstance(specific_data, dict) else None
    if data_file:
        raise _data_file(_printable(str(data_file).encode()), origin)
    virtual_size = info.get("virtual-size")
    if isinstance(virtual_size, int):
        check_virtual_size(virtual_size, origin, limits)
    rc, out, err = _qemu_img("check", "-f", "qcow2", "--output=json", str(path))
    # rc 3 = only leaked clusters: wasted space, harmless for a read-only base
    if rc not in (0, 3):
        raise _corrupt(origin, _check_detail(rc, out, err))


def _qemu_img_info(path: Path, origin: Origin) -> dict:
    rc, out, err = _qemu_img("info", "-f", "qcow2", "--output=json", str(path))
    if rc != 0:
        raise _corrupt(origin, _last_line(err or out) or f"qemu-img info rc {rc}")
    try:
        info = json.loads(out)
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise _corrupt(origin, "qemu-img info gave no JSON object")
    return info


def _qemu_img(*args: str) -> tuple[int, str, str]:
    """Run qemu-img (blocking).

    :raise HostError: when it is not installed.
    """
    try:
        return procs.run("qemu-img", *args)
    except FileNotFoundError:
        raise HostError("qemu-img is not installed; install qemu-utils") from None


def _check_detail(rc: int, out: str, err: str) -> str:
    """One line from ``qemu-img check``: its error, else the counts from its JSON report."""
    if err.strip():
        return _last_line(err)
    try:
        report = json.loads(out)
    except ValueError:
        report = None
    if isinstance(report, dict):
        counts = [f"{report[k]} {k}" for k in ("corruptions", "leaks", "check-errors") if report.get(k)]
        if counts:
            return ", ".join(counts)
    return _last_line(out) or f"qemu-img check rc {rc}"


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else ""


def _extension(data: bytes, start: int, wanted: int) -> bytes | None:
    """The payload of the qcow2 header extension ``wanted``, if it is within ``data``."""
    pos = start
    while pos + 8 <= len(data):
        kind, length = struct.unpack_from(">II", data, pos)
        if kind == 0:  # end of the extension area
            return None
        pos += 8
        if kind == wanted:
            return data[pos : pos + length]
        pos += (length + 7) & ~7
    return None


def _printable(raw: bytes) -> str:
    """A host path from an image header, safe to put in a one-line message."""
    text = "".join(c if c.isprintable() else "?" for c in raw.decode(errors="replace"))
    return text if len(text) <= 200 else text[:200] + "…"


def _empty(origin: Origin) -> ImageError:
    return ImageError(
        f"{origin.what} is empty (0 bytes); build a qcow2 or raw disk with content and {origin.resend}",
        code="bad_disk",
    )


def _too_short(origin: Origin) -> ImageError:
    return ImageError(
        f"{origin.what} is too short to be a qcow2 image (the header is cut off); check the source and "
        f"{origin.resend}",
        code="bad_disk",
    )


def _corrupt(origin: Origin, detail: str) -> ImageError:
    return ImageError(f"{origin.what} is a corrupt qcow2 ({detail}); re-download or rebuild the image", code="bad_disk")


def _backing_file(name: str, origin: Origin) -> ImageError:
    named = f" ({name})" if name else ""
    return ImageError(
        f"{origin.what} is a qcow2 overlay that names a backing file{named}, which QEMU would open on "
        f"the host; flatten it with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
        code="unsafe_disk",
    )


def _data_file(name: str, origin: Origin) -> ImageError:
    named = f" ({name})" if name else ""
    return ImageError(
        f"{origin.what} is a qcow2 image with an external data file{named}, which QEMU would open on "
        f"the host; copy the data into one image with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
        code="unsafe_disk",
    )
