"""Faults on the disk path, for real (issue 13): a registry killed mid-pull, a full disk (tmpfs with
``size=``) during a pull and during a flash, the runtime SIGKILLed mid-flash, a corrupted cache
entry. Each ends in a clear error or a recovery; the old disk stays, no partial file is kept or used.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.faults import ThrottleProxy, tmpfs, wait_phase
from fixtures.registry import start_registry
from fixtures.waiting import file_made, wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import HostError, RegistryError, VmsidecarError
from vmsidecar_images.console import Console
from vmsidecar_runtime.oci import pull, push_artifact

pytestmark = pytest.mark.timeout(600)

MiB = 1 << 20


async def _answers(rt: Any, tag: str) -> bool:
    """Whether the runtime's guest runs (not paused, not gone): its shell answers a sum it computes."""
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.wake()
        return f"{tag}-42" in await con.run(f"echo {tag}-$((40+2))", timeout=30)
    finally:
        await con.close()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _cache_files(cache: Path) -> tuple[list[str], list[str]]:
    """(disks, temp files) in a runtime's image cache."""
    disks = sorted(p.name for p in (cache / "disks").iterdir()) if (cache / "disks").exists() else []
    tmp = sorted(p.name for p in (cache / "tmp").iterdir()) if (cache / "tmp").exists() else []
    return disks, tmp


async def _marker(rt: Any, label: str) -> None:
    """The boot on the console is the guest ``label`` (``VMSIDECAR-READY image=<label> ``)."""
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.expect(f"VMSIDECAR-READY image={label} ", 120)
    finally:
        await con.close()


async def test_registry_killed_mid_pull_then_a_retry_works(start_runtime: Any, tiny_image: Any,
                                                             tmp_path: Path) -> None:
    # 48 MiB of random data: a download that takes seconds through the proxy and cannot compress
    raw = tmp_path / "big.raw"
    raw.write_bytes(os.urandom(48 * MiB))
    big = tmp_path / "big.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(big)], check=True, timeout=60)
    raw.unlink()
    cache = tmp_path / "cache"
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"},
                             extra_args=["--cache-dir", str(cache)])
    client = rt.client()
    ready = await client.wait_ready(240)
    before, _ = _cache_files(cache)

    with start_registry(tmp_path / "registry") as first:
        push_artifact(big, f"{first.host}/vm/big:1", compression=None)
        port = int(first.host.rsplit(":", 1)[1])
        async with ThrottleProxy(("127.0.0.1", port), rate=8 * MiB) as proxy:
            ref = f"{proxy.host}/vm/big:1"
            pull = asyncio.create_task(client.flash_reference(ref, power_off=True))

            def half_sent() -> bool:
                assert not pull.done(), "the pull ended before the registry could be killed"
                return proxy.forwarded > 6 * MiB

            await wait_until_async(half_sent, 30, "6 MiB of the blob to pass")
            first.process.kill()  # SIGKILL: the registry dies with the blob half sent
            with pytest.raises(RegistryError) as exc:
                await asyncio.wait_for(pull, 60)  # an error, never a hang
            assert "retry the pull" in exc.value.message or "truncated" in exc.value.message, exc.value.message
            print(f"registry killed after {proxy.forwarded / MiB:.1f} MiB: {exc.value.code}: {exc.value.message}")

            disks, tmp = _cache_files(cache)
            assert disks == before and tmp == [], "a partial download was kept in the cache"
            state = await client.state()
            assert state.phase.value == "Ready" and state.image_digest == ready.image_digest  # nothing changed

            with start_registry(tmp_path / "registry") as second:  # same storage, new process and port
                proxy.target = ("127.0.0.1", int(second.host.rsplit(":", 1)[1]))
                proxy.rate = 1 << 30
                state = await asyncio.wait_for(client.flash_reference(ref, power_off=True), 120)
    assert state.phase.value == "Stopped" and state.image_digest == _sha256(big)
    disks, tmp = _cache_files(cache)
    assert len(disks) == len(before) + 1 and tmp == []
    assert _sha256(cache / "disks" / f"{state.image_digest.replace(':', '-')}.qcow2") == state.image_digest


