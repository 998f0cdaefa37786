"""Writing a decompressed guest disk to a file: format decided, header checked, bytes hashed.

:func:`write_disk` decides the format from the first decompressed bytes (qcow2 magic, MBR/GPT
boot signature, ext2/3/4 superblock), refuses a qcow2 header that names another host file or
claims too large a disk before anything is written, then writes and hashes the disk. The file
still has to pass :func:`.checks.check_image`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .checks import check_qcow2_header, empty_error, parse_qcow2_header
from .decompress import CHUNK
from .digest import sha256_digest
from .limits import DEFAULT_LIMITS, Limits, Origin
from .sniff import SNIFF_BYTES, ByteSource, DiskFormat, decide_format, read_at_least


@dataclass(frozen=True)
class WrittenDisk:
    """A disk written by :func:`write_disk`, still to be checked with :func:`.checks.check_image`."""

    path: Path
    format: DiskFormat
    digest: str  # sha256 of the (decompressed) bytes written
    size: int


def write_disk(
    stream: ByteSource,
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
    head = read_at_least(stream, SNIFF_BYTES)
    if not head:
        raise empty_error(origin)
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
