"""The digest-keyed disk cache.

Layout under the cache root::

    disks/sha256-<hex>.<qcow2|raw>   decompressed disks, mode 0444, never reopened for writing
    index.json                       key -> entry: which disk a layer/manifest/file resolves to
    tmp/                             downloads in progress (same filesystem, so os.replace is atomic),
                                     named by their process's owner token
    locks/                           one flock file per download key, plus index.lock, and
                                     tmp-owner.<token>.lock, held by the process that owns tmp/<token>.*

Keys in ``index.json``: ``layer:<blob digest>``, ``ref:<manifest or index digest>@<arch>`` and
``file:<realpath>:<dev>:<ino>:<size>:<mtime_ns>``; ``seal:<disk file name>`` holds the disk file's
inode, size, mtime and ctime when its content was last verified against its digest;
``checked:<disk file name>`` the same stat seal when the disk last passed the boot checks
(``image/checks.py``), with the checks' version and limits: a warm start skips ``qemu-img info``
and ``check`` of a file that has not changed since it passed them under the same limits;
``sealed:snapshots/<key>`` the stat seal of every file of a memory snapshot when its content last
matched the snapshot's seal (``snapshots.py``): a warm start hashes only what changed since.

A cache entry is trusted only while its file's stat still matches its seal: any write, truncation
or chmod changes the ctime, and the file is then hashed again; a file that no longer matches its
digest is removed and pulled again. (Bit rot that changes no metadata is the storage's to catch.)

**Budget.** The disks and the memory snapshots (``snapshots/``) together are kept within a budget
(``--cache-budget``, ``VMSIDECAR_CACHE_BUDGET``, default :data:`DEFAULT_BUDGET`): after a disk is
installed or a snapshot committed (and at start), the least recently used items go until the rest
fits. "Used" is recorded in ``index.json`` (``used:disks/<name>``, ``used:snapshots/<key>``) at
every cache hit, install and restore; touching the files would change their ctime and break their
seals. Never evicted: what a runtime process uses — its base image, its flashed-from-a-reference
disk, the snapshot its guest runs on — each held by a shared flock on ``locks/in-use.<item>.lock``
for as long as it is used (released at exit, however the process ends; a lock file, not the disk,
so QEMU's own image locks are never disturbed). Eviction takes that flock exclusively first and
skips the item when it cannot. Runtimes sharing a cache volume see each other's locks.

**Temporary files** are named by a random token of their process, which holds
``locks/tmp-owner.<token>.lock`` exclusively while it lives: a pull removes the files of a token whose
lock it can take (their process ended, however). A PID in the name said nothing to a runtime in
another pod (another PID namespace): it removed a live runtime's download as an orphan.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import HostError
from vmsidecar_runtime import metrics
from vmsidecar_runtime.image.digest import sha256_digest
from vmsidecar_runtime.image.limits import parse_size
from vmsidecar_runtime.image.sniff import DiskFormat

log = logging.getLogger(__name__)

#: this process's token on its temporary files (see the module's docstring)
_OWNER = secrets.token_hex(8)
#: the fd of this process's owner lock, per cache's locks directory
_owner_locks: dict[Path, int] = {}

GiB = 1 << 30
#: what the image cache (disks and memory snapshots) may hold when nothing else is said
DEFAULT_BUDGET = 20 * GiB
BUDGET_ENV = "VMSIDECAR_CACHE_BUDGET"
_budget: int | None = None


def set_budget(size: int | None) -> None:
    """The budget of every cache this process opens (``serve --cache-budget``); None: the default."""
    global _budget
    _budget = size


def configure_budget(flag: str | None) -> int:
    """Set this process's budget from ``--cache-budget`` (else the environment, else the default).

    :raise HostError: for a value that is not a size, naming where it came from.
    """
    if flag is None:
        set_budget(None)
        return cache_budget()
    try:
        size = parse_size(flag)
    except ValueError as e:
        raise HostError(f"--cache-budget: {e}") from None
    set_budget(size)
    return size


def cache_budget() -> int:
    """The budget in force: :func:`set_budget`, else ``VMSIDECAR_CACHE_BUDGET``, else the default.

    :raise HostError: for an environment value that is not a size.
    """
    if _budget is not None:
        return _budget
    value = os.environ.get(BUDGET_ENV)
    if not value:
        return DEFAULT_BUDGET
    try:
        return parse_size(value)
    except ValueError as e:
        raise HostError(f"{BUDGET_ENV}: {e}") from None


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
        #: the owner lock's key: one per directory however it is named (flock conflicts in-process)
        self._locks_key = self.locks.resolve()
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
        self.touch(f"disks/{path.name}")
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

    def passed_checks(self, path: Path, verdict: str) -> bool:
        """Whether the disk file ``path`` passed the boot checks as ``verdict`` names them (their
        version and limits) and has not changed since (its stat seal)."""
        try:
            st = path.stat()
        except OSError:
            return False
        return self._read_index().get(f"checked:{path.name}") == {"seal": stat_seal(st), "verdict": verdict}

    def record_checks(self, path: Path, verdict: str) -> None:
        """The disk file ``path``, as it is now, passed the boot checks named by ``verdict``."""
        with contextlib.suppress(OSError):
            self._update_index({f"checked:{path.name}": {"seal": stat_seal(path.stat()), "verdict": verdict}})

    def snapshot_seals(self, item: str) -> dict[str, Any] | None:
        """The ``sealed:`` record of the snapshot ``item`` (``snapshots/<key>``), if any."""
        value = self._read_index().get(f"sealed:{item}")
        return value if isinstance(value, dict) else None

    def record_snapshot_seals(self, item: str, record: dict[str, Any]) -> None:
        """The files of the snapshot ``item``, as ``record`` states them, matched its seal."""
        with contextlib.suppress(OSError):
            self._update_index({f"sealed:{item}": record})

    def drop_records(self, keys: list[str]) -> None:
        """Remove ``keys`` from the index (those it has)."""
        with contextlib.suppress(OSError), self.lock("index"):
            index = self._read_index()
            if any(key in index for key in keys):
                for key in keys:
                    index.pop(key, None)
                tmp = self._tmp_name(".index.json")
                tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
                os.replace(tmp, self.index_path)

    def record(self, keys: list[str], entry: CacheEntry) -> None:
        """Map every key in ``keys`` to ``entry`` (read-modify-write under the index lock)."""
        self._update_index({key: asdict(entry) for key in keys})

    def _seal(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            self._update_index({_seal_key(path): stat_seal(path.stat())})

    def _update_index(self, updates: dict[str, Any]) -> None:
        with self.lock("index"):
            index = self._read_index()
            index.update(updates)
            tmp = self._tmp_name(".index.json")
            tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
            os.replace(tmp, self.index_path)

    def _read_index(self) -> dict[str, Any]:
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
        """A fresh name under ``tmp/``; its owner token lets :meth:`clean_stale` find orphans."""
        return self._tmp_name(suffix)

    def _tmp_name(self, suffix: str) -> Path:
        locks = self._locks_key
        if locks not in _owner_locks:  # (taken before the process's first temporary file)
            fd = os.open(locks / f"tmp-owner.{_OWNER}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            _owner_locks[locks] = fd
        return self.tmp / f"{_OWNER}.{secrets.token_hex(8)}{suffix}"

    def install(self, tmp: Path, digest: str, fmt: DiskFormat) -> Path:
        """Make a verified temporary disk visible: fsync, chmod 0444, then ``os.replace``.

        If the same disk is already in place (another reference, another process) the
        temporary file is dropped and the existing one kept.
        """
        dest = self.disk_path(digest, fmt)
        if dest.exists() and self.intact(dest, digest):  # a damaged one was removed: replace it
            tmp.unlink(missing_ok=True)
            return dest
        fsync_file(tmp)  # (after unpack_blob's, beside its checks: nothing is left to write)
        os.chmod(tmp, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.replace(tmp, dest)
        self._seal(dest)  # its digest was verified while it was written
        self.touch(f"disks/{dest.name}")
        self.evict(keep={f"disks/{dest.name}"})  # the caller is about to use it
        return dest

    # ---- budget: last use, in-use locks, eviction ------------------------------------------
    def touch(self, item: str) -> None:
        """Record that ``item`` (``disks/<name>`` or ``snapshots/<key>``) was used now."""
        with contextlib.suppress(OSError):
            self._update_index({f"used:{item}": time.time()})

    def evict(self, budget: int | None = None, keep: Iterable[str] = ()) -> list[str]:
        """Remove least recently used disks and snapshots until the cache fits ``budget`` (default:
        :func:`cache_budget`); never ``keep`` nor an item some process holds in use. Returns what went."""
        budget = cache_budget() if budget is None else budget
        removed: list[str] = []
        with self.lock("evict"):
            index = self._read_index()
            items = self._items(index)
            total = sum(size for _, size, _ in items)
            if total <= budget:
                return removed
            for item, size, _ in sorted(items, key=lambda i: i[2]):
                if total <= budget:
                    break
                if item in keep or not self._remove_unused(item):
                    continue
                total -= size
                removed.append(item)
            self._forget(removed)
        metrics.cache_evictions.inc(len(removed))
        if removed:
            log.info("image cache over its budget of %s: evicted %s (least recently used)",
                     _human(budget), ", ".join(removed))
        if total > budget:
            log.warning("the image cache holds %s in use, more than its budget of %s; raise --cache-budget "
                        "(%s) or give the cache volume more room", _human(total), _human(budget), BUDGET_ENV)
        return removed

    def size(self) -> int:
        """Bytes on disk of the disks and snapshots (what the budget counts)."""
        return sum(size for _, size, _ in self._items({}))

    def _items(self, index: dict[str, Any]) -> list[tuple[str, int, float]]:
        """(item, bytes on disk, last use) of every disk and complete-or-not snapshot directory."""
        found = []
        snapshots = self.root / "snapshots"
        dirs = [("disks", self.disks), ("snapshots", snapshots)]
        for kind, where in dirs:
            with contextlib.suppress(OSError):
                for path in where.iterdir():
                    if path.name.startswith("."):
                        continue  # a capture or a removal under way
                    with contextlib.suppress(OSError):
                        files = list(path.iterdir()) if path.is_dir() else [path]
                        size = sum(f.stat().st_blocks * 512 for f in files)
                        used = index.get(f"used:{kind}/{path.name}")
                        found.append((f"{kind}/{path.name}", size,
                                      used if isinstance(used, (int, float)) else path.stat().st_mtime))
        return found

    def _remove_unused(self, item: str) -> bool:
        """Remove ``item`` unless a process holds it in use (its in-use lock)."""
        fd = os.open(self.locks / f"in-use.{item.replace('/', '.')}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            path = self.root / item
            if path.is_dir():
                remove_tree(path)
            else:
                path.unlink(missing_ok=True)
            return not path.exists()
        finally:
            os.close(fd)

    def _forget(self, removed: list[str]) -> None:
        """Drop the index entries of removed disks (every key resolving to them) and snapshots."""
        if not removed:
            return
        with self.lock("index"):
            index = self._read_index()
            gone = {name.split("/", 1)[1] for name in removed}
            for key, value in list(index.items()):
                target = key.split(":", 1)[1] if key.startswith(("used:", "seal:", "checked:", "sealed:")) else None
                if target is not None:
                    drop = target in removed or target in gone
                else:
                    disk = value.get("disk") if isinstance(value, dict) else None
                    drop = isinstance(disk, str) and any(n.startswith(disk.replace(":", "-") + ".") for n in gone)
                if drop:
                    del index[key]
            tmp = self._tmp_name(".index.json")
            tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
            os.replace(tmp, self.index_path)

    def clean_stale(self) -> None:
        """Remove the temporary files of processes that ended: those whose owner lock is free (or gone)."""
        owned: dict[str, list[Path]] = {}
        for path in self.tmp.iterdir():
            owned.setdefault(path.name.split(".", 1)[0], []).append(path)
        for lock in self.locks.glob("tmp-owner.*.lock"):  # (a process that ended with no file left too)
            owned.setdefault(lock.name.split(".")[1], [])
        owned.pop(_OWNER, None)
        for owner, paths in owned.items():
            lock = self.locks / f"tmp-owner.{owner}.lock"
            try:
                fd: int | None = os.open(lock, os.O_RDWR)
            except OSError:
                fd = None  # no owner lock: a process that ended (or a runtime before owner tokens)
            try:
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # its process lives, in this pod or another
                for path in paths:
                    with contextlib.suppress(OSError):
                        path.unlink()
                if fd is not None:
                    with contextlib.suppress(OSError):
                        lock.unlink()
            finally:
                if fd is not None:
                    os.close(fd)


class InUse:
    """What this process uses from caches: shared flocks on their in-use lock files (see the module's
    docstring), held until :meth:`hold` is called without them or the process ends."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def hold(self, cache: DiskCache, items: Iterable[str]) -> None:
        """Hold exactly ``items`` (``disks/<name>``, ``snapshots/<key>``) of ``cache`` from now on."""
        wanted = {str(cache.locks / f"in-use.{item.replace('/', '.')}.lock"): item for item in items}
        for lock_path in set(self._held) - set(wanted):
            os.close(self._held.pop(lock_path))
        for lock_path, item in wanted.items():
            if lock_path in self._held:
                continue
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                log.warning("cannot mark %s in use (%s): another runtime's eviction may remove it", item, e.strerror)
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out an eviction deciding on it at this instant
            self._held[lock_path] = fd
            cache.touch(item)


#: this process's in-use marks (one runtime per process)
IN_USE = InUse()


def remove_tree(path: Path) -> None:
    """``rm -rf`` of a directory that may be sealed read-only (0555 directories, 0444 files)."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o755)
    with contextlib.suppress(OSError):
        for sub in path.iterdir():
            if sub.is_dir() and not sub.is_symlink():
                os.chmod(sub, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def _human(size: int) -> str:
    return f"{size / GiB:.1f} GiB" if size >= GiB else f"{size / (1 << 20):.1f} MiB"


def _seal_key(path: Path) -> str:
    return f"seal:{path.name}"


def fsync_file(path: Path) -> None:
    """Wait until the kernel has written ``path``'s data to its disk (``OSError`` if it could not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


