"""The digest-keyed disk cache.

Layout under the cache root::

    disks/sha256-<hex>.<qcow2|raw>   decompressed disks, mode 0444, never reopened for writing
    index.json                       key -> entry: which disk a layer/manifest/file resolves to
    tmp/                             downloads in progress (same filesystem, so os.replace is atomic)
    locks/                           one flock file per download key, plus index.lock

Keys in ``index.json``: ``layer:<blob digest>``, ``ref:<manifest or index digest>@<arch>`` and
``file:<realpath>:<dev>:<ino>:<size>:<mtime_ns>``; ``seal:<disk file name>`` holds the disk file's
inode, size, mtime and ctime when its content was last verified against its digest.

A cache entry is trusted only while its file's stat still matches its seal: any write, truncation
or chmod changes the ctime, and the file is then hashed again; a file that no longer matches its
digest is removed and pulled again. (Bit rot that changes no metadata is the storage's to catch.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from vmsidecar_contract.errors import HostError
from vmsidecar_runtime.image.digest import sha256_digest
from vmsidecar_runtime.image.sniff import DiskFormat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheEntry:
    """What a cache key resolves to."""

    disk: str  # "sha256:<hex>" of the uncompressed disk
    format: DiskFormat
    size: int
    manifest_digest: str | None = None
    arch: str | None = None
    #: the image's ``io.vmsidecar.*`` annotations (``ref:`` keys); None in entries written before
    #: annotations were kept, which a pull therefore resolves again
    annotations: dict[str, str] | None = None


class DiskCache:
    """A cache root; safe to share between threads and processes (flock + atomic renames)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.disks = self.root / "disks"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"
        self.index_path = self.root / "index.json"
        try:
            for d in (self.disks, self.tmp, self.locks):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HostError(
                f"cannot create the image cache under {self.root} ({exc.strerror}); "
                "make it writable by the runtime's user or pass another --cache-dir (VMSIDECAR_CACHE_DIR)"
            ) from exc

    def disk_path(self, digest: str, fmt: DiskFormat) -> Path:
        """Where the disk with this uncompressed digest lives."""
        return self.disks / f"{digest.replace(':', '-')}.{fmt}"

    def lookup(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` if its disk file is still present, with the right size and content
        (see :meth:`intact`); a corrupted file is removed, so the caller pulls it again."""
        raw = self._read_index().get(key)
        if not raw:
            return None
        try:
            entry = CacheEntry(**raw)
            path = self.disk_path(entry.disk, entry.format)
            st = path.stat()
        except (TypeError, OSError):
            return None
        if st.st_size != entry.size or not self.intact(path, entry.disk):
            return None
        return entry

    def intact(self, path: Path, digest: str) -> bool:
        """Whether the disk file ``path`` still holds the content ``digest`` names.

        Cheap while the file's stat matches its seal; otherwise the file is hashed: a match is
        sealed again, a mismatch is removed (and logged) so that nothing ever boots from it.
        """
        try:
            st = path.stat()
        except OSError:
            return False
        if self._read_index().get(_seal_key(path)) == stat_seal(st):
            return True
        if hash_file(path) == digest:
            self._seal(path)
            return True
        log.warning("cache entry %s does not match its digest %s (corrupted or altered on disk); removing it "
                    "and pulling it again", path, digest)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return False

    def record(self, keys: list[str], entry: CacheEntry) -> None:
        """Map every key in ``keys`` to ``entry`` (read-modify-write under the index lock)."""
        self._update_index({key: asdict(entry) for key in keys})

    def _seal(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            self._update_index({_seal_key(path): stat_seal(path.stat())})

    def _update_index(self, updates: dict[str, dict]) -> None:
        with self.lock("index"):
            index = self._read_index()
            index.update(updates)
            tmp = self.tmp / f"{os.getpid()}.index.{secrets.token_hex(4)}.json"
            tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
            os.replace(tmp, self.index_path)

    def _read_index(self) -> dict[str, dict]:
        try:
            data = json.loads(self.index_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive flock on ``locks/<name>.lock`` (blocks; works across threads and processes)."""
        safe = hashlib.sha256(name.encode()).hexdigest()[:32] if not name.isalnum() else name
        fd = os.open(self.locks / f"{safe}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def tmp_path(self, suffix: str = ".part") -> Path:
        """A fresh name under ``tmp/``; the pid in it lets :meth:`clean_stale` find orphans."""
        return self.tmp / f"{os.getpid()}.{secrets.token_hex(8)}{suffix}"

    def install(self, tmp: Path, digest: str, fmt: DiskFormat) -> Path:
        """Make a verified temporary disk visible: fsync, chmod 0444, then ``os.replace``.

        If the same disk is already in place (another reference, another process) the
        temporary file is dropped and the existing one kept.
        """
        dest = self.disk_path(digest, fmt)
        if dest.exists() and self.intact(dest, digest):  # a damaged one was removed: replace it
            tmp.unlink(missing_ok=True)
            return dest
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.replace(tmp, dest)
        self._seal(dest)  # its digest was verified while it was written
        return dest

    def clean_stale(self) -> None:
        """Remove temporary files left by processes that no longer exist."""
        for path in self.tmp.iterdir():
            pid_text = path.name.split(".", 1)[0]
            if not pid_text.isdigit() or _pid_alive(int(pid_text)):
                continue
            with contextlib.suppress(OSError):
                path.unlink()


def _seal_key(path: Path) -> str:
    return f"seal:{path.name}"


def stat_seal(st: os.stat_result) -> dict:
    """A file's stat seal: what changes when anything writes to, truncates or chmods a file (ctime cannot be set back)."""
    return {"ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def hash_file(path: Path) -> str:
    """``sha256:<hex>`` of a file's content ("sha256:" of nothing when it cannot be read)."""
    h = hashlib.sha256()
    with contextlib.suppress(OSError), open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return sha256_digest(h)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True