async def test_enospc_during_a_pull_and_during_a_flash_keeps_the_old_disk(
    start_runtime: Any, tiny_image: Any, tiny_b_image: Any, tmp_path: Path
) -> None:
    # the cache holds the tiny guest (13 MiB) but not a second one; the state dir no flashed disk
    with tmpfs(tmp_path / "cache", "20m") as cache, tmpfs(tmp_path / "state", "8m") as state_dir:
        rt = await start_runtime(
            {"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"},
            extra_args=["--cache-dir", str(cache), "--state-dir", str(state_dir),
                        "--allow-host-paths", str(tiny_b_image.disk.parent)])
        client = rt.client()
        # the tiny guest is pulled (then the guest boots: no need to wait for Ready here)
        ready = await wait_phase(client, "Running", "Ready", timeout=240)
        disks_before, _ = _cache_files(cache)

        # ENOSPC while pulling into the cache
        with pytest.raises(HostError) as exc:
            await asyncio.wait_for(client.flash_reference(f"file:{tiny_b_image.disk}", power_off=True), 120)
        assert exc.value.code == "cache_write_failed" and "free space" in exc.value.message, exc.value.message
        disks, tmp = _cache_files(cache)
        assert disks == disks_before and tmp == [], "a partial cache entry was kept"
        state = await client.state()
        assert state.phase.value in ("Running", "Ready") and state.image_digest == ready.image_digest

        # ENOSPC while receiving a flashed image
        await client.power("off", graceful=False)
        with pytest.raises(HostError) as exc:
            await asyncio.wait_for(client.flash(tiny_b_image.disk), 120)
        assert "no space left" in exc.value.message and "free space" in exc.value.message, exc.value.message
        assert list((state_dir / "flashed").glob("*")) == [], "a half-written flash was kept"
        state = await client.state()
        assert state.image_digest == ready.image_digest

        # the old disk boots
        await client.power("on")
        await client.wait_ready(240)
        await _marker(rt, "tiny")
        await asyncio.to_thread(rt.stop)


async def _stalling(path: Path, sent: list[int], stall_after: int, chunk: int = 256 << 10) -> AsyncIterator[bytes]:
    """The image's bytes up to ``stall_after``, then nothing more: a flash that stays in flight."""
    with open(path, "rb") as f:
        while data := f.read(chunk):
            sent[0] += len(data)
            yield data
            if sent[0] > stall_after:
                await asyncio.Event().wait()


