"""``Disks.prepare_freeze`` and ``freeze_live``: the lease's overlay frozen under a new one while
its QEMU runs on, and every way it can fail leaving the lease's disk as it was. Real qemu-img on
the tiny guest's disk; the backend's switch is the one step played by the test (its QMP side runs
on a real guest in
``test_snapshots.py::test_the_captured_boot_goes_on_in_its_process_and_its_lease_keeps_its_disk``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.controller.disks import Disks
from vmsidecar_runtime.controller.paths import RuntimePaths


def _info(path: Path) -> dict[str, Any]:
    out = subprocess.run(["qemu-img", "info", "-f", "qcow2", "--output=json", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out))


async def _disks_with_overlay(tmp_path: Path, tiny_image: Any) -> Disks:
    paths = RuntimePaths(shared=tmp_path / "shared", cache=tmp_path / "cache", state=tmp_path / "state",
                         run=tmp_path / "run")
    paths.state.mkdir(parents=True)
    disks = Disks(paths)
    disks.base, _, _ = await disks.pull(load_spec({"image": f"file:{tiny_image.disk}"}))
    await disks.overlay()
    return disks


async def test_a_frozen_overlay_is_the_backing_of_the_new_one_by_its_new_name(tmp_path: Path, tiny_image: Any) -> None:
    disks = await _disks_with_overlay(tmp_path, tiny_image)
    paths = disks.paths
    booted = paths.overlay.stat().st_ino
    size = _info(paths.overlay)["virtual-size"]
    switched: list[Path] = []

    async def switch(top: Path) -> None:
        assert not paths.overlay_base.exists() and paths.overlay.stat().st_ino == booted  # nothing moved yet
        switched.append(top)

    prepared = await disks.prepare_freeze(size)  # made while the guest runs: nothing moves
    assert prepared.is_file() and paths.overlay.stat().st_ino == booted and not paths.overlay_base.exists()
    frozen = await disks.freeze_live(prepared, switch)
    assert frozen == paths.overlay_base and frozen.stat().st_ino == booted
    assert switched and not switched[0].exists()  # renamed into place
    top = _info(paths.overlay)
    assert top["virtual-size"] == size and top["backing-filename"] == str(frozen)
    assert top["backing-filename-format"] == "qcow2"  # named, never probed

    with pytest.raises(HostError, match="in use by this lease's disk"):  # it would become its own backing
        await disks.prepare_freeze(size)
    stray = paths.state / "overlay.stray.qcow2"
    stray.write_bytes(b"")
    with pytest.raises(HostError, match="in use by this lease's disk"):
        await disks.freeze_live(stray, switch)
    assert not stray.exists()  # used up all the same
    assert len(switched) == 1 and _info(paths.overlay)["backing-filename"] == str(frozen)

    await disks.discard_lease()  # the recycle: both go
    assert not paths.overlay.exists() and not frozen.exists()


async def test_a_switch_the_backend_refuses_leaves_the_overlay_as_it_was(tmp_path: Path, tiny_image: Any) -> None:
    disks = await _disks_with_overlay(tmp_path, tiny_image)
    paths = disks.paths
    booted = paths.overlay.stat().st_ino

    async def refuse(top: Path) -> None:
        assert top.is_file()
        raise HostError("QEMU cannot move the guest's writes to a new overlay (test)")

    prepared = await disks.prepare_freeze(_info(paths.overlay)["virtual-size"])
    with pytest.raises(HostError, match="cannot move the guest's writes"):
        await disks.freeze_live(prepared, refuse)
    assert paths.overlay.stat().st_ino == booted and not paths.overlay_base.exists()
    assert sorted(p.name for p in paths.state.iterdir()) == ["overlay.qcow2"]  # the new overlay is gone
