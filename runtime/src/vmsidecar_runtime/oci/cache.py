"""The digest-keyed disk cache.

Layout under the cache root::

    disks/sha256-<hex>.<qcow2|raw>   decompressed disks, mode 0444, never reopened for writing
    index.json                       key -> entry: which disk a layer/manifest/file resolves to
    tmp/                             downloads in progress (same filesystem, so os.replace is atomic)
    locks/                           one flock file per download key, plus index.lock

Keys in ``index.json``: ``layer:<blob digest>``, ``ref:<manifest or index digest>@<arch>`` and
``file:<realpath>:<dev>:<ino>:<size>:<mtime_ns>``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from vmsidecar_contract.errors import HostError
from vmsidecar_runtime.image.sniff import DiskFormat


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
        """The entry for ``key`` if its disk file is still present with the right size."""
        raw = self._read_index().get(key)
        if not raw:
            return None
        try:
            entry = CacheEntry(**raw)
            st = self.disk_path(entry.disk, entry.format).stat()
        except (TypeError, OSError):
            return None
        return entry if st.st_size == entry.size else None

    def record(self, keys: list[str], entry: CacheEntry) -> None:
        """Map every key in ``keys`` to ``entry`` (read-modify-write under the index lock)."""
        with self.lock("index"):
            index = self._read_index()
            for key in keys:
                index[key] = asdict(entry)
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
        if dest.exists():
            tmp.unlink(missing_ok=True)
            return dest
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.replace(tmp, dest)
        return dest

    def clean_stale(self) -> None:
        """Remove temporary files left by processes that no longer exist."""
        for path in self.tmp.iterdir():
            pid_text = path.name.split(".", 1)[0]
            if not pid_text.isdigit() or _pid_alive(int(pid_text)):
                continue
            with contextlib.suppress(OSError):
                path.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True
