"""A reproducible ``newc`` cpio writer (the initramfs format), no root needed for device nodes."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_TRAILER = "TRAILER!!!"


@dataclass(frozen=True)
class Entry:
    """One archive member: ``path`` is relative (no leading ``/``)."""

    path: str
    mode: int  # full st_mode (type | permissions)
    data: bytes = b""  # file content or symlink target
    rdev: tuple[int, int] = (0, 0)


def _header(ino: int, e: Entry, mtime: int, namesize: int) -> bytes:
    fields = (
        ino,
        e.mode,
        0,  # uid
        0,  # gid
        2 if stat.S_ISDIR(e.mode) else 1,  # nlink
        mtime,
        len(e.data),
        0,  # devmajor
        0,  # devminor
        e.rdev[0],
        e.rdev[1],
        namesize,
        0,  # check
    )
    return b"070701" + b"".join(f"{v:08X}".encode() for v in fields)


def _pad(n: int) -> bytes:
    return b"\0" * (-n % 4)


def write_cpio(out: BinaryIO, entries: list[Entry], *, mtime: int) -> None:
    """Write ``entries`` sorted by path (parents first), owned by root, all stamped ``mtime``."""
    for ino, e in enumerate(sorted(entries, key=lambda e: e.path), start=1):
        name = e.path.encode() + b"\0"
        head = _header(ino, e, mtime, len(name)) + name
        out.write(head + _pad(len(head)))
        out.write(e.data + _pad(len(e.data)))
    name = _TRAILER.encode() + b"\0"
    head = _header(0, Entry(_TRAILER, 0), 0, len(name)) + name
    out.write(head + _pad(len(head)))


def entries_from_tree(root: Path) -> list[Entry]:
    """Entries for everything under ``root``, with normalised permissions.

    Directories 0755, symlinks 0777, regular files 0755 when any execute bit is set else 0644.
    """
    entries: list[Entry] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                entries.append(Entry(rel, stat.S_IFLNK | 0o777, os.readlink(full).encode()))
            elif stat.S_ISDIR(st.st_mode):
                entries.append(Entry(rel, stat.S_IFDIR | 0o755))
            elif stat.S_ISREG(st.st_mode):
                perm = 0o755 if st.st_mode & 0o111 else 0o644
                entries.append(Entry(rel, stat.S_IFREG | perm, full.read_bytes()))
            else:
                raise ValueError(f"{full}: only files, directories and symlinks can be staged")
    return entries


def char_device(path: str, major: int, minor: int, perm: int = 0o600) -> Entry:
    return Entry(path, stat.S_IFCHR | perm, rdev=(major, minor))


def read_cpio(data: bytes) -> dict[str, Entry]:
    """Parse a newc archive (for tests and inspection)."""
    out: dict[str, Entry] = {}
    pos = 0
    while True:
        if data[pos : pos + 6] != b"070701":
            raise ValueError(f"not a newc cpio header at offset {pos}")
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, filesize, rmaj, rmin, namesize = fields[1], fields[6], fields[9], fields[10], fields[11]
        pos += 110
        name = data[pos : pos + namesize - 1].decode()
        pos += namesize
        pos += -pos % 4
        if name == _TRAILER:
            return out
        body = data[pos : pos + filesize]
        pos += filesize
        pos += -pos % 4
        out[name] = Entry(name, mode, body, (rmaj, rmin))
