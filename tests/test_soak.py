"""Soak (issue 13): 200 recycles of one runtime, sampling every 20 its open fds, RSS, and the files
and disk usage of its state, run and cache temp directories. All must stay flat; the figures are
printed (docs/reliability.md records them)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.faults import Sample, own_temp_files, run_dir_of, sample
from fixtures.runtime import qemu_pids
from fixtures.waiting import wait_until_async
from vmsidecar_contract.process import child_pids

pytestmark = pytest.mark.timeout(900)

RECYCLES = 200
EVERY = 20


def _tools_running(pid: int) -> list[str]:
    """The children of ``pid`` that are no QEMU (a ``qemu-img`` it runs)."""
    names = []
    for child in child_pids(pid):
        try:
            name = os.path.basename(Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0", 1)[0]).decode()
        except OSError:
            continue
        if not name.startswith("qemu-system"):
            names.append(name)
    return names


async def _settled_sample(at: int, pid: int, dirs: list[Path], ahead: Path) -> Sample:
    """A sample once the runtime's work after a Ready is done: the next restore's overlay made
    (``Disks.prepare_ahead`` runs ``qemu-img`` then, whose pipes are open fds meanwhile: a sample
    taken at that moment counted 7 fds more), and the fds counted twice alike 0.1 s apart."""
    await wait_until_async(lambda: ahead.exists() and not _tools_running(pid), 30,
                           "the next restore's overlay to be made", detail=lambda: _tools_running(pid))
    taken = sample(at, pid, dirs)
    for _ in range(50):
        await asyncio.sleep(0.1)
        again = sample(at, pid, dirs)
        if again.fds == taken.fds:
            return again
        taken = again
    return taken


@pytest.mark.slow
async def test_two_hundred_recycles_leave_fds_rss_files_and_disk_flat(
    start_runtime: Any, tiny_image: Any, image_cache: Any
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    await client.wait_ready(240)
    await client.recycle()  # the first Ready may capture the snapshot: start counting from a restore
    state = await client.wait_ready(240, poll=0.05)
    assert state.snapshot and state.snapshot.boot == "restored", state.snapshot
    pid = rt.proc.pid

    def dirs() -> list[Any]:
        # the cache is the suite's: only this runtime's temporary files in it are its own
        return [rt.state, run_dir_of(pid), *own_temp_files(pid, image_cache)]

    ahead = rt.state / "overlay-ahead.qcow2"
    samples = [await _settled_sample(0, pid, dirs(), ahead)]
    started = time.monotonic()
    for n in range(1, RECYCLES + 1):
        await client.recycle()
        state = await client.wait_ready(120, poll=0.05)
        assert state.generation == n + 1 and state.snapshot and state.snapshot.boot == "restored"
        if n % EVERY == 0:
            assert len(qemu_pids(str(rt.state))) == 1
            samples.append(await _settled_sample(n, pid, dirs(), ahead))
    took = time.monotonic() - started
    print(f"\n{RECYCLES} recycles in {took:.1f} s ({took / RECYCLES:.2f} s each, recycle -> Ready)")
    for s in samples:
        print(s.line())
    ref, last = samples[1], samples[-1]  # the 20th: caches and pools have warmed up by then
    assert last.fds - ref.fds <= 4, f"fds {ref.fds} -> {last.fds}"
    assert last.rss_kb - ref.rss_kb <= 24 * 1024, f"RSS {ref.rss_kb} -> {last.rss_kb} KiB"
    assert last.files - ref.files <= 2, f"files {ref.files} -> {last.files}"
    assert last.disk_kb - ref.disk_kb <= 16 * 1024, f"disk {ref.disk_kb} -> {last.disk_kb} KiB"
