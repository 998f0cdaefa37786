"""A lease holder's pulls (``POST /v1/vm/disk/pull``, the storage driver's ``flash oci://…``) from a
registry of their own that answers slowly, used against the runtime.

- A pull from a registry that trickles its answer (a byte a second: no socket read ever times
  out) and is then cancelled (its client goes away). Its blocking work ran in the event loop's
  default thread pool (``asyncio.to_thread``, min(32, CPUs + 4) threads) and a cancel only told the
  thread to stop at its next blob chunk, which never came: a handful of such pulls took every
  thread, and every later ``to_thread`` (the recycle's clean-up of the lease's files) queued behind
  them for ever, with the power lock held; ``POST /v1/shutdown`` never ended the process either
  (Python 3.11's ``asyncio.run`` waits for the pool's threads). A cancelled image check left its
  ``qemu-img`` running.
- Lease N holds the power lock while the next lease's claim waits for it, and lease N starts
  one more pull meanwhile: the claim had cancelled the transfer before it took the lock, and its
  recycle never cancelled again, so lease N's pull kept the VM's one transfer slot in lease N+1
  (its flash refused with 409, quoting lease N's reference).

- Lease N dumps its disk (``GET /v1/vm/disk``, ``j vm storage dump``) and ends while the disk is
  converted for it: the conversion held the power lock to its end (minutes for a large disk), and
  the lease's recycle and the next lease's claim waited for it; a claim gives up after 120 s.

Real runtime processes and real HTTP servers on loopback (a registry that misbehaves on purpose);
``qemu-img`` is a real one, behind a script that makes only its ``check`` (or ``convert``) hang (so
that a cancel is sure to find it running, as it would find a large disk's).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.events import collecting
from fixtures.trickle import Trickle
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import TransferError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_runtime.oci import push_artifact

pytestmark = pytest.mark.timeout(300)

#: the pool of ``asyncio.to_thread`` in the runtime (Python 3.11: min(32, os.cpu_count() + 4)), and
#: two more pulls than it has threads, at least 8
POOL = min(32, (os.cpu_count() or 1) + 4)
PULLS = max(8, POOL + 2)
#: generous bounds: each is milliseconds once nothing waits on a pull's thread
RECYCLE_BOUND_S = 30.0
EXIT_BOUND_S = 30.0
#: threads the runtime may have beyond its count before the pulls (an idle worker of the loop's
#: pool that the recycle's clean-up started, say)
THREAD_SLACK = 2
def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def exits_within(rt: Any, seconds: float) -> int | None:
    """The runtime's exit code, or None when it still runs after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (rc := rt.proc.poll()) is not None:
            return int(rc)
        await asyncio.sleep(0.1)
    return None


async def start_then_cut(rt: Any, reference: str, registry: Trickle, events: Any) -> bool:
    """``POST /v1/vm/disk/pull`` of ``reference``; once its answer trickles in (or, when it never
    reaches the registry, after 10 s) its client goes away. Returns whether it reached the registry.
    Waits until the runtime has cancelled it (its transfer slot is free again)."""
    repo = reference.split("/", 1)[1].rsplit(":", 1)[0]
    gone = rt.client()
    pull = asyncio.create_task(gone.flash_reference(reference))
    try:
        await wait_until_async(lambda: repo in registry.started or pull.done(), 10, f"the pull of {repo} to start")
        reached = True
    except AssertionError:
        reached = False  # queued in the runtime, behind the pulls before it
    assert not pull.done(), f"the pull of {reference} ended by itself: {pull.exception()!r}"
    pull.cancel()
    await gone.close()  # the client goes away mid-pull: the runtime cancels the pull
    await events.wait_for(lambda e: e["type"] == "transfer_cancelled" and f"/{repo}:" in e["data"]["what"], 15)
    return reached


