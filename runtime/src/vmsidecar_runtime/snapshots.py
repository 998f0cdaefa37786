"""Memory snapshots of a pristine, Ready guest: what a recycle restores instead of booting.

A snapshot is the guest's RAM and device state (a QEMU migration stream), the disk overlay
frozen at the same instant, the consoles' scrollback of the boot that led to it, and what was
found out about the guest at capture (``meta.json``: whether a guest agent answered). It lives
in the image cache (``<cache>/snapshots/<key>/``), read-only, written once into a temp
directory and renamed into place, and is never written during a lease: each restore boots a
fresh overlay on top of the frozen one.

The key covers everything that must match for QEMU to accept the stream and for the guest to
be the same pristine guest: the image digest, the spec (devices, memory, CPUs …) with the
effective readiness (which decides the instant of capture, and may come from the image's
annotations rather than the spec), the QEMU binary's version, the accelerator and the CPU model. A snapshot that QEMU refuses
anyway is discarded and the guest boots cold.

Two forms (``SnapshotMeta.form``, part of the key):

- **templated** (the default): the guest's RAM is a file of its own, ``ram``. The boot that
  captures already runs with its RAM in that file (shared), so the capture writes only the
  device state to ``memory``; each restore maps ``ram`` privately (copy-on-write) and loads the
  device state. Every instance restored from it shares the file's unwritten pages in the page
  cache, and a restore costs the same whatever the guest's RAM.
- **stream**: ``memory`` holds the RAM too (QEMU's migration stream); the fallback where guest
  RAM cannot be a private file mapping (``FORM_REASONS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import secrets
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from blake3 import blake3

from vmsidecar_contract.errors import HostError, ImageError
from vmsidecar_contract.spec import Readiness, VmSpec
from vmsidecar_contract.state import FORM_REASON_GPIO, FORM_REASON_RUNTIME

from . import procs
from .backend.common import qemu_binary
from .disk import DiskImage
from .image.checks import read_qcow2_header
from .image.limits import Origin
from .oci.cache import IN_USE, DiskCache, hash_file, remove_tree, stat_seal

log = logging.getLogger(__name__)

#: bump when the layout or the meaning of a snapshot changes: older ones are then never matched
#: (2: every QEMU has the guest agent's port; the snapshot has meta.json; 3: sealed; 4: templated
#: form, the agent's port has a device id; 5: the RAM file's seal is BLAKE3)
FORMAT = 5
TEMPLATED = "templated"
STREAM = "stream"
#: a RAM file's seal hashes it in chunks: a chunk in a hole (guest RAM never written, not on disk)
#: is not read, its digest is the zero chunk's; the digest depends on the content only
RAM_CHUNK = 4 << 20
#: the copy of a RAM file leaves holes this long or longer as holes (shorter ones are written as zeros)
RAM_GAP = 64 << 10
RAM_DIGEST = "blake3-4m:"
#: ``stream`` makes this runtime capture full-stream snapshots (a pool owner's choice: a cache
#: volume whose files should not be mapped by every instance, e.g. a network file system)
FORM_ENV = "VMSIDECAR_SNAPSHOT_FORM"
#: a console's scrollback at capture is the file ``<console>.console``
CONSOLE_SUFFIX = ".console"
#: consoles whose scrollback a restored guest shows
CONSOLES = ("ttyS0", "hvc0")


_version_lock = threading.Lock()


def qemu_version(arch: str) -> str:
    """``qemu-system-ARCH --version`` (first line), or "" when it cannot be run; run once per
    process (``serve`` starts it in a thread at once: a caller meanwhile waits for that run)."""
    with _version_lock:
        return _qemu_version(arch)


@functools.cache
def _qemu_version(arch: str) -> str:
    try:
        _, out, _ = procs.run(qemu_binary(arch), "--version", timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.splitlines()[0] if out else ""


#: spec fields outside the key: whether and where snapshots are looked for change no guest, and
#: the CPU model is in the key as the effective one (a spec naming the default shares its key)
KEY_EXCLUDES = {"snapshot", "libvirt_uri", "snapshot_source", "cpu", "standby"}


def snapshot_key(spec: VmSpec, image_digest: str, accel: str, cpu: str, readiness: Readiness | None = None,
                 form: str = TEMPLATED) -> str:
    """The cache key of the snapshot of ``spec`` booted from ``image_digest``, captured when
    ``readiness`` (default: the spec's) was met, in ``form``."""
    material = {
        "form": form,
        "format": FORMAT,
        "image": image_digest,
        "spec": spec.model_dump(mode="json", exclude=KEY_EXCLUDES)
        | {"readiness": (readiness or spec.readiness).model_dump(mode="json")},
        "qemu": qemu_version(spec.arch),
        "accel": accel,
        "cpu": cpu,
    }
    if files := boot_file_digests(spec):  # only where there are: the keys of other specs stay as they were
        material["boot_files"] = files
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


#: path -> (stat seal, digest) of the files specs boot from, so a recycle hashes nothing again
_BOOT_FILE_DIGESTS: dict[str, tuple[dict, str]] = {}


def boot_file_digests(spec: VmSpec) -> dict[str, str]:
    """The content of each file ``spec`` boots from (``kernel``, ``initrd``: a path in the spec), by
    field: a file rebuilt at its path is another key, not the snapshot of the one before. Hashed
    again only when its stat seal moved; a file that cannot be read is "missing" (its boot fails)."""
    digests = {}
    for name, path in (("kernel", spec.kernel), ("initrd", spec.initrd)):
        if path is None:
            continue
        try:
            seal = stat_seal(os.stat(path))
        except OSError:
            digests[name] = "missing"
            continue
        known = _BOOT_FILE_DIGESTS.get(str(path))
        if known is None or known[0] != seal:
            known = _BOOT_FILE_DIGESTS[str(path)] = (seal, hash_file(Path(path)))
        digests[name] = known[1]
    return digests


def snapshot_form(spec: VmSpec) -> tuple[str, str | None]:
    """The form of ``spec``'s snapshot on this runtime, and why it is not templated."""
    if spec.gpio:
        # vhost-user maps guest RAM shared with its backend process for the instance's whole life:
        # a restored instance would write into the template every instance maps
        return STREAM, FORM_REASON_GPIO
    if os.environ.get(FORM_ENV, TEMPLATED) == STREAM:
        return STREAM, FORM_REASON_RUNTIME
    return TEMPLATED, None


@dataclass(frozen=True)
class SnapshotMeta:
    """What the capture found out about the guest."""

    #: a guest agent answered at capture: a restore sets the guest's clock through it
    guest_agent: bool = False
    #: the seal: ``sha256:<hex>`` of every other file of the snapshot, at commit (``ram``: ``RAM_DIGEST``)
    files: dict[str, str] = field(default_factory=dict)
    #: ``TEMPLATED`` (RAM in ``ram``) or ``STREAM`` (RAM in the migration stream)
    form: str = STREAM


@dataclass(frozen=True)
class Snapshot:
    """One snapshot directory."""

    path: Path

    @property
    def memory(self) -> Path:
        """The migration stream: device state, and the RAM unless the snapshot is templated."""
        return self.path / "memory"

    @property
    def ram(self) -> Path:
        """A templated snapshot's guest RAM (a restore maps it privately)."""
        return self.path / "ram"

    @property
    def disk(self) -> Path:
        """The overlay frozen at capture time (its backing file is the base image)."""
        return self.path / "disk.qcow2"

    @property
    def meta_file(self) -> Path:
        """``meta.json``: a ``SnapshotMeta``."""
        return self.path / "meta.json"

    def meta(self) -> SnapshotMeta | None:
        """The capture's findings; None when the file is missing or unreadable."""
        try:
            data = json.loads(self.meta_file.read_text())
            files = data["files"]
            if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                return None
            form = data.get("form", STREAM)
            if form not in (TEMPLATED, STREAM):
                return None
            return SnapshotMeta(guest_agent=bool(data["guest_agent"]), files=files, form=form)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def console(self, name: str) -> bytes:
        """The scrollback ``name`` showed at capture time."""
        try:
            return (self.path / f"{name}{CONSOLE_SUFFIX}").read_bytes()
        except FileNotFoundError:
            return b""

    @property
    def size(self) -> int:
        """Bytes on disk (a RAM file's holes, RAM the guest never wrote, take none)."""
        return sum(p.stat().st_blocks * 512 for p in self.path.iterdir())


#: the files of a snapshot QEMU does not read as it starts (the RAM file is mapped, not read; the stream
#: is read once handed over): their seal check may run while QEMU starts (``SnapshotStore.verify``)
LOADED_ON_DEMAND = frozenset({"memory", "ram"})


@dataclass
class _Checked:
    """What this process verified of one snapshot directory."""

    dir_ino: int
    digests: dict[str, str]
    seals: dict[str, dict]


class SnapshotStore:
    """The snapshots in one cache directory."""

    def __init__(self, cache: Path) -> None:
        self.root = cache / "snapshots"
        self._cache = cache
        #: the disks the last :meth:`hold` marked in use (a snapshot committed later joins them)
        self._held_disks: list[DiskImage | None] = []
        #: the snapshot held with them (:meth:`hold`)
        self.held_snapshot: Snapshot | None = None
        #: snapshot path -> what this process hashed and found matching (see the module's docstring)
        self._checked: dict[str, _Checked] = {}
        #: staging directory -> the fd of its lock, held while this process may still commit it
        self._staging_locks: dict[Path, int] = {}

    def find(self, key: str) -> Snapshot | None:
        """The complete snapshot for ``key``, if the cache has one (an incomplete one is
        captured again at the next cold boot's Ready: ``commit`` replaces it). Not yet checked:
        :meth:`verify` before QEMU loads it."""
        snap = Snapshot(self.root / key)
        meta = snap.meta() if snap.memory.is_file() and snap.disk.is_file() else None
        complete = meta is not None and (meta.form != TEMPLATED or snap.ram.is_file())
        return snap if complete else None

    def staging(self, key: str) -> Snapshot:
        """A fresh, empty directory to capture into (renamed into place by ``commit``).

        Unique per capture, not per pid: runtimes in two pods sharing one cache volume are both
        pid 1.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_abandoned_staging()
        # the lock first, then the directory: a directory whose lock no process holds is abandoned
        name = f".incoming-{key}-{secrets.token_hex(6)}"
        cache = DiskCache(self._cache)
        fd = os.open(cache.locks / f"staging.{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = self.root / name
        try:
            path.mkdir(mode=0o700)
        except OSError:
            os.close(fd)
            raise
        self._staging_locks[path] = fd
        return Snapshot(path)

    def _release_staging(self, path: Path) -> None:
        """The staging directory ``path`` is committed or gone: its lock goes too."""
        fd = self._staging_locks.pop(path, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(DiskCache(self._cache).locks / f"staging.{path.name}.lock")
            os.close(fd)

    def wait_for(self, key: str, timeout: float, waiting: Callable[[], None] | None = None) -> Snapshot | None:
        """The snapshot for ``key``, once a live runtime capturing it has stored it (a capture is
        stored just after that runtime's Ready; a cold boot that is to capture one holds its staging
        from its start); None at once when no capture of ``key`` is under way, or after ``timeout``.
        ``waiting`` is called once if it has to wait."""
        deadline = time.monotonic() + timeout
        while (snap := self.find(key)) is None and self._capture_under_way(key) and time.monotonic() < deadline:
            if waiting is not None:
                waiting()
                waiting = None
            time.sleep(0.1)
        return snap

    def _capture_under_way(self, key: str) -> bool:
        """Whether a live process holds the lock of a staging directory of ``key``."""
        locks = DiskCache(self._cache).locks
        for path in self.root.glob(f".incoming-{key}-*"):
            try:
                fd = os.open(locks / f"staging.{path.name}.lock", os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # its runtime holds it
                return True
            finally:
                os.close(fd)
        return False

    def remove_abandoned_staging(self) -> list[str]:
        """Remove the staging directories of captures whose runtime died (SIGKILL, a node's OOM
        killer): a templated capture's holds the RAM of the guest that booted on it. A live runtime's
        is kept: it holds the directory's lock (runtimes of several pods may share the cache)."""
        removed = []
        locks = DiskCache(self._cache).locks
        for path in self.root.glob(".incoming-*"):
            if path in self._staging_locks:
                continue
            lock = locks / f"staging.{path.name}.lock"
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its runtime is alive
                os.close(fd)
                continue
            try:
                remove_tree(path)
                with contextlib.suppress(OSError):
                    os.unlink(lock)
            finally:
                os.close(fd)
            removed.append(path.name)
        if removed:
            log.info("removed the staging of captures whose runtime ended without them: %s", ", ".join(removed))
        return removed

    def commit(self, staged: Snapshot, key: str, consoles: dict[str, bytes], meta: SnapshotMeta,
               hashed: dict[str, tuple[str, dict]] | None = None) -> Snapshot:
        """Make a captured snapshot visible: sealed, read-only files, one atomic rename.

        ``hashed``: file name -> (its seal digest, its stat seal then) for files the caller has just
        hashed; each is taken as it is while its stat is the same, not hashed a second time.

        Blocking (it hashes every file): call it in a thread from asyncio.

        Runtimes sharing a cache may capture the same key at once: the first complete snapshot
        wins and is never replaced under a runtime restoring from it (same key, same pristine
        guest); a later capture is dropped and the winner returned.
        """
        for name, data in consoles.items():
            (staged.path / f"{name}{CONSOLE_SUFFIX}").write_bytes(data)
        started = time.monotonic()
        known = hashed or {}

        def digest(item: Path) -> str:
            if item.name in known and known[item.name][1] == stat_seal(item.stat()):
                return known[item.name][0]
            return seal_digest(item)

        files = {item.name: digest(item) for item in staged.path.iterdir() if item != staged.meta_file}
        log.info("snapshot %s sealed in %.2f s", key, time.monotonic() - started)
        staged.meta_file.write_text(json.dumps(asdict(SnapshotMeta(meta.guest_agent, files, meta.form))))
        for item in staged.path.iterdir():
            # QEMU 7.2 opens a memory-backend-file read-write even to map it privately (its
            # readonly=on maps the guest's RAM read-only: a ROM), so a RAM file QEMU's UID cannot
            # write cannot be restored; the seal, not the mode, is what keeps it intact
            os.chmod(item, 0o644 if item == staged.ram else 0o444)
        final = self.root / key
        if (existing := self.find(key)) is None and final.exists():
            # an incomplete or outdated entry: moved aside first, so the rename below is atomic
            with contextlib.suppress(FileNotFoundError):
                trash = Path(tempfile.mkdtemp(prefix=f".trash-{key}-", dir=self.root))
                os.chmod(final, 0o755)  # moving a directory to another parent rewrites its ".."
                os.rename(final, trash / "old")
                remove_tree(trash)
        if existing is None:
            try:
                os.rename(staged.path, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            else:
                self._release_staging(staged.path)
                os.chmod(final, 0o555)
                snap = Snapshot(final)
                self._remember(snap, files)
                self.hold(self._held_disks, snap)  # the boot that captured it goes on from it
                DiskCache(self._cache).evict(keep={f"snapshots/{key}"})
                return snap
            existing = self.find(key)
            if existing is None:
                raise HostError(f"another runtime is writing the snapshot {final} at this instant; "
                                "the next boot takes it")
        log.info("snapshot %s was captured by another runtime sharing the cache first; keeping it", key)
        remove_tree(staged.path)
        self._release_staging(staged.path)
        self.hold(self._held_disks, existing)
        return existing

    def hold(self, disks: list[DiskImage | None], snap: Snapshot | None) -> None:
        """Mark what the next boot uses — its disks (those in the cache) and ``snap`` — in use, so no
        cache eviction removes them while this runtime may still boot from them; drops the marks of
        what an earlier boot used."""
        self._held_disks = list(disks)
        self.held_snapshot = snap
        cache = DiskCache(self._cache)
        items = {f"disks/{d.path.name}" for d in disks if d is not None and d.path.parent == cache.disks}
        if snap is not None:
            items.add(f"snapshots/{snap.path.name}")
        IN_USE.hold(cache, items)

    def verify(self, snap: Snapshot, base: DiskImage, *, defer_loaded: bool = False) -> str | None:
        """Why ``snap`` must not be restored over ``base``, or None when its seal and its frozen
        overlay's header hold.

        ``defer_loaded``: leave :data:`LOADED_ON_DEMAND` to :meth:`verify_deferred`. QEMU opens the
        frozen overlay as it starts, so that is always checked here; it maps the RAM file without
        reading it and reads the memory stream only once handed it (``migrate-incoming``), so their
        hashing, the bulk of the check, may run while QEMU starts, as long as the stream is handed
        over only once :meth:`verify_deferred` passed (``BootPlan.incoming_check``).

        Blocking (the first check in a process hashes every file): call it in a thread.
        """
        deferred = LOADED_ON_DEMAND if defer_loaded else frozenset()
        return self._verify_seal(snap, lambda name: name not in deferred) or _frozen_overlay_problem(snap, base)

    def verify_deferred(self, snap: Snapshot) -> str | None:
        """Why the files :meth:`verify` leaves (:data:`LOADED_ON_DEMAND`) must not reach QEMU, or None
        when they hold the seal of ``snap``. Blocking: call it in a thread."""
        return self._verify_seal(snap, lambda name: name in LOADED_ON_DEMAND)

    def _verify_seal(self, snap: Snapshot, wanted: Callable[[str], bool]) -> str | None:
        """Why the files ``wanted`` picks do not hold the seal of ``snap`` (every sealed file must be
        there, picked or not), or None. A file is hashed once, then trusted while its stat holds:
        within this process, and across processes through the cache index's ``sealed:`` record
        (written only by a runtime that hashed the file or captured it, and void once the file's
        inode, size, mtime or ctime differ: any write or chmod changes its ctime)."""
        meta = snap.meta()
        try:
            dir_ino = snap.path.stat().st_ino
            on_disk = {p.name for p in snap.path.iterdir() if p != snap.meta_file}
        except OSError as e:
            return f"it cannot be read ({e.strerror})"
        if meta is None:
            return "its meta.json (the seal) is missing or unreadable"
        checked = self._checked.get(str(snap.path))
        if checked is not None and checked.dir_ino != dir_ino:
            checked = None  # a new entry in the same place (another runtime captured it again)
        if checked is None:
            checked = self._recorded(snap, meta.files, dir_ino)
        digests = checked.digests if checked else meta.files
        if checked is not None and meta.files != checked.digests:
            return "its recorded sha256 digests (meta.json) were rewritten since this runtime checked them"
        if on_disk != set(digests):
            return f"its files ({', '.join(sorted(on_disk))}) are not the ones sealed at capture"
        seals = dict(checked.seals) if checked else {}  # a partial check keeps what an earlier one verified
        hashed, started = [], time.monotonic()
        for name, digest in sorted(digests.items()):
            if not wanted(name):
                continue
            path = snap.path / name
            try:
                st = path.lstat()  # a link would be followed by whoever reads it next (QEMU, a push)
            except OSError as e:
                return f"{name} cannot be read ({e.strerror})"
            if not stat.S_ISREG(st.st_mode):
                return f"{name} is not a regular file (a link or a special file)"
            seal = stat_seal(st)
            if seals.get(name) != seal:
                hashed.append(name)
                if seal_digest(path) != digest:
                    return f"{name} does not match the {seal_hash(name)} recorded at capture (altered on disk)"
            seals[name] = seal
        if hashed:
            log.info("snapshot %s: %s hashed against its seal in %.2f s", snap.path.name, ", ".join(hashed),
                     time.monotonic() - started)
        self._checked[str(snap.path)] = _Checked(dir_ino, dict(digests), seals)
        if checked is None or seals != checked.seals:  # what the index holds is behind
            self._record(snap, self._checked[str(snap.path)])
        return None

    def _recorded(self, snap: Snapshot, digests: dict[str, str], dir_ino: int) -> _Checked | None:
        """What the cache index records of ``snap`` as verified, if it is about this very directory
        and these digests (a record of an earlier entry at this path, or of other digests, is not)."""
        record = DiskCache(self._cache).snapshot_seals(f"snapshots/{snap.path.name}")
        if record is None or record.get("dir_ino") != dir_ino or record.get("digests") != digests:
            return None
        seals = record.get("seals")
        return _Checked(dir_ino, dict(digests), dict(seals)) if isinstance(seals, dict) else None

    def _record(self, snap: Snapshot, checked: _Checked) -> None:
        DiskCache(self._cache).record_snapshot_seals(f"snapshots/{snap.path.name}", asdict(checked))

    def _remember(self, snap: Snapshot, digests: dict[str, str]) -> None:
        with contextlib.suppress(OSError):
            seals = {name: stat_seal((snap.path / name).stat()) for name in digests}
            self._checked[str(snap.path)] = _Checked(snap.path.stat().st_ino, dict(digests), seals)
            self._record(snap, self._checked[str(snap.path)])

    async def discard(self, snap: Snapshot) -> None:
        """Remove a snapshot QEMU refused, one whose seal broke (or a half-written one)."""
        await asyncio.to_thread(self.discard_now, snap)

    def discard_now(self, snap: Snapshot) -> None:
        """``discard``, blocking (a directory of a few files: unlinking a large RAM file a QEMU still
        maps only drops its name)."""
        self._checked.pop(str(snap.path), None)
        DiskCache(self._cache).drop_records([f"sealed:snapshots/{snap.path.name}"])
        remove_tree(snap.path)
        self._release_staging(snap.path)
        log.info("snapshot %s discarded", snap.path.name)


def seal_digest(path: Path) -> str:
    """A snapshot file's seal digest: ``hash_ram`` for its RAM file, ``hash_file`` for the others."""
    return hash_ram(path) if path.name == "ram" else hash_file(path)


def seal_hash(name: str) -> str:
    """The hash of the seal of the snapshot file ``name``, as messages name it."""
    return "BLAKE3" if name == "ram" else "sha256"


def hash_ram(path: Path) -> str:
    """``RAM_DIGEST<hex>``: the BLAKE3 of the BLAKE3 of every ``RAM_CHUNK`` of a (sparse) RAM file,
    in order; chunks are hashed on every core, holes are not read. Empty hex when it cannot be read.

    BLAKE3, not sha256 as the other files: the capture hashes the RAM with the guest paused, and
    BLAKE3 runs at 6 GB/s on one core of the bench machine where sha256 (SHA-NI) does 1.7."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return RAM_DIGEST
    try:
        return hash_ram_chunks(fd)
    except OSError:
        return RAM_DIGEST
    finally:
        os.close(fd)


def hash_ram_chunks(fd: int, copy_to: int | None = None) -> str:
    """:func:`hash_ram` of the open file ``fd``; with ``copy_to``, each chunk's data is also written
    at the same offset of that file (holes of ``RAM_GAP`` or more stay holes), so one pass over the
    RAM both copies and hashes it, the chunks spread over every core.

    :raise OSError: ``fd`` cannot be read, or ``copy_to`` cannot be written.
    """
    return RAM_DIGEST + blake3(b"".join(_ram_pass(fd, copy_to))).hexdigest()


def copy_ram_chunks(fd: int, copy_to: int, runs: list[tuple[int, int]]) -> None:
    """:func:`hash_ram_chunks`' copy without its hash, of ``runs`` (``ram_copy_runs`` of ``fd``,
    unchanged since): the capture's pause copies the guest's RAM into a memfd that is sealed
    read-only at once and hashed after Ready (``capture_ram.FrozenRam``).

    Copied by the kernel (``copy_file_range``, memory to memory without a pass through this
    process), the runs spread over every core: 0.039-0.042 s where reading each chunk into a buffer and
    writing it out took 0.058 s for the tiny guest's 143 MB (medians of 9).

    :raise OSError: ``fd`` cannot be read, or ``copy_to`` cannot be written.
    """
    def copy(run: tuple[int, int]) -> None:
        offset, end = run
        while offset < end:
            copied = os.copy_file_range(fd, copy_to, end - offset, offset, offset)
            if copied == 0:
                raise OSError(errno.EIO, f"the file ended at offset {offset}")
            offset += copied

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(copy, runs))


def _ram_pass(fd: int, copy_to: int | None) -> list[bytes]:
    """One pass over the chunks of ``fd`` on every core: the BLAKE3 of each, its data written to
    ``copy_to`` at the same offset.

    A chunk with data is read whole, in one call, into a buffer of the thread's own (a call per
    extent of a guest's scattered RAM cost 0.3 s, a new 4 MiB object per chunk more than the hash);
    reading a hole gives zeros without allocating it, even in the memfd a guest runs on.
    """
    size = os.fstat(fd).st_size
    parts = _chunk_parts(_data_extents(fd, size), size)
    buffers = threading.local()

    def chunk_digest(start: int) -> bytes:
        end = min(start + RAM_CHUNK, size)
        if not parts.get(start):
            return _zero_digest(end - start)
        if not hasattr(buffers, "view"):
            buffers.view = memoryview(bytearray(RAM_CHUNK))
        data = _read_exactly(fd, buffers.view[: end - start], start)
        if copy_to is not None:
            for a, b in parts[start]:
                _write_all(copy_to, data[a - start:b - start], a)
        return blake3(data).digest()

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(chunk_digest, range(0, size, RAM_CHUNK)))


def ram_copy_runs(fd: int, size: int) -> list[tuple[int, int]]:
    """The (start, end) of what a copy of ``fd`` (:func:`copy_ram_chunks`) writes: its data, joined
    over gaps shorter than ``RAM_GAP``."""
    return [run for runs in _chunk_parts(_data_extents(fd, size), size).values() for run in runs]


def _chunk_parts(extents: list[tuple[int, int]], size: int) -> dict[int, list[tuple[int, int]]]:
    """Chunk start -> the (start, end) of its data: the extents cut at chunk bounds and joined over
    gaps shorter than ``RAM_GAP`` (a write per page of scattered RAM costs more than its zeros)."""
    parts: dict[int, list[tuple[int, int]]] = {}
    for s, e in extents:
        while s < e:
            chunk = s - s % RAM_CHUNK
            cut = min(e, chunk + RAM_CHUNK, size)
            runs = parts.setdefault(chunk, [])
            if runs and s - runs[-1][1] < RAM_GAP:
                runs[-1] = (runs[-1][0], cut)
            else:
                runs.append((s, cut))
            s = cut
    return parts


def _read_exactly(fd: int, into: memoryview, offset: int) -> memoryview:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"the file ended at offset {offset + done}")
        done += got
    return into


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        written = os.pwrite(fd, data[done:], offset + done)
        if written == 0:
            raise OSError(errno.EIO, f"nothing written at offset {offset + done}")
        done += written


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The (start, end) of every region of a file that holds data (everything, where the file
    system cannot tell holes)."""
    extents: list[tuple[int, int]] = []
    offset = 0
    try:
        while offset < size:
            start = os.lseek(fd, offset, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, end))
            offset = end
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data after offset
            return extents
        return [(0, size)]
    return extents


@functools.cache
def _zero_digest(length: int) -> bytes:
    return blake3(bytes(length)).digest()


def _frozen_overlay_problem(snap: Snapshot, base: DiskImage) -> str | None:
    """Why the frozen overlay must not be QEMU's backing file: it must be a qcow2 whose only
    backing file is ``base`` (as captured), with no external data file."""
    origin = Origin("the snapshot's frozen overlay", "capture a new snapshot")
    try:
        header = read_qcow2_header(snap.disk, origin)
    except OSError as e:
        return f"its frozen overlay cannot be read ({e.strerror})"
    except ImageError as e:
        return e.message
    if header is None:
        return "its frozen overlay is not a qcow2 image"
    if header.backing_file != str(base.path):
        return (f"its frozen overlay's backing file is {header.backing_file or 'missing'}, not the base image "
                f"{base.path}")
    if header.data_file is not None:
        return f"its frozen overlay has an external data file ({header.data_file or 'unnamed'})"
    return None
