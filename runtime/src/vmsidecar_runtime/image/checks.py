"""Checks on a guest disk before QEMU may boot it: the qcow2 header, ``qemu-img``, the size limits.

:func:`check_image` checks a written file: not empty; for qcow2 the header (naming the files it
points at for the message), ``qemu-img info`` (backing file, data file, virtual size) and
``qemu-img check``. qemu-img is only run once the header is known to name no other file, and
always with an explicit ``-f`` (never format probing). :func:`check_qcow2_header` is also run on
the first bytes of a stream, so an unsafe header is refused before anything is written.

Every refusal is an :class:`~vmsidecar_contract.errors.ImageError` naming the cause and the fix;
callers remove their temporary file on any error, so nothing half-checked is ever kept.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vmsidecar_contract.errors import HostError, ImageError
from vmsidecar_runtime import confinement, procs

from .limits import DEFAULT_LIMITS, KIB, MIB, Limits, Origin, human_size
from .sniff import QCOW2_MAGIC, SNIFF_BYTES, DiskFormat, refuse_disguised_raw

#: qcow2 v3 incompatible feature bit 2: the guest's data lives in another file the header names
QCOW2_EXTERNAL_DATA_FILE = 1 << 2
_QCOW2_DATA_FILE_EXTENSION = 0x44415441
_QCOW2_V2_HEADER = 72
_QCOW2_V3_HEADER = 104
#: the header, its extensions and (where qemu-img writes it) the backing file name fit in here
_QCOW2_HEAD = 64 * KIB
_QCOW2_MIN_CLUSTER_BITS, _QCOW2_MAX_CLUSTER_BITS = 9, 21  # what QEMU opens
_QCOW2_V2_REFCOUNT_ORDER = 4  # 16-bit refcounts, the only width before v3

#: ``qemu-img check`` holds one refcount per cluster of the *file* in memory: a header can ask for
#: 512-byte clusters with 64-bit refcounts, and a sparse file 60 GiB long then costs 1 GiB (a few KiB
#: compressed). Refused before qemu-img runs above this; a real 64 GiB disk with the default 64 KiB
#: clusters needs 2 MiB, one with 512-byte clusters and 16-bit refcounts 256 MiB.
MAX_CHECK_REFCOUNT_MEMORY = 256 * MIB
#: the memory every qemu-img run on an image may take (heap and mappings: RLIMIT_DATA, set by the
#: kernel through ``prlimit``), for whatever else in an image's metadata the header does not tell;
#: the check above, qemu-img's metadata caches (32 MiB), its L1 table (up to 32 MiB) and its 64 I/O
#: threads' stacks (2 MiB each, ``procs.THREAD_STACK``) fit with room
QEMU_IMG_MEMORY = 768 * MIB
#: and the time: qemu-img reads only metadata, a second or two for a 64 GiB disk
QEMU_IMG_TIMEOUT = 300.0


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
    cluster_bits: int = 16
    refcount_order: int = _QCOW2_V2_REFCOUNT_ORDER


def parse_qcow2_header(data: bytes, origin: Origin) -> Qcow2Header:
    """Parse the start of a qcow2 file (the magic is already known to be there).

    :raise ImageError: (code ``bad_disk``) for a header too short for its version, or an
        unknown version.
    """
    if len(data) < _QCOW2_V2_HEADER:
        raise _too_short(origin)
    version, backing_offset, backing_size = struct.unpack_from(">IQI", data, 4)
    (cluster_bits,) = struct.unpack_from(">I", data, 20)
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
    refcount_order = _QCOW2_V2_REFCOUNT_ORDER
    if version == 3:
        if len(data) < _QCOW2_V3_HEADER:
            raise _too_short(origin)
        (incompatible,) = struct.unpack_from(">Q", data, 72)
        (refcount_order,) = struct.unpack_from(">I", data, 96)
        if incompatible & QCOW2_EXTERNAL_DATA_FILE:
            (header_length,) = struct.unpack_from(">I", data, 100)
            name = _extension(data, max(header_length, _QCOW2_V3_HEADER), _QCOW2_DATA_FILE_EXTENSION)
            data_file = _printable(name) if name is not None else ""
    return Qcow2Header(version, virtual_size, backing, data_file, backing_offset, backing_size, cluster_bits,
                       refcount_order)


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
        named, raise_it = limits.where_set(virtual=True)
        raise ImageError(
            f"{origin.what} has a virtual size of {human_size(size)}, more than the "
            f"{human_size(limits.max_virtual_size)} limit{named}; build a smaller disk (or shrink its file "
            f"systems, then `qemu-img resize --shrink`) and {origin.resend}{raise_it}",
            code="disk_too_large",
        )


def check_refcount_memory(header: Qcow2Header, file_size: int, origin: Origin) -> None:
    """Refuse a qcow2 whose ``qemu-img check`` would hold more than :data:`MAX_CHECK_REFCOUNT_MEMORY`
    of refcounts (one per cluster of the file, of the header's width).

    :raise ImageError: (code ``unsafe_disk``) naming the geometry, the memory and the fix.
    """
    bits, order = header.cluster_bits, header.refcount_order
    if not _QCOW2_MIN_CLUSTER_BITS <= bits <= _QCOW2_MAX_CLUSTER_BITS or order > 6:
        return  # QEMU refuses such a header itself: qemu-img info says why
    need = -(-file_size >> bits) * (1 << order) // 8
    if need > MAX_CHECK_REFCOUNT_MEMORY:
        raise ImageError(
            f"{origin.what} is a {human_size(file_size)} file in {1 << bits}-byte clusters with "
            f"{1 << order}-bit refcounts: checking it would take {human_size(need)} of memory, "
            f"more than {human_size(MAX_CHECK_REFCOUNT_MEMORY)}; rewrite it with the default geometry "
            f"(`qemu-img convert -O qcow2 IN OUT`: 64 KiB clusters, 16-bit refcounts) and {origin.resend}",
            code="unsafe_disk",
        )


#: what a disk's persistent dirty bitmaps may take in memory (a 64 GiB disk's bitmap of QEMU's default
#: 64 KiB granularity is 128 KiB; incremental backup tools keep a few)
BITMAP_MEMORY = 32 << 20
#: bump when :func:`check_image` refuses something it passed before: every cache entry is checked again
CHECKS_VERSION = 3


def verdict(fmt: DiskFormat | str, limits: Limits = DEFAULT_LIMITS) -> str:
    """What a pass of :func:`check_image` says, for a record that lets a file it passed skip it
    while unchanged: the checks' version, the format and the limits they held it to."""
    return f"v{CHECKS_VERSION} {fmt} virtual<={limits.max_virtual_size} bytes<={limits.max_disk_bytes}"


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
        raise empty_error(origin)
    with open(path, "rb") as f:
        data = f.read(_QCOW2_HEAD)
        if fmt == "raw":
            refuse_disguised_raw(data[:SNIFF_BYTES], "raw", origin)  # also a cache entry from before this check
            check_virtual_size(size, origin, limits)
            return
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
    check_refcount_memory(header, size, origin)
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
        check_bitmap_memory(specific_data, virtual_size, origin)
    rc, out, err = run_qemu_img("check", "-f", "qcow2", "--output=json", str(path), origin=origin, read=(path,))
    # rc 3 = only leaked clusters: wasted space, harmless for a read-only base
    if rc not in (0, 3):
        raise _corrupt(origin, _check_detail(rc, out, err))


def check_bitmap_memory(specific: object, virtual_size: int, origin: Origin) -> None:
    """Refuse a qcow2 whose persistent dirty bitmaps would take more than :data:`BITMAP_MEMORY`: every
    QEMU and qemu-img that opens the disk loads them whole (a bit per granule of the virtual size),
    and past the check nothing bounds their memory (the overlay's ``create``, a dump's ``convert``,
    the guest's QEMU).

    :raise ImageError: (code ``unsafe_disk``) naming how many bitmaps, their memory and the fix.
    """
    bitmaps = specific.get("bitmaps") if isinstance(specific, dict) else None
    if not isinstance(bitmaps, list) or not bitmaps:
        return
    need = 0
    for bitmap in bitmaps:
        granularity = bitmap.get("granularity") if isinstance(bitmap, dict) else None
        granularity = granularity if isinstance(granularity, int) and granularity > 0 else 1
        need += -(-virtual_size // granularity) // 8
    if need > BITMAP_MEMORY:
        raise ImageError(
            f"{origin.what} has {len(bitmaps)} persistent bitmaps that would take {need >> 20} MiB of memory in every "
            f"QEMU and qemu-img that opens it, more than {BITMAP_MEMORY >> 20} MiB; a boot disk needs none: copy it "
            f"without them with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
            code="unsafe_disk",
        )


def _qemu_img_info(path: Path, origin: Origin) -> dict:
    """``qemu-img info`` of a qcow2 file, parsed.

    :raise ImageError: (code ``bad_disk``) when qemu-img cannot read it.
    :raise HostError: when qemu-img is not installed.
    """
    rc, out, err = run_qemu_img("info", "-f", "qcow2", "--output=json", str(path), origin=origin, read=(path,))
    if rc != 0:
        raise _corrupt(origin, _last_line(err or out) or f"qemu-img info rc {rc}")
    try:
        info = json.loads(out)
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise _corrupt(origin, "qemu-img info gave no JSON object")
    return info


#: a backing chain longer than this is not one the runtime made (base, frozen overlay, overlay)
MAX_CHAIN = 8


def read_qcow2_header(path: Path, origin: Origin) -> Qcow2Header | None:
    """The qcow2 header of the file ``path``, or None when it is no qcow2 image.

    :raise OSError: it cannot be read. :raise ImageError: its header is too short or of no known version.
    """
    with open(path, "rb") as f:
        head = f.read(_QCOW2_HEAD)
    return parse_qcow2_header(head, origin) if head.startswith(QCOW2_MAGIC) else None


def backing_chain(disk: Path) -> list[Path]:
    """The backing files the qcow2 headers under ``disk`` name, in order. Only for a disk whose
    header no QEMU writes (a cache image, a frozen overlay): a lease's overlay is its QEMU's to
    write, header included, so what it stands on is the runtime's record (``Disks.chain``). A header
    that cannot be read ends the chain (QEMU then fails to open the next file, naming it)."""
    chain: list[Path] = []
    current = disk
    for _ in range(MAX_CHAIN):
        try:
            header = read_qcow2_header(current, Origin("a disk of this boot", ""))
        except (OSError, ImageError):
            break
        name = header.backing_file if header is not None else None
        if not name:
            break
        current = current.parent / name  # (an absolute name replaces the directory, as in QEMU)
        chain.append(current)
    return chain


def run_qemu_img(*args: str, origin: Origin, timeout: float | None = None, read: tuple[Path, ...] = (),
                 write: tuple[Path, ...] = ()) -> tuple[int, str, str]:
    """Run qemu-img (blocking) on an image the runtime did not make, held to :data:`QEMU_IMG_MEMORY`,
    ``timeout`` (default :data:`QEMU_IMG_TIMEOUT`), :func:`procs.run`'s bound on what it prints and
    a Landlock domain that opens only the files ``read`` (read-only) and ``write`` (a qemu-img that
    a crafted image took over reads no other file: not the registry auth file, not another image).

    :raise ImageError: (code ``unsafe_disk``) when qemu-img ran out of any of them.
    :raise HostError: when qemu-img or prlimit is not installed.
    """
    qemu_img = shutil.which("qemu-img")  # prlimit execs whatever it is given: a missing one is named here
    if qemu_img is None:
        raise HostError("qemu-img is not installed; install qemu-utils")
    tool, timeout = f"qemu-img {args[0]}", QEMU_IMG_TIMEOUT if timeout is None else timeout
    try:
        with confinement.domain(confinement.tool_rules(qemu_img, read=read, write=write)) as ruleset:
            rc, out, err = procs.run(qemu_img, *args, timeout=timeout, max_memory=QEMU_IMG_MEMORY, confine=ruleset)
    except subprocess.TimeoutExpired:
        raise _exhausting(origin, f"{tool} did not finish within {timeout:g} s") from None
    except procs.OutputTooLarge as e:  # a snapshot or bitmap table of tens of thousands of entries
        raise _exhausting(origin, f"{tool} printed more than {human_size(e.limit)} about it") from None
    if rc != 0 and any(m in err for m in _OUT_OF_MEMORY):
        raise _exhausting(origin, f"{tool} needed more than {human_size(QEMU_IMG_MEMORY)} of memory "
                                  f"({_last_line(err)})")
    return rc, out, err


#: how qemu-img (its errno text, its own messages, GLib's abort) says that an allocation failed
_OUT_OF_MEMORY = ("Cannot allocate memory", "Could not allocate", "failed to allocate")


def _exhausting(origin: Origin, what: str) -> ImageError:
    """The refusal of an image whose metadata takes qemu-img past its bounds."""
    return ImageError(f"{origin.what} has metadata built to exhaust the host: {what}; rewrite it with "
                      f"`qemu-img convert -O qcow2 IN OUT` and {origin.resend}", code="unsafe_disk")


def _check_detail(rc: int, out: str, err: str) -> str:
    """One line from ``qemu-img check``: the counts of its JSON report, else its error (stderr's last
    line would be one of possibly millions of per-cluster lines)."""
    try:
        report = json.loads(out)
    except ValueError:
        report = None
    if isinstance(report, dict):
        counts = [f"{report[k]} {k}" for k in ("corruptions", "leaks", "check-errors") if report.get(k)]
        if counts:
            return ", ".join(counts)
    return _last_line(err) or _last_line(out) or f"qemu-img check rc {rc}"


def _last_line(text: str) -> str:
    """The last non-empty line of a tool's output (where qemu-img puts its verdict)."""
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


def empty_error(origin: Origin) -> ImageError:
    """The refusal of an empty (0-byte) disk."""
    return ImageError(
        f"{origin.what} is empty (0 bytes); build a qcow2 or raw disk with content and {origin.resend}",
        code="bad_disk",
    )


def _too_short(origin: Origin) -> ImageError:
    """The refusal of a qcow2 header cut off before its end."""
    return ImageError(
        f"{origin.what} is too short to be a qcow2 image (the header is cut off); check the source and "
        f"{origin.resend}",
        code="bad_disk",
    )


def _corrupt(origin: Origin, detail: str) -> ImageError:
    """The refusal of a qcow2 that qemu-img finds corrupt."""
    return ImageError(f"{origin.what} is a corrupt qcow2 ({detail}); re-download or rebuild the image", code="bad_disk")


def _backing_file(name: str, origin: Origin) -> ImageError:
    """The refusal of a qcow2 overlay (QEMU would open its backing file on the host)."""
    return _opens_host_file(origin, "a qcow2 overlay that names a backing file", name, "flatten it")


def _data_file(name: str, origin: Origin) -> ImageError:
    """The refusal of a qcow2 whose data lives in an external file on the host."""
    is_what = "a qcow2 image with an external data file"
    return _opens_host_file(origin, is_what, name, "copy the data into one image")


def _opens_host_file(origin: Origin, is_what: str, name: str, fix: str) -> ImageError:
    """The refusal of a qcow2 that makes QEMU open ``name`` on the host (code ``unsafe_disk``)."""
    named = f" ({name})" if name else ""
    return ImageError(
        f"{origin.what} is {is_what}{named}, which QEMU would open on the host; "
        f"{fix} with `qemu-img convert -O qcow2 IN OUT` and {origin.resend}",
        code="unsafe_disk",
    )
