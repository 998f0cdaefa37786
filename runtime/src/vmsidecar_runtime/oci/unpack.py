"""Stream a blob through digest verification and decompression into one disk file.

One pass: the blob bytes are hashed and counted as they arrive, decompressed on the fly, and
the disk bytes hashed as they are written to a temporary file. Nothing written here is visible
to anyone until :mod:`.cache` moves it into place, which happens only after every check passed.
The image side (sniffing, decompression, limits, disk checks) is
:mod:`vmsidecar_runtime.image`, shared with flashing; this module adds what is OCI's
own: blob digests and sizes, and containerDisk tar layers (their whiteouts, and the tar forms
refused before tarfile reads them: extended headers past :data:`MAX_TAR_HEADER`, sparse entries).
"""

from __future__ import annotations

import errno
import hashlib
import tarfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from vmsidecar_contract.errors import DigestMismatchError, HostError, ImageError, RegistryError
from vmsidecar_runtime.image.checks import check_image
from vmsidecar_runtime.image.decompress import RawSource, open_decompressed
from vmsidecar_runtime.image.digest import sha256_digest
from vmsidecar_runtime.image.limits import DEFAULT_LIMITS, Limits, Origin
from vmsidecar_runtime.image.sniff import ByteSource, Compression, DiskFormat
from vmsidecar_runtime.image.write import WrittenDisk, write_disk

from .cache import fsync_file
from .mediatypes import DISK_SUFFIXES, title_format

CHUNK = 1 << 20
#: the longest GNU long name, long link or pax header a containerDisk layer may carry: tarfile reads
#: one whole into memory, as long as its header claims (a few KB of zstd make gigabytes of it)
MAX_TAR_HEADER = 1 << 20
_EXTENDED_HEADERS = frozenset({tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                               tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE})
Progress = Callable[[int, int | None], None]


class BlobReader(RawSource):
    """A read-only file over an iterator of chunks that counts what passes through, and hashes it
    when a digest is expected (a ``file:`` disk has none: the disk written is hashed, once).

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
        self._hash = hashlib.sha256() if digest is not None else None
        self.expected_digest = digest
        self.expected_size = size
        self.where = where
        self.count = 0
        self._progress = progress

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
        if self._hash is not None:
            self._hash.update(chunk)
        self._pending = memoryview(chunk)
        if self._progress is not None:
            self._progress(self.count, self.expected_size)

    def peek(self, size: int) -> bytes:
        """The next ``size`` bytes (fewer at the end of the blob), left to be read."""
        while len(self._pending) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            before = bytes(self._pending)
            self._take(chunk)
            self._pending = memoryview(before + chunk)
        return bytes(self._pending[:size])

    def drain(self) -> None:
        """Read (and hash) whatever is left of the blob."""
        self._pending = memoryview(b"")
        for chunk in self._chunks:
            self._take(chunk)
            self._pending = memoryview(b"")

    @property
    def digest(self) -> str:
        """``sha256:HEX`` of every byte read so far (a reader with an expected digest)."""
        assert self._hash is not None, "a BlobReader without an expected digest hashes nothing"
        return sha256_digest(self._hash)

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


def unpack_blob(
    reader: BlobReader,
    out: Path,
    *,
    kind: str,
    compression: Compression | Literal["auto"] | None,
    format_hint: DiskFormat | None,
    title: str | None = None,
    resend: str = "push the result",
    limits: Limits = DEFAULT_LIMITS,
    whiteouts: Whiteouts | None = None,
) -> WrittenDisk:
    """Decompress (and for ``tar`` layers, extract) the disk from ``reader`` into ``out``, and check it.

    Sniffing, decompression and the disk checks are :mod:`vmsidecar_runtime.image`, the
    same code that checks a flashed image. The blob is always read to its end and verified, even
    after an error about its content, so that a tampered blob is reported as a digest mismatch
    rather than as garbage. ``resend`` ends the fix in messages ("push the result"). ``whiteouts``:
    what the layers above this one deleted under /disk; a tar layer without a disk adds its own.

    :raise DigestMismatchError: the blob is not what its descriptor names.
    :raise ImageError: the blob does not decompress (``bad_compression``), a tar layer has no
        disk or several (``no_disk``/``several_disks``) or a sparse entry (``unsupported_format``),
        the disk is unsafe (``unsafe_disk``: links, backing or data files), bad (``bad_disk``) or too
        large (``disk_too_large``).
    :raise HostError: ``out`` cannot be written (``cache_write_failed``), qemu-img is missing.
    """
    origin = Origin(reader.where, resend)
    try:
        _, stream = open_decompressed(reader, compression, origin, limits)
        if kind == "tar":
            found = _extract_tar(stream, out, origin, format_hint, limits,
                                 Whiteouts() if whiteouts is None else whiteouts)
            if found is None:
                reader.drain()
                reader.verify()
                raise ImageError(
                    f"{reader.where} is a containerDisk layer with no .qcow2, .raw or .img file under "
                    "/disk; build the image with the disk at /disk/<name>.qcow2",
                    code="no_disk",
                )
            origin, disk = found
        else:
            declared = format_hint or (title_format(title)[0] if title else None)
            disk = write_disk(stream, out, declared=declared, origin=origin, limits=limits, guess_raw=True)
        reader.drain()
    except (DigestMismatchError, HostError, RegistryError):  # a broken download is not bad content
        raise
    except ImageError:
        # the content looked wrong: make sure it is the content the digest names before saying so
        _drain_quietly(reader)
        reader.verify()
        raise
    except (tarfile.TarError, EOFError, ValueError) as exc:  # ValueError: a pax record that does not parse
        _drain_quietly(reader)
        reader.verify()
        raise ImageError(
            f"{reader.where} could not be unpacked as a tar layer ({exc}); the layer's media type does not "
            "match its bytes, so push the image again",
            code="bad_compression",
        ) from exc
    except OSError as exc:  # everything read is an ImageError by now: this is writing ``out``
        raise _write_error(out, exc) from exc
    reader.verify()
    _check_while_syncing(out, disk.format, origin, limits)
    return disk


def _check_while_syncing(out: Path, fmt: DiskFormat, origin: Origin, limits: Limits) -> None:
    """:func:`check_image` on ``out`` while its pages go to disk: the cache's install fsyncs it
    before the rename that makes it an entry, and that fsync (0.04-0.06 s of a tiny guest's cold
    start) now overlaps the checks' two ``qemu-img`` runs (0.02-0.04 s) and finds little left.

    :raise HostError: (``cache_write_failed``) the kernel could not write it back (full or failing disk).
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="writeback") as pool:
        synced = pool.submit(fsync_file, out)
        check_image(out, fmt, origin, limits)
        try:
            synced.result()
        except OSError as exc:  # reported once: a second fsync may not say it again
            raise _write_error(out, exc) from exc


