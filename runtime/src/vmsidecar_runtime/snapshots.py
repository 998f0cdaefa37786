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
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import Readiness, VmSpec

from .backend.common import qemu_binary

log = logging.getLogger(__name__)

#: bump when the layout or the meaning of a snapshot changes: older ones are then never matched
#: (2: every QEMU has the guest agent's port; the snapshot has meta.json)
FORMAT = 2
#: consoles whose scrollback a restored guest shows
CONSOLES = ("ttyS0", "hvc0")


@functools.cache
def qemu_version(arch: str) -> str:
    """``qemu-system-ARCH --version`` (first line), or "" when it cannot be run."""
    try:
        out = subprocess.run([qemu_binary(arch), "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.splitlines()[0] if out.stdout else ""


def snapshot_key(spec: VmSpec, image_digest: str, accel: str, cpu: str, readiness: Readiness | None = None) -> str:
    """The cache key of the snapshot of ``spec`` booted from ``image_digest``, captured when
    ``readiness`` (default: the spec's) was met."""
    material = {
        "format": FORMAT,
        "image": image_digest,
        "spec": spec.model_dump(mode="json", exclude={"snapshot", "libvirt_uri"})
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
            return SnapshotMeta(guest_agent=bool(data["guest_agent"]))
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


class SnapshotStore:
    """The snapshots in one cache directory."""

    def __init__(self, cache: Path) -> None:
        self.root = cache / "snapshots"

    def find(self, key: str) -> Snapshot | None:
        """The complete snapshot for ``key``, if the cache has one (an incomplete one is
        captured again at the next cold boot's Ready: ``commit`` replaces it)."""
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
        """Make a captured snapshot visible: read-only files, one atomic rename.

        Runtimes sharing a cache may capture the same key at once: the first complete snapshot
        wins and is never replaced under a runtime restoring from it (same key, same pristine
        guest); a later capture is dropped and the winner returned.
        """
        for name, data in consoles.items():
            (staged.path / f"{name}.console").write_bytes(data)
        staged.meta_file.write_text(json.dumps(asdict(meta)))
        for item in staged.path.iterdir():
            os.chmod(item, 0o444)
        final = self.root / key
        if (existing := self.find(key)) is None and final.exists():
            # an incomplete or outdated entry: moved aside first, so the rename below is atomic
            with contextlib.suppress(FileNotFoundError):
                trash = Path(tempfile.mkdtemp(prefix=f".trash-{key}-", dir=self.root))
                os.rename(final, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
        if existing is None:
            try:
                os.rename(staged.path, final)
                return Snapshot(final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            existing = self.find(key)
            if existing is None:
                raise HostError(f"another runtime is writing the snapshot {final} at this instant; "
                                "the next boot takes it")
        log.info("snapshot %s was captured by another runtime sharing the cache first; keeping it", key)
        shutil.rmtree(staged.path, ignore_errors=True)
        return existing

    async def discard(self, snap: Snapshot) -> None:
        """Remove a snapshot QEMU refused (or a half-written one)."""
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, snap.path, True)
        log.info("snapshot %s discarded", snap.path.name)
