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
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import subprocess
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vmsidecar_contract.errors import HostError, ImageError
from vmsidecar_contract.spec import Readiness, VmSpec

from .backend.common import qemu_binary
from .disk import DiskImage
from .image.checks import parse_qcow2_header
from .image.limits import Origin
from .image.sniff import QCOW2_MAGIC
from .oci.cache import IN_USE, DiskCache, hash_file, remove_tree, stat_seal
from .procs import child_env

log = logging.getLogger(__name__)

#: bump when the layout or the meaning of a snapshot changes: older ones are then never matched
#: (2: every QEMU has the guest agent's port; the snapshot has meta.json; 3: sealed)
FORMAT = 3
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
        out = subprocess.run([qemu_binary(arch), "--version"], capture_output=True, text=True, timeout=10,
                             env=child_env())
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.splitlines()[0] if out.stdout else ""


#: spec fields outside the key: whether and where snapshots are looked for change no guest, and
#: the CPU model is in the key as the effective one (a spec naming the default shares its key)
KEY_EXCLUDES = {"snapshot", "libvirt_uri", "snapshot_source", "cpu"}


def snapshot_key(spec: VmSpec, image_digest: str, accel: str, cpu: str, readiness: Readiness | None = None) -> str:
    """The cache key of the snapshot of ``spec`` booted from ``image_digest``, captured when
    ``readiness`` (default: the spec's) was met."""
    material = {
        "format": FORMAT,
        "image": image_digest,
        "spec": spec.model_dump(mode="json", exclude=KEY_EXCLUDES)
        | {"readiness": (readiness or spec.readiness).model_dump(mode="json")},
        "qemu": qemu_version(spec.arch),
        "accel": accel,
        "cpu": cpu,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SnapshotMeta:
    """What the capture found out about the guest."""

    #: a guest agent answered at capture: a restore sets the guest's clock through it
    guest_agent: bool = False
    #: the seal: ``sha256:<hex>`` of every other file of the snapshot, at commit
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """One snapshot directory."""

    path: Path

    @property
    def memory(self) -> Path:
        """The migration stream (RAM and device state)."""
        return self.path / "memory"

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
            return SnapshotMeta(guest_agent=bool(data["guest_agent"]), files=files)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def console(self, name: str) -> bytes:
        """The scrollback ``name`` showed at capture time."""
        try:
            return (self.path / f"{name}.console").read_bytes()
        except FileNotFoundError:
            return b""

    @property
    def size(self) -> int:
        """Bytes on disk."""
        return sum(p.stat().st_size for p in self.path.iterdir())


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
        #: snapshot path -> what this process hashed and found matching (see the module's docstring)
        self._checked: dict[str, _Checked] = {}

    def find(self, key: str) -> Snapshot | None:
        """The complete snapshot for ``key``, if the cache has one (an incomplete one is
        captured again at the next cold boot's Ready: ``commit`` replaces it). Not yet checked:
        :meth:`verify` before QEMU loads it."""
        snap = Snapshot(self.root / key)
        complete = snap.memory.is_file() and snap.disk.is_file() and snap.meta() is not None
        return snap if complete else None

    def staging(self, key: str) -> Snapshot:
        """A fresh, empty directory to capture into (renamed into place by ``commit``).

        Unique per capture, not per pid: runtimes in two pods sharing one cache volume are both
        pid 1.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        return Snapshot(Path(tempfile.mkdtemp(prefix=f".incoming-{key}-", dir=self.root)))

    def commit(self, staged: Snapshot, key: str, consoles: dict[str, bytes], meta: SnapshotMeta) -> Snapshot:
        """Make a captured snapshot visible: sealed, read-only files, one atomic rename.

        Blocking (it hashes every file): call it in a thread from asyncio.

        Runtimes sharing a cache may capture the same key at once: the first complete snapshot
        wins and is never replaced under a runtime restoring from it (same key, same pristine
        guest); a later capture is dropped and the winner returned.
        """
        for name, data in consoles.items():
            (staged.path / f"{name}.console").write_bytes(data)
        files = {item.name: hash_file(item) for item in staged.path.iterdir() if item != staged.meta_file}
        staged.meta_file.write_text(json.dumps(asdict(SnapshotMeta(meta.guest_agent, files))))
        for item in staged.path.iterdir():
            os.chmod(item, 0o444)
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
        self.hold(self._held_disks, existing)
        return existing

    def hold(self, disks: list[DiskImage | None], snap: Snapshot | None) -> None:
        """Mark what the next boot uses — its disks (those in the cache) and ``snap`` — in use, so no
        cache eviction removes them while this runtime may still boot from them; drops the marks of
        what an earlier boot used."""
        self._held_disks = list(disks)
        cache = DiskCache(self._cache)
        items = {f"disks/{d.path.name}" for d in disks if d is not None and d.path.parent == cache.disks}
        if snap is not None:
            items.add(f"snapshots/{snap.path.name}")
        IN_USE.hold(cache, items)

    def verify(self, snap: Snapshot, base: DiskImage) -> str | None:
        """Why ``snap`` must not be restored over ``base``, or None when its seal and its frozen
        overlay's header hold.

        Blocking (the first check in a process hashes every file): call it in a thread.
        """
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
        digests = checked.digests if checked else meta.files
        if checked is not None and meta.files != checked.digests:
            return "its recorded sha256 digests (meta.json) were rewritten since this runtime checked them"
        if on_disk != set(digests):
            return f"its files ({', '.join(sorted(on_disk))}) are not the ones sealed at capture"
        seals = {}
        for name, digest in sorted(digests.items()):
            path = snap.path / name
            try:
                seal = stat_seal(path.stat())
            except OSError as e:
                return f"{name} cannot be read ({e.strerror})"
            if (checked is None or checked.seals.get(name) != seal) and hash_file(path) != digest:
                return f"{name} does not match the sha256 recorded at capture (altered on disk)"
            seals[name] = seal
        self._checked[str(snap.path)] = _Checked(dir_ino, dict(digests), seals)
        return _frozen_overlay_problem(snap, base)

    def _remember(self, snap: Snapshot, digests: dict[str, str]) -> None:
        with contextlib.suppress(OSError):
            seals = {name: stat_seal((snap.path / name).stat()) for name in digests}
            self._checked[str(snap.path)] = _Checked(snap.path.stat().st_ino, dict(digests), seals)

    async def discard(self, snap: Snapshot) -> None:
        """Remove a snapshot QEMU refused, one whose seal broke (or a half-written one)."""
        self._checked.pop(str(snap.path), None)
        await asyncio.to_thread(remove_tree, snap.path)
        log.info("snapshot %s discarded", snap.path.name)


def _frozen_overlay_problem(snap: Snapshot, base: DiskImage) -> str | None:
    """Why the frozen overlay must not be QEMU's backing file: it must be a qcow2 whose only
    backing file is ``base`` (as captured), with no external data file."""
    origin = Origin("the snapshot's frozen overlay", "capture a new snapshot")
    try:
        with open(snap.disk, "rb") as f:
            head = f.read(64 << 10)
        if not head.startswith(QCOW2_MAGIC):
            return "its frozen overlay is not a qcow2 image"
        header = parse_qcow2_header(head, origin)
    except OSError as e:
        return f"its frozen overlay cannot be read ({e.strerror})"
    except ImageError as e:
        return e.message
    if header.backing_file != str(base.path):
        return (f"its frozen overlay's backing file is {header.backing_file or 'missing'}, not the base image "
                f"{base.path}")
    if header.data_file is not None:
        return f"its frozen overlay has an external data file ({header.data_file or 'unnamed'})"
    return None