# ---- a cancelled pull leaves no thread behind ----------------------------------------------------
@pytest.mark.parametrize("stage", ["manifest", "blob"])
async def test_cancelled_pulls_from_a_trickling_registry_leave_the_runtime_whole(
        start_runtime: Any, tmp_path: Path, stage: str) -> None:
    """More cancelled pulls from a trickling registry than the loop's pool has threads; then the
    next lease's recycle and claim complete, the runtime drops every connection to that registry,
    its thread count comes back to what it was, and ``POST /v1/shutdown`` ends the process."""
    rt = await start_runtime({"memory": "256M"}, cache=tmp_path / "cache")  # no image: nothing boots
    client = rt.client()
    await client.claim()
    baseline = thread_count(rt.proc.pid)
    with Trickle(stage) as registry:
        async with collecting(rt.client(), ["transfer_cancelled"]) as events:
            reached = [await start_then_cut(rt, f"{registry.host}/evil/pull{i}:1", registry, events)
                       for i in range(PULLS)]
            queued = [i for i, r in enumerate(reached) if not r]
            held = thread_count(rt.proc.pid) - baseline
            started = time.monotonic()
            try:
                await asyncio.wait_for(client.claim(), RECYCLE_BOUND_S)  # the next lease: recycles first
                await asyncio.wait_for(client.recycle(boot=False), RECYCLE_BOUND_S)  # and its end
            except TimeoutError:
                pytest.fail(f"after {PULLS} cancelled pulls the claim and recycle did not complete within "
                            f"{RECYCLE_BOUND_S:g} s (pulls that never reached the registry, queued behind the "
                            f"others: {queued}; threads held: {held})")
            took = time.monotonic() - started
        assert not queued, f"pulls {queued} waited for a thread that earlier, cancelled pulls held"
        await wait_until_async(lambda: registry.open == 0, 15, "the runtime to drop its connections to the registry",
                               detail=lambda: f"{registry.open} trickled answers still have a reader")
    await wait_until_async(lambda: thread_count(rt.proc.pid) <= baseline + THREAD_SLACK, 15,
                           f"the runtime's threads to come back to {baseline} (+{THREAD_SLACK})",
                           detail=lambda: f"{thread_count(rt.proc.pid)} threads")
    await client.shutdown()
    rc = await exits_within(rt, EXIT_BOUND_S)
    assert rc == 0, f"the runtime did not exit within {EXIT_BOUND_S:g} s of POST /v1/shutdown (rc {rc})"
    print(f"\n{PULLS} cancelled pulls ({stage} trickled): claim + recycle in {took:.2f} s, "
          f"{held} threads over the baseline right after the cancels")


#: a qemu-img whose ``{command}`` hangs (its pid written to ``{pids}`` first), every time or
#: (``{once}``: ``mkdir`` of a marker, which only the first call makes) the first time; every other
#: call is the real one
HANGING_QEMU_IMG = """#!/bin/sh
if [ "$1" = {command} ] {once}; then echo $$ >> "{pids}"; exec sleep 600; fi
exec {real} "$@"
"""


def _hanging(tmp_path: Path, command: str, *, once: bool = False) -> Iterator[tuple[Path, Path]]:
    """``(directory to put first on PATH, the file the hanging commands write their pids to)``; any
    such command still running at the end is killed."""
    real = shutil.which("qemu-img")
    assert real is not None, "qemu-img is not installed"
    shim_dir, pids = tmp_path / "shim", tmp_path / f"{command}-pids"
    shim_dir.mkdir()
    shim = shim_dir / "qemu-img"
    first_only = f'&& mkdir "{pids}.once" 2>/dev/null' if once else ""
    shim.write_text(HANGING_QEMU_IMG.format(command=command, once=first_only, pids=pids, real=real))
    shim.chmod(0o755)
    try:
        yield shim_dir, pids
    finally:
        for pid in _pids(pids):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _shim_env(shim_dir: Path) -> dict[str, str]:
    """The environment that runs the shim for qemu-img: first on ``PATH``, and unconfined (it writes
    its pid in the test's directory, which qemu-img's Landlock domain refuses)."""
    return {"PATH": f"{shim_dir}:{os.environ['PATH']}", "VMSIDECAR_QEMU_CONFINEMENT": "off"}