def _drain_quietly(reader: BlobReader) -> None:
    try:
        reader.drain()
    except DigestMismatchError:
        raise
    except Exception:  # the stream itself broke; verify() reports the short read
        pass


def _write_error(path: Path, exc: OSError) -> HostError:
    """The refusal of a disk the cache could not write, with the fix its cause calls for."""
    if exc.errno == errno.EIO:  # the write-back failed: space would not help
        fix = ("the disk under the cache failed to store it (the host's kernel log says why); point the cache at a "
               "working disk (--cache-dir, VMSIDECAR_CACHE_DIR)")
    else:
        fix = "free space in the cache directory or point the cache somewhere larger"
    return HostError(f"cannot write {path} ({exc.strerror or exc}); {fix}", code="cache_write_failed")


def _extract_tar(
    stream: ByteSource, out: Path, origin: Origin, format_hint: DiskFormat | None, limits: Limits,
    whiteouts: Whiteouts,
) -> tuple[Origin, WrittenDisk] | None:
    """Write the one disk file under ``disk/`` of a tar stream to ``out``; ``None`` if there is none.

    Returns the disk and an origin naming it (``/disk/<name> in <layer>``) for later messages. A disk
    file ``whiteouts`` hides (deleted by a layer above) is not the image's; a layer without a disk
    adds its own whiteouts, for the layers below it.
    """
    where = origin.what
    found: tuple[Origin, WrittenDisk] | None = None
    found_name = ""
    here = Whiteouts()
    try:
        # stream mode ("r|") only reads; the stub asks every file object for write, tell and seek too
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedTarInfo) as tar:  # type: ignore[call-overload]
            for member in tar:
                here.note(member)
                name = disk_member_name(member.name, where)
                if name is None:
                    continue
                if whiteouts.hides(name):
                    whiteouts.hid.setdefault(f"/disk/{name}", None)
                    continue
                if not member.isreg():
                    raise ImageError(
                        f"{where} has /disk/{name} as a link or special file, not a regular file; "
                        "copy the disk itself into /disk when building the image",
                        code="unsafe_disk",
                    )
                if found is not None:
                    raise ImageError(
                        f"{where} has several disk files under /disk ({found_name}, {name}); "
                        "keep exactly one .qcow2, .raw or .img file there",
                        code="several_disks",
                    )
                src = tar.extractfile(member)
                assert src is not None  # a regular file always has content
                member_origin = Origin(f"/disk/{name} in {where}", origin.resend)
                # what the entry yields is held to the limit as it is written, whatever its header claims
                _, content = open_decompressed(src, None, member_origin, limits)
                declared = format_hint or title_format(name)[0]
                disk = write_disk(content, out, declared=declared, origin=member_origin, limits=limits,
                                  guess_raw=True)
                found, found_name = (member_origin, disk), name
            # tarfile stops at the end-of-archive marker; the rest (padding) is drained by the caller
    except _SparseEntryError as exc:
        raise ImageError(
            f"{where} has the tar entry {exc.name!r} stored as a GNU sparse file (what `tar -S`/`--sparse` "
            "writes), which vmsidecar does not unpack: its header can claim any size, or a map of any "
            "length, in a few bytes; build the image from a plain tar, e.g. `ADD` or `COPY` the disk in the "
            "containerDisk's Containerfile (podman, buildah and docker write no sparse entries) or run tar "
            f"without -S/--sparse, and {origin.resend}",
            code="unsupported_format",
        ) from None
    if found is None:
        whiteouts.add(here)
    return found


