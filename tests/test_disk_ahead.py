"""``Disks.prepare_ahead``: the next restore's overlay, made while a lease runs, is renamed into
place by that restore only while it stands on the same frozen disk, unchanged; else it goes and the
restore makes its own. Real qemu-img on the tiny guest's disk (a frozen disk of a snapshot is a
qcow2 like it); the restores themselves use it in
``test_snapshots.py::test_recycle_restores_a_pristine_guest_with_nothing_of_the_last_lease``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.marks import Marks
from vmsidecar_runtime.controller.disks import Disks
from vmsidecar_runtime.controller.paths import RuntimePaths
from vmsidecar_runtime.disk import DiskImage


@pytest.fixture
def marks() -> Iterator[Marks]:
    with Marks() as held:
        yield held


def _backing_of(path: Path) -> str:
    out = subprocess.run(["qemu-img", "info", "-f", "qcow2", "--output=json", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return str(json.loads(out)["backing-filename"])


def _disks(tmp_path: Path, tiny_image: Any) -> tuple[Disks, DiskImage]:
    paths = RuntimePaths(shared=tmp_path / "shared", cache=tmp_path / "cache", state=tmp_path / "state",
                         run=tmp_path / "run")
    paths.state.mkdir(parents=True)
    frozen = tmp_path / "snapshot-disk.qcow2"  # what a snapshot's frozen overlay is to the restore
    shutil.copyfile(tiny_image.disk, frozen)
    return Disks(paths), DiskImage(frozen, "qcow2", "sha256:" + "0" * 64, "file:test")


async def test_an_overlay_made_ahead_is_the_next_restores(tmp_path: Path, tiny_image: Any, marks: Marks) -> None:
    disks, frozen = _disks(tmp_path, tiny_image)
    paths = disks.paths
    await disks.prepare_ahead(frozen)
    assert _backing_of(paths.overlay_ahead) == str(frozen.path)
    marks.mark(paths.overlay_ahead)
    await disks.prepare_ahead(frozen)  # already there: left as it is
    assert marks.marked(paths.overlay_ahead)

    assert await disks.overlay(frozen) == paths.overlay
    assert marks.marked(paths.overlay) and not paths.overlay_ahead.exists()  # renamed, not made
    disks.drop_overlays()  # the recycle after: the next restore has none made ahead and makes one
    await disks.overlay(frozen)
    assert not marks.marked(paths.overlay) and _backing_of(paths.overlay) == str(frozen.path)


async def test_an_overlay_made_ahead_over_another_or_a_changed_disk_is_not_used(tmp_path: Path, tiny_image: Any,
                                                                               marks: Marks) -> None:
    disks, frozen = _disks(tmp_path, tiny_image)
    paths = disks.paths
    other = DiskImage(tmp_path / "other.qcow2", "qcow2", frozen.digest, frozen.source)
    shutil.copyfile(frozen.path, other.path)

    await disks.prepare_ahead(other)
    marks.mark(paths.overlay_ahead)
    await disks.overlay(frozen)  # another disk's (a flashed one boots between): made anew over this one
    assert _backing_of(paths.overlay) == str(frozen.path) and not marks.marked(paths.overlay)
    disks.drop_overlays()
    await disks.overlay(other)  # ... and the one made ahead waited for the restore it was made for
    assert marks.marked(paths.overlay) and _backing_of(paths.overlay) == str(other.path)

    disks.drop_overlays()
    await disks.prepare_ahead(frozen)
    marks.mark(paths.overlay_ahead)
    replaced = tmp_path / "replaced.qcow2"  # the snapshot's disk replaced at its path (a new capture)
    shutil.copyfile(frozen.path, replaced)
    os.replace(replaced, frozen.path)
    await disks.overlay(frozen)
    assert not marks.marked(paths.overlay) and not paths.overlay_ahead.exists()

    disks.drop_overlays()
    await disks.prepare_ahead(frozen)
    disks.forget_image()  # the spec names another image: what was made for its snapshot goes
    assert not paths.overlay_ahead.exists()
    await disks.prepare_ahead(frozen)
    await disks.discard_earlier_process()  # a new runtime process trusts no file of the one before
    assert not paths.overlay_ahead.exists()