@pytest.fixture
def hanging_qemu_img(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A qemu-img whose ``check`` hangs (:func:`_hanging`)."""
    yield from _hanging(tmp_path, "check")


@pytest.fixture
def hanging_convert(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A qemu-img whose ``convert`` hangs, as a large disk's dump takes minutes (:func:`_hanging`)."""
    yield from _hanging(tmp_path, "convert")


@pytest.fixture
def first_check_hangs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A qemu-img whose first ``check`` hangs, as a large image's does (:func:`_hanging`)."""
    yield from _hanging(tmp_path, "check", once=True)


def _pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it was killed and waits to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def test_a_cancelled_pull_kills_the_qemu_img_checking_its_disk(
        start_runtime: Any, registry: Any, oci_qcow2: Path, hanging_qemu_img: tuple[Path, Path],
        tmp_path: Path) -> None:
    """A pull cancelled while ``qemu-img check`` reads its disk: the check is killed, not left to
    run to its own deadline (300 s) on an image the runtime gave up."""
    shim_dir, pids = hanging_qemu_img
    reference = f"{registry.host}/attack/check-cancel:1"
    await asyncio.to_thread(push_artifact, oci_qcow2, reference, compression=None)
    rt = await start_runtime({"memory": "256M"}, cache=tmp_path / "cache",
                             env=_shim_env(shim_dir))
    async with collecting(rt.client(), ["transfer_cancelled"]) as events:
        gone = rt.client()
        pull = asyncio.create_task(gone.flash_reference(reference))
        await wait_until_async(lambda: _pids(pids) or pull.done(), 60, "qemu-img check to start")
        assert not pull.done(), f"the pull ended before its check: {pull.exception()!r}"
        [check] = _pids(pids)
        pull.cancel()
        await gone.close()
        await events.wait_for("transfer_cancelled", 15)
    await wait_until_async(lambda: not _alive(check), 15, f"the cancelled pull's qemu-img check (pid {check}) to end")


async def test_a_cancelled_image_check_kills_its_qemu_img(
        oci_qcow2: Path, hanging_qemu_img: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``disk.check_image`` (the check of a cached disk before it boots or is flashed) given up by
    its caller: its qemu-img is killed and reaped before the cancellation goes on."""
    from vmsidecar_runtime.disk import check_image

    shim_dir, pids = hanging_qemu_img
    for name, value in _shim_env(shim_dir).items():
        monkeypatch.setenv(name, value)
    task = asyncio.create_task(check_image(oci_qcow2, "qcow2"))
    await wait_until_async(lambda: _pids(pids) or task.done(), 30, "qemu-img check to start")
    assert not task.done(), f"the check ended by itself: {task.exception()!r}"
    [check] = _pids(pids)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    alive = _alive(check)
    if alive:  # else the thread waiting for it would hold this test's loop at its close
        os.kill(check, signal.SIGKILL)
    assert not alive, f"qemu-img check (pid {check}) still runs after its caller gave up"


# ---- a pull of lease N started while the next lease's claim waits -------------------------------
async def test_a_pull_lease_n_starts_while_the_next_claim_waits_is_cancelled_by_that_claim(
        start_runtime: Any, tiny_image: Any, first_check_hangs: tuple[Path, Path], tmp_path: Path) -> None:
    """The power lock is held by what no lease's end cuts (the pod's first boot, its image's check
    taking long: here a ``qemu-img check`` that hangs once), lease N claims meanwhile (an unclaimed
    generation is claimed without the lock), lease N+1's claim waits for the lock, and lease N
    starts a flash meanwhile (its calls still pass: the VM is still its). The claim's recycle must
    cancel that flash: lease N+1's own flash is not refused (409 ``transfer_in_progress`` naming
    lease N's reference)."""
    shim_dir, pids = first_check_hangs
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"},
                             cache=tmp_path / "cache", env=_shim_env(shim_dir))
    with Trickle("manifest") as registry:
        lease_n, exporter, lease_n1 = rt.client(), rt.client(), rt.client()
        await wait_until_async(lambda: _pids(pids), 60, "the first boot's image check to start")
        lease_n.generation = (await lease_n.claim(token="lease-n-token")).generation
        async with collecting(rt.client(), ["transfer_cancelled"]) as events:
            first = asyncio.create_task(lease_n.flash_reference(f"{registry.host}/evil/first:1", power_off=True))
            await wait_until_async(lambda: "evil/first" in registry.started or first.done(), 30,
                                   "lease N's first flash to start")
            # lease N+1 is handed out: its claim cancels lease N's flash, then waits for the lock
            claim = asyncio.create_task(exporter.claim(token="lease-n1-token"))
            await events.wait_for(lambda e: "/evil/first:" in e["data"]["what"], 15)
            late = asyncio.create_task(lease_n.flash_reference(f"{registry.host}/evil/late:1", power_off=True))
            await wait_until_async(lambda: "evil/late" in registry.started or late.done(), 30,
                                   "lease N's late flash to start")
            assert not late.done(), f"lease N's late flash was refused: {late.exception()!r}"
            assert not claim.done(), "the claim did not wait for the lock: no race here"
            os.kill(_pids(pids)[0], signal.SIGKILL)  # the first boot's check ends: the lock is free
            state = await asyncio.wait_for(claim, 30)
            assert state.generation == lease_n.generation + 1 and state.claimed, state
            # lease N+1 flashes: the VM's one transfer slot must be free
            lease_n1.generation = state.generation
            own = asyncio.create_task(lease_n1.flash_reference(f"{registry.host}/evil/own:1", power_off=True))
            await wait_until_async(lambda: "evil/own" in registry.started or own.done(), 30,
                                   "lease N+1's flash to start")
            if own.done():
                pytest.fail(f"lease N+1's flash was refused: {own.exception()!r}")
            cancelled = await events.wait_for(lambda e: "/evil/late:" in e["data"]["what"], 15)
            assert cancelled["data"]["generation"] == lease_n.generation, cancelled
            with pytest.raises(TransferError) as late_error:
                await asyncio.wait_for(late, 15)
            assert late_error.value.code == "transfer_cancelled", late_error.value
            with pytest.raises(TransferError):
                await asyncio.wait_for(first, 15)
            own.cancel()


