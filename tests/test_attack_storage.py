"""Storage bounds (issue 19, item 8): a guest that fills the state volume, a cache over its budget.

A lease holder controls what the guest writes; a pool admin controls what the cache is given. The
guest's writes land in the lease's overlay in the state directory: when they no longer fit, the
guest must stop with a clear error (not fill the node); the image cache holds what a budget
allows and evicts the least recently used, never what a VM uses.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.attack import copy_snapshot_entry
from fixtures.faults import tmpfs, wait_phase
from vmsidecar_images.console import Console
from vmsidecar_runtime.oci import pull
from vmsidecar_runtime.oci.cache import set_budget

pytestmark = pytest.mark.timeout(600)


async def test_a_guest_that_fills_the_state_volume_is_paused_with_a_clear_error(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    # 16 MiB of state; the guest writes 48 MiB of random data to its 64 MiB /data partition
    with tmpfs(tmp_path / "state", "16m") as state_dir:
        rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"},
                                 extra_args=["--state-dir", str(state_dir)])
        client = rt.client()
        await client.wait_ready(240)
        con = await Console.open(rt.shared / "console.sock")
        await con.wake()
        con.writer.write(b"dd if=/dev/urandom of=/data/fill bs=1M count=48 conv=fsync; echo DD-ENDED\n")
        await con.writer.drain()
        state = await wait_phase(client, "Error", "Stopped", "Crashed", timeout=120)
        message = (state.last_error or {}).get("message", "")
        print(f"guest dd into a 16 MiB state volume: {state.phase.value}: {message}")
        assert state.phase.value == "Error", state
        assert message.startswith("the state volume is full"), message
        assert str(state_dir) in message and "recycle" in message, message
        assert b"DD-ENDED" not in con.seen  # the guest never saw its write fail: it was stopped
        await con.close()

        # recovery: the recycle drops the overlay (and its space); the guest is back, pristine
        await client.recycle()
        state = await client.wait_ready(240)
        assert state.phase.value == "Ready" and state.last_error is None, state
        await rt.client().power("off", graceful=False)
        rt.stop()


def _usage(path: Path) -> int:
    """Bytes on disk of a file or of a directory's files."""
    files = list(path.iterdir()) if path.is_dir() else [path]
    return sum(f.stat().st_blocks * 512 for f in files)


def _random_qcow2(path: Path, mib: int) -> Path:
    raw = path.with_suffix(".raw")
    raw.write_bytes(os.urandom(mib << 20))
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(path)], check=True, timeout=60)
    raw.unlink()
    return path


async def test_the_cache_evicts_the_least_recently_used_but_never_what_a_vm_uses(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    args = ["--cache-dir", str(cache)]
    image = f"file:{tiny_image.disk}"
    # a live VM: its base image and the snapshot it runs on are in use
    live = await start_runtime({"image": image, "memory": "256M", "channels": [{"name": "evict-live"}]},
                               name="live", extra_args=args)
    await live.client().wait_ready(240)
    assert (await live.client().wait_stored()).snapshot.available
    [live_snap] = [p for p in (cache / "snapshots").iterdir() if not p.name.startswith(".")]
    [base] = list((cache / "disks").iterdir())
    # an old snapshot no runtime uses any more (of another key: the eviction weighs only its size, its
    # last use and whether a process holds it, so a copy made an hour old stands for one)
    old_snap = live_snap.with_name("0" * len(live_snap.name))
    copy_snapshot_entry(live_snap, old_snap)
    an_hour_ago = time.time() - 3600
    os.utime(old_snap, (an_hour_ago, an_hour_ago))

    # the budget fits the live VM's things and two and a half more images; the old snapshot and the
    # base are the least recently used, then the first image pulled
    images = [_random_qcow2(tmp_path / f"img{i}.qcow2", 6) for i in range(3)]
    budget = _usage(base) + _usage(live_snap) + 5 * _usage(images[0]) // 2
    set_budget(budget)
    try:
        pulled = [await asyncio.to_thread(pull, f"file:{img}", cache) for img in images]
    finally:
        set_budget(None)
    on_disk = {p.name for p in (cache / "disks").iterdir()}
    snaps = {p.name for p in (cache / "snapshots").iterdir()}
    total = sum(_usage(p) for p in [*(cache / "disks").iterdir(), *(cache / "snapshots").iterdir()])
    print(f"budget {budget >> 20} MiB, cache {total >> 20} MiB: disks {sorted(on_disk)}, snapshots {sorted(snaps)}")
    assert total <= budget
    assert base.name in on_disk and live_snap.name in snaps  # in use: kept, though least recently used
    assert old_snap.name not in snaps  # unused, oldest: evicted
    assert pulled[0].path.name not in on_disk  # the oldest image nothing uses
    assert {p.path.name for p in pulled[1:]} <= on_disk

    # the live VM is untouched; an evicted image is pulled again
    assert (await live.client().state()).phase.value == "Ready"
    again = await asyncio.to_thread(pull, f"file:{images[0]}", cache)
    assert not again.cached and again.path.exists()


async def test_a_lease_that_flashed_keeps_the_pools_snapshot_from_eviction(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    """A lease flashes a disk of its own and powers on: that boot restores nothing, and the pool's
    snapshot had lost its in-use mark with it, so the lease's next pulls evicted it and the next
    lease booted cold (and captured again). The spec's snapshot stays held through the lease."""
    cache = tmp_path / "cache"
    images = [_random_qcow2(tmp_path / f"img{i}.qcow2", 6) for i in range(3)]
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M",
                              "channels": [{"name": "evict-lease"}]}, name="pool",
                             extra_args=["--cache-dir", str(cache), "--allow-host-paths", str(tmp_path)])
    client = rt.client()
    await client.wait_ready(240)
    assert (await client.wait_stored()).snapshot.available
    [snap] = [p for p in (cache / "snapshots").iterdir() if not p.name.startswith(".")]
    [base] = list((cache / "disks").iterdir())
    await client.claim()
    await client.flash_reference(f"file:{images[0]}", power_off=True)
    await client.power("on")  # boots the lease's own disk (no snapshot for it)
    [flashed] = [p for p in (cache / "disks").iterdir() if p != base]
    # room for what is in use and one and a half more images: the second pull must evict one thing
    budget = _usage(base) + _usage(snap) + _usage(flashed) + 3 * _usage(images[0]) // 2
    set_budget(budget)
    try:  # pulls into the same cache (the runtime's own evict as these do), its in-use marks as they are
        for img in images[1:]:
            await asyncio.to_thread(pull, f"file:{img}", cache)
    finally:
        set_budget(None)
    assert snap.exists(), "the pool's snapshot was evicted during a lease"
    state = await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored", state.snapshot