@dataclass
class Whiteouts:
    """What the upper layers of a containerDisk deleted under /disk, which hides it in every layer
    below (OCI whiteouts): files (``disk/.wh.NAME``), or all of /disk (the opaque ``disk/.wh..wh..opq``,
    ``.wh.disk``, or a file that replaces the directory); ``marks``: the entries that said so, ``hid``:
    the disk files of lower layers they hid (both for the ``no_disk`` message)."""

    names: set[str] = field(default_factory=set)
    everything: bool = False
    marks: dict[str, None] = field(default_factory=dict)
    hid: dict[str, None] = field(default_factory=dict)

    def hides(self, name: str) -> bool:
        """Whether a disk file ``disk/<name>`` of a lower layer is deleted."""
        return self.everything or name in self.names

    def note(self, member: tarfile.TarInfo) -> None:
        """Record ``member`` if it is a whiteout of /disk or of a file in it."""
        parts = _parts(member.name)
        if parts in ([".wh..wh..opq"], [".wh.disk"], ["disk", ".wh..wh..opq"]) or (
                parts == ["disk"] and not member.isdir()):
            self.everything = True
        elif len(parts) == 2 and parts[0] == "disk" and parts[1].startswith(".wh."):
            self.names.add(parts[1].removeprefix(".wh."))
        else:
            return
        self.marks.setdefault("/".join(parts), None)

    def add(self, other: Whiteouts) -> None:
        """Add the whiteouts of the layer above the next one read."""
        self.names |= other.names
        self.everything |= other.everything
        self.marks |= other.marks

    @property
    def cache_tag(self) -> str:
        """For a layer's cache key: what a layer yields depends on what hides parts of it."""
        if self.everything:
            return ":hiding-all"
        if not self.names:
            return ""
        return ":hiding-" + hashlib.sha256("/".join(sorted(self.names)).encode()).hexdigest()[:16]


class _SparseEntryError(Exception):
    """A sparse tar entry, refused before tarfile reads its map or yields its holes (see
    :class:`_BoundedTarInfo`); turned into an ``ImageError`` naming the layer."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _BoundedTarInfo(tarfile.TarInfo):
    """A member header whose extended header (a long name, a pax record) is refused past
    :data:`MAX_TAR_HEADER` before tarfile reads it, and a sparse entry refused in every form (GNU's
    type ``S``, pax ``GNU.sparse.*``) before tarfile reads its map. ``_proc_member`` is where tarfile
    turns a header into its member, reading an extended one's data first (the hook its own GNU and pax
    handling uses); the class is passed as ``tarinfo=``, tarfile's public way to read headers
    differently. tarfile reads a sparse map whole into memory (a chain of extension blocks, or pax
    1.0's lines, for as long as it goes on), and yields its holes as zeros no limit on the stream counts."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED_HEADERS and self.size > MAX_TAR_HEADER:
            raise tarfile.HeaderError(f"an extended tar header (a long name or pax record) of {self.size} "
                                      f"bytes, past the {MAX_TAR_HEADER} a path or a few attributes need")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _SparseEntryError(self.name)
        return super()._proc_member(tar)  # type: ignore[misc]

    def _proc_gnusparse_00(self, next_member: tarfile.TarInfo, pax: dict[str, str], *_: object) -> None:
        """What tarfile's ``_proc_pax`` calls, once it has read the next header, to read the sparse map
        that a pax header's records name (GNU's versions 0.0, 0.1 and 1.0: all three are this)."""
        raise _SparseEntryError(pax.get("GNU.sparse.name") or next_member.name)

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00

    def _apply_pax_info(self, pax_headers: dict[str, str], *args: object) -> None:
        """Refuse the records of a sparse file (a realsize or name without a map among them)."""
        if any(key.startswith("GNU.sparse.") for key in pax_headers):
            name = pax_headers.get("GNU.sparse.name") or pax_headers.get("path") or self.name
            raise _SparseEntryError(name)
        super()._apply_pax_info(pax_headers, *args)  # type: ignore[misc]


def _parts(member: str) -> list[str]:
    """A tar entry's path as its parts, without a leading ``/`` or ``.`` parts."""
    return [p for p in PurePosixPath(member.lstrip("/")).parts if p != "."]


def disk_member_name(member: str, where: str) -> str | None:
    """The file name when a tar member is a disk under ``disk/`` (or ``/disk/``), else ``None``.

    :raise ImageError: (code ``unsafe_path``) for a member under ``disk/`` that climbs out with ``..``.
    """
    parts = _parts(member)
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
