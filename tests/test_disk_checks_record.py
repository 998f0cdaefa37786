"""A cached disk that passed the boot checks skips them while it is unchanged and the limits are the same.

``qemu-img info`` and ``check`` of the base cost ~50 ms of every warm start; a cache entry is
checked again only when its stat seal changed (anything wrote to it or chmod-ed it), the limits it
was held to changed, or it was never recorded (an entry cached by an older runtime). Real pulls of
the tiny guest into a real cache, with a ``qemu-img`` on ``PATH`` that logs its argv and runs the
real one; no guest boots.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from vmsidecar_contract.errors import ImageError
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.controller.disks import Disks
from vmsidecar_runtime.controller.paths import RuntimePaths
from vmsidecar_runtime.image import limits


@pytest.fixture
def qemu_img_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A log of every qemu-img subcommand the runtime runs (one per line)."""
    real = shutil.which("qemu-img")
    assert real, "qemu-img is not installed"
    bin_dir, log = tmp_path / "bin", tmp_path / "qemu-img.log"
    bin_dir.mkdir()
    wrapper = bin_dir / "qemu-img"
    wrapper.write_text(f"#!/bin/sh\necho \"$1\" >> '{log}'\nexec '{real}' \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("VMSIDECAR_QEMU_CONFINEMENT", "off")  # (it logs in the test's directory)
    log.touch()
    return log


def _runs(log: Path) -> list[str]:
    """The subcommands logged since the last call (the log is emptied)."""
    lines = log.read_text().split()
    log.write_text("")
    return lines


async def test_a_cached_disk_is_checked_once_until_it_or_the_limits_change(
    tmp_path: Path, tiny_image: Any, qemu_img_log: Path
) -> None:
    paths = RuntimePaths(shared=tmp_path / "shared", cache=tmp_path / "cache", state=tmp_path / "state",
                         run=tmp_path / "run")
    spec = load_spec({"image": f"file:{tiny_image.disk}"})

    first, _, _ = await Disks(paths).pull(spec)  # pulled and checked as it is installed: once, not again before booting
    assert _runs(qemu_img_log) == ["info", "check"], "a disk pulled and checked was checked a second time"

    again, pulled, _ = await Disks(paths).pull(spec)  # a new runtime on the same cache: a warm start
    assert pulled.cached and again.path == first.path
    assert _runs(qemu_img_log) == [], "an unchanged cache entry that passed the checks was checked again"

    await asyncio.to_thread(again.path.chmod, 0o444)  # a chmod changes the ctime: the stat seal no longer holds
    await Disks(paths).pull(spec)
    assert "check" in _runs(qemu_img_log), "a cache entry whose stat changed was not checked again"
    await Disks(paths).pull(spec)
    assert _runs(qemu_img_log) == []

    limits.configure(4 << 20)  # a runtime started with a lower --max-disk-size holds the entry to it
    try:
        with pytest.raises(ImageError, match="max-disk-size"):
            await Disks(paths).pull(spec)
    finally:
        limits.configure(None)