async def test_the_boot_of_an_image_of_lease_ns_own_is_cut_by_the_next_claim(
        start_runtime: Any, tmp_path: Path) -> None:
    """Lease N sets a spec whose image is in a registry of its own that never answers and powers
    on: the boot's pull runs under the power lock, to the pull deadline (30 min by default). The
    next lease's claim must cut it, not wait for it (its client gives up after 120 s)."""
    served = VmSpec.model_validate({"memory": "256M"})
    rt = await start_runtime({"memory": "256M"}, cache=tmp_path / "cache")
    with Trickle("manifest") as registry:
        registry.held["evil/own-boot"] = threading.Event()  # never set: the answer never comes
        exporter, lease_n = rt.client(), rt.client()
        lease_n.generation = (await exporter.claim(token="lease-n-token", spec=served)).generation
        await lease_n.put_spec({"memory": "256M", "image": f"{registry.host}/evil/own-boot:1"})
        await wait_until_async(lambda: "evil/own-boot" in registry.started, 30, "the boot's pull to start")
        assert (await exporter.state()).phase.value == "Pulling"
        started = time.monotonic()
        state = await asyncio.wait_for(exporter.claim(token="lease-n1-token", spec=served), RECYCLE_BOUND_S)
        took = time.monotonic() - started
        assert state.generation == lease_n.generation + 1 and state.claimed, state
        assert state.phase.value == "Stopped", state  # the exporter's spec again: no image to boot
        assert await exporter.get_spec() == served
    print(f"\nthe next claim during lease N's boot of its own image: {took:.2f} s")


