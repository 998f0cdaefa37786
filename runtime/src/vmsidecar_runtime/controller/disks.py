"""The guest's disk: a read-only base (pulled or flashed), the lease's overlay, flash and dump.

The base is never written: every boot runs on the overlay, and a flash lands in a temp file that
only replaces the disk once verified (``image/`` checks it like a pulled image).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import HostError, SpecError
from vmsidecar_contract.spec import VmSpec

from ..backend.qemu import exits_done
from ..disk import (
    DiskImage,
    NoSpace,
    chain_over,
    check_image,
    create_overlay,
    install_image,
    receive_image,
    run_tool,
)
from ..image.checks import verdict
from ..oci.cache import DiskCache, stat_seal
from ..threads import Abort, run_abortable
from .paths import RuntimePaths

Progress = Callable[[int, int | None], None]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Ahead:
    """An overlay made ahead over ``backing`` (a snapshot's frozen disk), as that file was then, and
    the overlay's own stat seal: it waits in the state directory through a lease, where an escaped
    QEMU of that lease (the runtime's UID) can write it; any write changes its ctime."""

    backing: Path
    format: str
    seal: dict
    own: dict


#: the waits between attempts to make a file on a volume the last boot filled (``Disks._with_room``)
ROOM_WAITS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stat_seal(path: Path) -> dict | None:
    """The cache's stat seal of ``path`` (None: it is gone)."""
    try:
        return stat_seal(path.stat())
    except OSError:
        return None


class Disks:
    """Which disk the next boot uses, and the files of this lease."""

    def __init__(self, paths: RuntimePaths, pull_fn: Callable[..., Any] | None = None) -> None:
        self.paths = paths
        self._pull_fn = pull_fn
        #: the spec's image, pulled into the cache
        self.base: DiskImage | None = None
        #: an image flashed during this lease (replaces the base until the next recycle)
        self.flashed: DiskImage | None = None
        #: what ``paths.overlay_ahead`` stands on, once made (``prepare_ahead``)
        self._ahead: _Ahead | None = None
        self._making_ahead: asyncio.Task[None] | None = None
        #: what each overlay this runtime made stands on (:meth:`chain`), by inode (renames keep it)
        self._chains: dict[tuple[int, int], tuple[Path, ...]] = {}

    @property
    def current(self) -> DiskImage | None:
        """The disk the guest boots from (flashed, else the spec's image)."""
        return self.flashed or self.base

    async def pull(self, spec: VmSpec, reference: str | None = None, *, progress: Progress | None = None,
                   on_download: Callable[[str], None] | None = None, abort: Abort | None = None
                   ) -> tuple[DiskImage, Any, float]:
        """Pull an image into the cache (or reuse it): the disk, the pull result, the seconds taken.
        ``reference``: a lease's flash, named by the lease holder (it gets the pool's registry
        credentials only as :func:`vmsidecar_runtime.oci.auth.lease_config` lends them); else the
        spec's image. ``on_download``: see :func:`vmsidecar_runtime.oci.pull.pull` (called in the
        pull's thread). ``abort``: set, the pull's thread stops at once (its registry connections
        shut down, its qemu-img killed); cancelling this call sets it too.

        :raise SpecError: when neither ``reference`` nor the spec names an image.
        :raise ImageError: for every pull failure, with the cause and the fix.
        """
        from ..oci import pull as oci_pull
        from ..oci.auth import lease_config

        ref = reference or spec.image
        if not ref:
            raise SpecError("the spec has no image; set image (an OCI reference, oci-layout:DIR or file:PATH)")
        pull_fn = self._pull_fn or oci_pull

        def pulling() -> Any:  # in the thread: the auth file is read at each pull
            config = lease_config(ref, spec.image) if reference else None
            return pull_fn(ref, self.paths.cache, arch=spec.arch,
                           progress=progress or (lambda done, total: None),
                           on_download=on_download, registry_config=config)

        started = time.monotonic()
        # a daemon thread of its own, never the loop's pool: a registry that trickles may hold it in
        # a read until the abort shuts its connection, and a pool of such threads would queue every
        # other to_thread (the recycle's clean-up) and hold the runtime's exit (threads.py)
        pulled = await run_abortable(pulling, name="pull", abort=abort)
        await self._checked(pulled.path, pulled.format, f"image {ref}")
        disk = DiskImage(pulled.path, pulled.format, pulled.digest, ref, pulled.annotations,
                         pulled.manifest_digest)
        return disk, pulled, time.monotonic() - started

    async def _checked(self, path: Path, fmt: str, label: str) -> None:
        """Refuse a disk QEMU must not boot; a cache entry that passed the same checks and has not
        changed since (its stat seal) is not checked again (qemu-img twice: ~50 ms of a warm start).

        :raise ImageError: see :func:`vmsidecar_runtime.disk.check_image`.
        """
        cache = DiskCache(self.paths.cache)
        passed = verdict(fmt)
        if path.parent == cache.disks and await asyncio.to_thread(cache.passed_checks, path, passed):
            return
        await check_image(path, fmt, label)  # also checks entries cached before these checks existed
        if path.parent == cache.disks:
            await asyncio.to_thread(cache.record_checks, path, passed)

    async def overlay(self, backing: DiskImage | None = None) -> Path:
        """The lease's overlay over the current disk (or ``backing``, a snapshot's frozen
        overlay), created on first boot.

        :raise HostError: when qemu-img cannot write it.
        """
        backing = backing or self.current
        assert backing is not None
        if not self.paths.overlay.exists() and not await self._take_ahead(backing):
            await self._with_room(lambda: create_overlay(backing, self.paths.overlay))
            self._made(self.paths.overlay, chain_over(backing))
        return self.paths.overlay

    @staticmethod
    async def _with_room(make: Callable[[], Awaitable[None]]) -> None:
        """``make`` a file, again while the volume has no room yet for it: the last boot's overlay,
        unlinked, is freed only once its QEMU's exit has closed it and the kernel has let go of the
        Landlock domains that named it (after an RCU grace period: 47 ms measured on an idle host,
        longer under load; a 16 MiB state volume filled by the guest met it in a CI run)."""
        for wait in ROOM_WAITS:
            try:
                await make()
                return
            except NoSpace:
                await exits_done()
                await asyncio.sleep(wait)
        await make()

    def chain(self, overlay: Path) -> tuple[Path, ...]:
        """The files ``overlay`` stands on (its backing chain) as this runtime made it; none for a
        file it did not make. Never read from the overlay's header, which its QEMU writes: a header
        naming another backing file (the auth file, another lease's disk) opens nothing."""
        key = _inode(overlay)
        return self._chains.get(key, ()) if key is not None else ()

    def _made(self, overlay: Path, chain: tuple[Path, ...]) -> None:
        live = {key for path in (self.paths.overlay, self.paths.overlay_ahead, self._freeze_top)
                if (key := _inode(path)) is not None}
        self._chains = {key: known for key, known in self._chains.items() if key in live}
        if (key := _inode(overlay)) is not None:
            self._chains[key] = chain

    async def prepare_ahead(self, backing: DiskImage) -> None:
        """Make the next restore's overlay over ``backing`` (a snapshot's frozen disk) now, while a
        lease runs: that restore renames it into place rather than wait for ``qemu-img create``
        (13 ms of a 0.13-0.14 s tiny recycle under TCG here: docs/decisions.md). Nothing opens it until then: it is a
        fresh overlay like the one the restore would make. A failure only logs (the restore makes
        its own)."""
        if self._making_ahead is not None or self._ahead_for(backing):
            return
        self._drop_ahead()
        self._making_ahead = asyncio.current_task()
        try:
            seal = _stat_seal(backing.path)
            await create_overlay(backing, self.paths.overlay_ahead)
            self._made(self.paths.overlay_ahead, chain_over(backing))
            own = _stat_seal(self.paths.overlay_ahead)
            if seal is not None and seal == _stat_seal(backing.path) and own is not None:
                self._ahead = _Ahead(backing.path, backing.format, seal, own)
            else:
                self.paths.overlay_ahead.unlink(missing_ok=True)
        except (HostError, OSError) as e:
            log.warning("the next restore's overlay was not made ahead (%s); the restore makes it",
                        e.message if isinstance(e, HostError) else e)
            self.paths.overlay_ahead.unlink(missing_ok=True)
        finally:
            self._making_ahead = None

    def _ahead_for(self, backing: DiskImage) -> bool:
        ahead = self._ahead
        return (ahead is not None and ahead.backing == backing.path and ahead.format == backing.format
                and ahead.seal == _stat_seal(backing.path) and ahead.own == _stat_seal(self.paths.overlay_ahead))

    async def _take_ahead(self, backing: DiskImage) -> bool:
        """Rename the overlay made ahead into the lease's place if it stands on ``backing`` as that
        file is now; one made over another disk stays for the restore it was made for (a power-on
        of a flashed disk comes between), one over a disk changed since goes. One still being made is
        waited for (it is nearly done)."""
        if (making := self._making_ahead) is not None and making is not asyncio.current_task():
            await asyncio.shield(making)
        ahead = self._ahead
        if ahead is None or (ahead.backing, ahead.format) != (backing.path, backing.format):
            return False
        if not self._ahead_for(backing):
            if (now := _stat_seal(self.paths.overlay_ahead)) is not None and now != ahead.own:
                log.warning("the overlay made ahead (%s) was written since it was made, by no process of the "
                            "runtime's own; the restore makes a fresh one", self.paths.overlay_ahead)
            self._drop_ahead()
            return False
        self._ahead = None
        try:
            os.rename(self.paths.overlay_ahead, self.paths.overlay)
        except OSError:
            self.paths.overlay_ahead.unlink(missing_ok=True)
            return False
        return True

    def _drop_ahead(self) -> None:
        self._ahead = None
        self.paths.overlay_ahead.unlink(missing_ok=True)

    async def prepare_freeze(self, size: int) -> Path:
        """The new overlay :meth:`freeze_live` puts on top of the running guest's, made before the
        guest pauses (``qemu-img create`` took 8-25 ms of a 0.08 s capture pause): a qcow2 of the
        disk's virtual ``size`` over ``overlay_base`` (not there yet: named, never opened).

        :raise HostError: the overlay cannot be made, or the lease's disk already stands on a frozen one.
        """
        assert self.current is not None
        self._refuse_a_second_freeze()
        top = self._freeze_top
        await create_overlay(DiskImage(self.paths.overlay_base, "qcow2", self.current.digest, self.current.source),
                             top, size=size)
        self._made(top, (self.paths.overlay_base, *self.chain(self.paths.overlay)))
        return top

    @property
    def _freeze_top(self) -> Path:
        return self.paths.state / "overlay.next.qcow2"

    async def freeze_live(self, top: Path, switch: Callable[[Path], Awaitable[None]]) -> Path:
        """The running guest's overlay becomes ``overlay_base``, frozen, under ``top``
        (:meth:`prepare_freeze`'s) that ``switch`` (``Backend.continue_on``) puts on top of it in
        the backend; returns the frozen file. ``top`` is used up: renamed into place, or removed.

        ``top`` names the frozen file as its backing by the path it has from now on, so the lease's
        disk chain (a power cycle, a dump) holds after the renames. QEMU holds both files open: it
        is told of the new one before any rename, so nothing it opens by name is moved yet.

        :raise HostError: the lease's disk already stands on a frozen one, the backend cannot switch,
            or the files cannot be renamed; the lease's overlay is as it was.
        """
        frozen = self.paths.overlay_base
        try:
            self._refuse_a_second_freeze()
            await switch(top)
        except BaseException:
            top.unlink(missing_ok=True)
            raise
        try:
            os.rename(self.paths.overlay, frozen)
            os.rename(top, self.paths.overlay)
        except OSError as e:  # the guest is still paused: the caller stops it and moves the overlay itself
            if frozen.exists() and not self.paths.overlay.exists():
                os.rename(frozen, self.paths.overlay)
            top.unlink(missing_ok=True)
            raise HostError(f"the lease's overlay could not be renamed in {self.paths.state} ({e.strerror or e})") from e
        return frozen

    def _refuse_a_second_freeze(self) -> None:
        """:raise HostError: the overlay stands on a frozen one: one more freeze would make that its own backing."""
        if self.paths.overlay_base.exists():
            raise HostError(f"{self.paths.overlay_base} is in use by this lease's disk")

    def drop_overlays(self) -> None:
        """The lease's overlay goes, and the frozen one under it if any: the next boot starts from the disk."""
        self.paths.overlay.unlink(missing_ok=True)
        self.paths.overlay_base.unlink(missing_ok=True)

    async def receive_flash(self, chunks: AsyncIterable[bytes], *, expected_size: int | None,
                            expected_digest: str | None) -> Any:
        """Receive and verify a streamed image into a temp file (nothing changes yet).

        :raise ImageError: for a bad image; :raise HostError: for a full disk.
        """
        return await receive_image(chunks, self.paths.flashed, expected_size=expected_size,
                                   expected_digest=expected_digest)

    def use_flashed(self, received: Any) -> None:
        """Make a received image the disk; the overlay of the old disk goes."""
        previous = self.flashed
        self.flashed = install_image(received, self.paths.flashed)
        if previous is not None and previous.path != self.flashed.path:
            previous.path.unlink(missing_ok=True)
        self.paths.overlay.unlink(missing_ok=True)

    def use_pulled(self, disk: DiskImage) -> None:
        """Make a pulled image (read-only in the cache) the disk."""
        self.flashed = disk
        self.paths.overlay.unlink(missing_ok=True)

    def forget_image(self) -> None:
        """The spec names another image: drop the base, any flashed disk and the overlays."""
        self.base = None
        self.flashed = None
        self.paths.overlay.unlink(missing_ok=True)
        self._drop_ahead()

    async def dump(self, fmt: str) -> Path:
        """Write the current disk (base + this lease's changes) to a new standalone file; the caller
        deletes it. Each dump has its own file, so concurrent dumps never share one.

        :raise HostError: when qemu-img cannot write it.
        """
        if self.paths.overlay.exists():
            source, source_format = self.paths.overlay, "qcow2"  # create_overlay made it, naming its base's format
            chain = (source, *self.chain(source))
        else:
            assert self.current is not None
            source, source_format = self.current.path, self.current.format
            chain = chain_over(self.current)
        fd, name = tempfile.mkstemp(prefix="dump-", suffix=f".{fmt}", dir=self.paths.state)
        out = Path(name)
        os.close(fd)
        # -f: never let qemu-img probe a disk the lease holder chose (a raw disk that looks like a
        # qcow2 or vmdk would make it read the host files that image names)
        try:
            rc, _, err = await run_tool("qemu-img", "convert", "-f", source_format, "-O", fmt, str(source), str(out),
                                        read=chain, write=(out,))
        except BaseException:  # given up (the lease ended): qemu-img is killed; its part of a disk goes
            out.unlink(missing_ok=True)
            raise
        if rc != 0:
            out.unlink(missing_ok=True)
            raise HostError(f"cannot write the disk dump ({err.strip()}); free space in {out.parent}")
        return out

    def adopt_spare(self, chain: tuple[Path, ...]) -> None:
        """A spare restore becomes the lease's guest (``standby.py``): its overlay (standing on
        ``chain``) and UEFI vars move into the lease's places (its QEMU holds them open; nothing
        reopens them by name), where the next recycle discards them like any lease's."""
        os.rename(self.paths.spare / self.paths.overlay.name, self.paths.overlay)
        self._made(self.paths.overlay, chain)
        vars_dir = self.paths.spare / self.paths.firmware.name
        if vars_dir.exists():
            shutil.rmtree(self.paths.firmware, ignore_errors=True)
            os.rename(vars_dir, self.paths.firmware)

    async def discard_earlier_process(self) -> None:
        """At start: remove what an earlier runtime process left in the state directory.

        A runtime that was killed (OOM, SIGKILL, node trouble) and started again cannot tell which
        lease it is in: its generation and claim start afresh, so the next lease would boot on the
        earlier lease's overlay, or on a flashed disk this process does not know of. Half-written
        flash and dump files of the dead process go too; none of them is ever used.
        """
        await self.discard_lease()
        self._drop_ahead()  # made over a snapshot this process has not checked
        await asyncio.to_thread(shutil.rmtree, self.paths.spare, True)  # a spare restore's files
        for stale in self.paths.state.glob("dump-*"):
            stale.unlink(missing_ok=True)

    async def discard_lease(self) -> None:
        """Back to the spec's image: overlay, flashed disks and UEFI vars go (off the event loop)."""
        self.flashed = None
        self.drop_overlays()
        for d in (self.paths.flashed, self.paths.firmware):
            await asyncio.to_thread(shutil.rmtree, d, True)
