"""The snapshot of the spec's ``snapshot_source``: fetched while the spec's image is pulled, or after.

On a node that has neither the image nor its snapshot, the two downloads are independent until
the very end: the artifact is found by the image's manifest digest (known as the pull starts),
and every field of its key but those the disk itself tells (``IMAGE_FIELDS``) can be checked
then. So the pull's ``on_download`` starts the fetch into a staging directory (``start``);
``snapshot`` completes it with the whole key once the disk is there, or asks the source again
(the whole fetch, as without a pull) when another artifact is this key's. What is not used is
removed once its fetch ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import VmSpec

from ..accel import choose_accel
from ..disk import DiskImage
from ..snapshot_identity import SnapshotIdentity, identify_before_pull
from ..snapshots import Snapshot, SnapshotStore

log = logging.getLogger(__name__)


class SourceFetch:
    """Fetches from a snapshot_source; at most one early fetch under way, for one (source, image)."""

    def __init__(self, store: SnapshotStore, supports_snapshots: Callable[[str], bool]) -> None:
        self._store = store
        self._supports = supports_snapshots
        self._fetch: tuple[str, str, asyncio.Future[Any]] | None = None

    def start(self, spec: VmSpec, subject: str) -> None:
        """The spec's own image (manifest ``subject``) is being downloaded: fetch its snapshot now."""
        from ..oci.snapshot_fetch import stage_in_thread  # here: registry code only when asked

        self.drop()
        if spec.snapshot_source is None or spec.snapshot == "off" or not self._supports(spec.backend):
            return
        try:  # the accelerator the boot will choose (a pure check of /dev/kvm and the CPU's flags)
            known = identify_before_pull(spec, choose_accel(spec.accel, spec.arch).accel)
        except HostError:
            return  # the boot fails on it, with the reason
        task = asyncio.ensure_future(stage_in_thread(spec.snapshot_source, subject, known, self._store))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged by stage_in_thread
        self._fetch = (spec.snapshot_source, subject, task)

    async def snapshot(self, source: str, identity: SnapshotIdentity, base: DiskImage) -> Snapshot:
        """The snapshot of ``identity`` over ``base`` from ``source``, committed to the cache: the
        early fetch's when it was for this image and its key is this one, else fetched now.

        :raise SourceRefused: nothing usable there; the message says why.
        """
        from ..oci.snapshot_fetch import (  # registry code only when asked
            SourceRefused,
            complete,
            fetch_in_thread,
        )

        early = self._take(source, base.manifest_digest)
        if early is not None:
            try:
                return await asyncio.to_thread(complete, await early, identity, base, self._store)
            except SourceRefused as e:
                if e.code != "key_mismatch":  # another artifact may be this key's: ask again
                    raise
                log.info("the snapshot fetched during the pull is not this boot's (%s); asking %s again",
                         e.message, source)
        return await fetch_in_thread(source, identity, base, self._store)

    def _take(self, source: str, subject: str | None) -> asyncio.Future[Any] | None:
        """The fetch of ``source`` for the image ``subject``, if that is the one under way (it is
        then the caller's); any other is dropped."""
        fetch, self._fetch = self._fetch, None
        if fetch is not None and fetch[:2] == (source, subject):
            return fetch[2]
        if fetch is not None:
            fetch[2].add_done_callback(self._discard)
        return None

    def drop(self) -> None:
        """No boot will use the fetch under way: what it staged goes once it ends."""
        fetch, self._fetch = self._fetch, None
        if fetch is not None:
            fetch[2].add_done_callback(self._discard)

    def _discard(self, task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._store.discard_now(task.result().snap)