async def test_the_snapshot_fetch_of_a_boot_of_lease_ns_own_is_cut_by_the_next_claim(
        start_runtime: Any, registry: Any, oci_qcow2: Path, tmp_path: Path) -> None:
    """Lease N sets a spec of an image of its own from a registry, and boots it, while the pool's
    ``snapshot_source`` (which a lease's spec may keep, never replace: row 40) does not answer: on
    the cache miss the boot asks the source for a snapshot under the power lock, up to the fetch's
    bound (120 s, then 5 s of grace), past the next claim's own bound (120 s). The next lease's
    claim must cut it, not wait for it."""
    image = f"{registry.host}/attack/fetch-held:1"
    await asyncio.to_thread(push_artifact, oci_qcow2, image, compression=None)
    with Trickle("manifest") as source:
        source.held["pool/snaps"] = threading.Event()  # never set: the answer never comes
        served = VmSpec.model_validate({"memory": "256M", "snapshot_source": f"{source.host}/pool/snaps"})
        rt = await start_runtime(served.to_json(), cache=tmp_path / "cache")
        exporter, lease_n = rt.client(), rt.client()
        lease_n.generation = (await exporter.claim(token="lease-n-token", spec=served)).generation
        await lease_n.put_spec({"memory": "256M", "image": image, "snapshot_source": served.snapshot_source})

        async def fetching() -> bool:
            return "pool/snaps" in source.started and (await exporter.state()).phase.value == "Starting"

        await wait_until_async(fetching, 60, "the boot to ask the snapshot_source",
                               detail=lambda: rt.log_text()[-2000:])
        started = time.monotonic()
        state = await asyncio.wait_for(exporter.claim(token="lease-n1-token", spec=served), RECYCLE_BOUND_S)
        took = time.monotonic() - started
        assert state.generation == lease_n.generation + 1 and state.claimed, state
        assert state.phase.value == "Stopped", state  # the exporter's spec again: no image to boot
    print(f"\nthe next claim during lease N's snapshot fetch from its own source: {took:.2f} s")


# ---- a dump under way when its lease ends ---------------------------------------------------------
async def test_a_dump_under_way_when_its_lease_ends_is_cut_and_the_next_claim_does_not_wait_for_it(
        start_runtime: Any, tiny_image: Any, hanging_convert: tuple[Path, Path], tmp_path: Path) -> None:
    """Lease N dumps its disk and is ended by the next lease's claim while qemu-img converts it (a
    large disk's minutes; here a convert that hangs). The claim must not wait for the conversion
    under the power lock: its qemu-img is killed, its partial copy removed, the dump answered
    ``transfer_cancelled``, and lease N+1 has the VM within the bound."""
    shim_dir, pids = hanging_convert
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"},
                             cache=tmp_path / "cache", env=_shim_env(shim_dir))
    exporter, lease_n = rt.client(), rt.client()
    await exporter.recycle(boot=False)  # the guest off: a dump needs it so, and no boot is waited for
    lease_n.generation = (await exporter.claim(token="lease-n-token")).generation
    dump = asyncio.create_task(lease_n.dump(tmp_path / "lease-n.qcow2"))
    await wait_until_async(lambda: _pids(pids) or dump.done(), 60, "the dump's qemu-img convert to start")
    assert not dump.done(), f"the dump ended before its conversion: {dump.exception()!r}"
    [convert] = _pids(pids)
    assert any(p.name.startswith("dump-") for p in rt.state.iterdir()), "the dump's copy is under way"

    started = time.monotonic()
    state = await asyncio.wait_for(exporter.claim(token="lease-n1-token"), RECYCLE_BOUND_S)
    took = time.monotonic() - started
    assert state.generation == lease_n.generation + 1 and state.claimed, state
    with pytest.raises(TransferError) as cut:
        await asyncio.wait_for(dump, 15)
    assert cut.value.code == "transfer_cancelled" and "dump again within a lease" in cut.value.message, cut.value
    assert not _alive(convert), f"lease N's qemu-img convert (pid {convert}) still runs in lease N+1"
    left = sorted(p.name for p in rt.state.iterdir() if p.name.startswith("dump-"))
    assert not left, f"lease N's partial dump is still in the state volume: {left}"
    assert not (tmp_path / "lease-n.qcow2").exists(), "the cut dump was saved as if it were whole"
    print(f"\nthe next lease's claim during lease N's dump: {took:.2f} s")