async def test_runtime_killed_mid_flash_restarts_on_the_previous_disk(
    start_runtime: Any, tiny_image: Any, tiny_b_image: Any
) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M"}
    rt = await start_runtime(spec, name="rt")
    client = rt.client()
    ready = await client.wait_ready(240)
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    await con.run("echo lease-before-the-kill > /data/marker; sync")
    await con.close()
    await client.power("off", graceful=False)

    sent = [0]
    size = tiny_b_image.disk.stat().st_size
    flash = asyncio.create_task(client.flash(_stalling(tiny_b_image.disk, sent, 4 * MiB), size=size))
    flashed = rt.state / "flashed"
    await wait_until_async(lambda: sent[0] > 4 * MiB and list(flashed.glob(".incoming-*")), 30,
                           "the flash to send 4 MiB and write its temp file")
    rt.proc.kill()  # SIGKILL: no cleanup code runs
    rt.proc.wait(10)
    with pytest.raises((VmsidecarError, OSError)):
        await asyncio.wait_for(flash, 30)
    left = list(flashed.glob(".incoming-*"))
    assert left, "expected the dead runtime's half-written temp file"

    rt2 = await start_runtime(spec, name="rt")  # same shared and state directories
    client2 = rt2.client()
    state = await client2.wait_ready(240)
    assert state.image_digest == ready.image_digest  # the previous disk, not the half-flashed one
    await _marker(rt2, "tiny")
    assert not any(p.exists() for p in left), "the dead runtime's temp file is still there"
    assert list(flashed.glob(".incoming-*")) == []
    # a restarted runtime cannot tell which lease it is in: nothing of the earlier one survives
    con = await Console.open(rt2.shared / "console.sock")
    await con.wake()
    assert "lease-before-the-kill" not in await con.run("cat /data/marker 2>&1")
    await con.close()


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
async def test_a_corrupted_cache_entry_is_detected_and_pulled_again(
    start_runtime: Any, tiny_image: Any, tmp_path: Path, damage: str
) -> None:
    cache = tmp_path / "cache"
    good = await asyncio.to_thread(pull, f"file:{tiny_image.disk}", cache)  # what a runtime's pull leaves
    disk = good.path
    assert _sha256(disk) == good.digest

    os.chmod(disk, 0o644)  # what a stray writer (or a failing disk) would do to the read-only entry
    if damage == "flipped":  # same size: only the content tells
        with open(disk, "r+b") as f:
            f.seek(disk.stat().st_size // 2)
            block = f.read(4096)
            f.seek(-len(block), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in block))
    else:
        os.truncate(disk, disk.stat().st_size // 2)
    os.chmod(disk, 0o444)
    assert _sha256(disk) != good.digest

    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"}
    rt = await start_runtime(spec, extra_args=["--cache-dir", str(cache)])
    # once the disk is pulled the guest boots; the flipped case also waits for it to be Ready
    state = await (rt.client().wait_ready(240) if damage == "flipped"
                   else wait_phase(rt.client(), "Running", "Ready", timeout=240))
    assert state.image_digest == good.digest
    assert _sha256(disk) == good.digest, "the corrupted entry is still in the cache"
    assert "pulling it again" in rt.log_text(), rt.log_text()[-2000:]
    if damage == "flipped":
        await _marker(rt, "tiny")


def _fill(path: Path) -> None:
    """Write ``path`` until its file system has no room left."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 512):
            try:
                while True:
                    f.write(bytes(chunk))
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


@contextlib.contextmanager
def _held(directory: Path) -> Iterator[None]:
    """Every file in ``directory`` open: what the runtime removes meanwhile (the lease's overlay, the
    captured boot's frozen disk under it) keeps its blocks, and a full directory stays full."""
    with contextlib.ExitStack() as held:
        for path in directory.rglob("*"):
            if path.is_file():
                held.enter_context(open(path, "rb"))
        yield


async def _kept_and_restored_with_room(client: RuntimeClient, cache: Path, filler: Path) -> None:
    """The one snapshot is still in ``cache``; with ``filler`` gone, power on restores it."""
    snapshots = [p for p in (cache / "snapshots").iterdir() if not p.name.startswith(".")]
    assert len(snapshots) == 1, snapshots
    filler.unlink()
    await client.power("on")
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored", state.snapshot


async def test_no_room_for_a_restores_overlay_fails_the_boot_and_keeps_the_snapshot(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    """The state dir full at a recycle whose overlay was not made ahead: the host's problem, not the
    snapshot's. The boot fails naming it and the snapshot stays in the cache (which other runtimes
    may share); once there is room, power on restores it. (It was discarded as refused, and the cold
    boot that followed failed on the same full directory.)"""
    cache = tmp_path / "cache"  # this test's own: it counts the snapshots there
    with tmpfs(tmp_path / "state", "8m") as state_dir:
        rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"}, cache=cache,
                                 extra_args=["--state-dir", str(state_dir)])
        client = rt.client()
        await client.wait_ready(240)
        assert (await client.wait_stored()).snapshot.available
        ahead = state_dir / "overlay-ahead.qcow2"
        await file_made(ahead)  # (removed while qemu-img wrote it, its blocks were freed after the fill)
        ahead.unlink()  # as if there had been no room for it either
        with _held(state_dir):
            _fill(state_dir / "filler")
            with pytest.raises(HostError, match=r"overlay.*No space left on device"):
                await client.recycle()
        assert (await client.state()).phase.value == "Error"
        await _kept_and_restored_with_room(client, cache, state_dir / "filler")


async def test_no_room_for_the_captured_boots_overlay_fails_the_boot_and_keeps_the_snapshot(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    """The state dir full as the first Ready is captured: the guest can go on neither in its process
    (no room for its new overlay) nor restored in a new one (no room for that one's). The boot fails
    saying so, and the snapshot, stored in the cache, stays; once there is room, power on restores it."""
    cache = tmp_path / "cache"
    with tmpfs(tmp_path / "state", "8m") as state_dir:
        rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M",
                                  "readiness": {"pattern": "CAPTURE-NOW", "timeout": 300}}, cache=cache,
                                 extra_args=["--state-dir", str(state_dir)])
        client = rt.client()
        con = await Console.open_when_served(rt.shared / "console.sock")
        try:
            await con.wake()
            with _held(state_dir):
                _fill(state_dir / "filler")
                con.writer.write(b"echo CAPTURE-\'\'NOW\n")  # its output, not the echo of the typed line, matches
                await con.writer.drain()
                state = await wait_phase(client, "Error", timeout=60)
        finally:
            await con.close()
        message = (state.last_error or {}).get("message", "")
        assert "overlay" in message and "No space left on device" in message, state.last_error
        await _kept_and_restored_with_room(client, cache, state_dir / "filler")


async def test_a_capture_the_cache_cannot_store_leaves_the_guest_ready_and_no_snapshot(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    # the cache holds the tiny guest's image (13 MiB) but not its snapshot's RAM (~140 MiB): the
    # capture's pause copies the RAM into memory, the store after Ready hits ENOSPC
    with tmpfs(tmp_path / "cache", "40m") as cache:
        rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"},
                                 extra_args=["--cache-dir", str(cache)])
        client = rt.client()
        await client.wait_ready(240)
        state = await client.wait_stored()
        assert state.phase.value == "Ready" and not state.snapshot.available, state.snapshot
        reason = state.snapshot.reason or ""
        assert "could not be written" in reason and "give the cache volume room" in reason, reason
        assert list((cache / "snapshots").glob("*")) == [], "a half-stored snapshot was kept"
        assert await _answers(rt, "STILL")  # the lease's guest runs on
        # the next boot finds no snapshot: cold, and Ready again
        await client.recycle()
        state = await client.wait_ready(240)
        assert state.snapshot.boot == "cold", state.snapshot


async def test_a_capture_whose_state_file_cannot_be_made_leaves_the_guest_running(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    # the capture's staging directory goes while the guest boots (as a failing cache volume, or one
    # out of inodes, would refuse the file): the device state's file cannot be made once the guest is
    # paused for the capture; the guest must run on, Ready, uncaptured, and the next boot capture
    cache = tmp_path / "cache"
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"},
                             extra_args=["--cache-dir", str(cache)])
    client = rt.client()
    staging = await wait_until_async(lambda: list((cache / "snapshots").glob(".incoming-*")), timeout=120,
                                     what="the capture's staging directory")
    assert (await client.state()).phase.value in ("Pulling", "Starting", "Running")  # before the capture
    for path in staging:
        subprocess.run(["rm", "-rf", str(path)], check=True)
    await client.wait_ready(240)
    state = await client.wait_stored()
    assert state.phase.value == "Ready" and not state.snapshot.available, state.snapshot
    reason = state.snapshot.reason or ""
    assert "could not be written" in reason and "No such file or directory" in reason, reason
    assert await _answers(rt, "RUNS")  # not left paused
    await client.recycle()  # the next boot captures
    state = await client.wait_ready(240)
    assert state.snapshot.boot == "cold", state.snapshot
    state = await client.wait_stored()
    assert state.snapshot.available, state.snapshot


@pytest.mark.parametrize("form", ["templated", "stream"])
async def test_a_cache_where_no_snapshot_can_be_staged_boots_cold_and_says_why(
    start_runtime: Any, tiny_image: Any, tmp_path: Path, form: str
) -> None:
    # the cache's snapshots/ cannot be a directory (a file holds its name: as a cache volume out of
    # inodes, read-only, or another UID's would refuse it): no capture can be staged, the boot must
    # not depend on one
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "snapshots").write_text("not a directory\n")
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"},
                             extra_args=["--cache-dir", str(cache)], env={"VMSIDECAR_SNAPSHOT_FORM": form})
    client = rt.client()
    state = await client.wait_ready(240)
    state = await client.wait_stored()
    assert state.phase.value == "Ready" and not state.snapshot.available, state.snapshot
    reason = state.snapshot.reason or ""
    assert "could not be staged" in reason and str(cache / "snapshots") in reason and "File exists" in reason, reason
    assert await _answers(rt, "COLD")
    await client.recycle()  # and every boot after it, cold
    await client.wait_ready(240)
    state = await client.wait_stored()
    assert state.snapshot.boot == "cold" and "could not be staged" in (state.snapshot.reason or ""), state.snapshot
