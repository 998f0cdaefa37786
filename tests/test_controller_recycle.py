"""Leases on the in-memory hypervisor (tests/fixtures/fake_backend.py): recycle and claim from
every phase, memory snapshots (capture, restore, refusals), and the recycle races that
test_controller_races.py (the races of docs/reliability.md) does not make. The controller is
driven through its public calls only.

The real-guest versions: tests/test_races.py, test_attack_leases.py, test_snapshots.py,
test_runtime_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from fixtures.fake_backend import (
    RD,
    SP,
    ST,
    Build,
    C,
    E,
    FakeHypervisor,
    FakeVm,
    Images,
    P,
    R,
    S,
    console_shows,
    fake_spec,
    keep_overlay,
    until,
    watch,
)
from vmsidecar_contract.errors import GenerationChangedError, VmsidecarError
from vmsidecar_contract.spec import READY_MARKER
from vmsidecar_contract.state import VmState
from vmsidecar_runtime.hostpaths import HostPathPolicy
from vmsidecar_runtime.plan import SERIAL

RECYCLED = [SP, S, ST, R, RD]
FORWARD = {"forwards": [{"name": "web", "guest_port": 80}]}


async def ready(fvm: FakeVm) -> VmState:
    await fvm.vm.power_on()
    return await until(fvm.vm, RD)


async def recycled(fvm: FakeVm, **kw: Any) -> VmState:
    await fvm.vm.recycle(**kw)
    return await until(fvm.vm, RD)


def allow(images: Images) -> HostPathPolicy:
    return HostPathPolicy((images.other.parent,))


# ---- recycle and claim ---------------------------------------------------------------------------
async def test_recycle_boots_a_fresh_guest_in_the_next_generation(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    before = await ready(fvm)
    overlay = keep_overlay(fvm)
    async with watch(fvm.vm) as seen:
        state = await recycled(fvm)
    assert seen.phases == RECYCLED and seen.of("phase")[1].data["reason"] == "recycled"
    assert seen.of("recycled")[0].data["generation"] == 1 and seen.of("recycled")[0].generation == 1
    assert state.generation == 1 and state.boot == before.boot == 1 and not state.claimed
    assert state.image_digest == before.image_digest and "pulled" not in seen.types  # the cache keeps the base
    assert not os.path.samefile(overlay, fvm.paths.overlay) and len(fvm.hv.alive()) == 1


async def test_recycle_without_a_boot_stays_stopped_with_no_disk_of_the_lease(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        state = await fvm.vm.recycle(boot=False)
    assert seen.phases == [SP, S] and state.phase == S and state.generation == 1
    assert not fvm.paths.overlay.exists() and not fvm.hv.alive()


@pytest.mark.parametrize("fault", ["crash", "io_error", "readiness"])
async def test_recycle_recovers_a_failed_guest(fake_vm: Build, fake_images: Images, fault: str) -> None:
    hv = FakeHypervisor(ready_line=None if fault == "readiness" else FakeHypervisor().ready_line)
    # a readiness that fails fast only where the test wants it to fail
    readiness = {"readiness": {"timeout": 0.1}} if fault == "readiness" else {}
    fvm = await fake_vm(fake_spec(fake_images.base, **readiness), hv=hv)
    await fvm.vm.power_on()
    if fault == "crash":
        await until(fvm.vm, RD)
        await hv.current.crash()
    elif fault == "io_error":
        await until(fvm.vm, RD)
        hv.current.disk_error(nospace=True)
    failed = await until(fvm.vm, C if fault == "crash" else E)
    assert failed.last_error is not None
    hv.ready_line = FakeHypervisor().ready_line
    await fvm.vm.set_spec(fake_spec(fake_images.base), from_api=False)
    async with watch(fvm.vm) as seen:
        state = await recycled(fvm)
    # a crashed hypervisor is gone already: nothing to stop
    assert seen.phases == (RECYCLED[1:] if fault == "crash" else RECYCLED)
    assert state.last_error is None and state.last_exit is None and state.generation == 1
    assert len(hv.alive()) == 1


async def test_a_flashed_disk_goes_with_its_lease(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base), host_paths=allow(fake_images))
    base = (await ready(fvm)).image_digest
    flashed = await fvm.vm.flash_reference(f"file:{fake_images.other}", power_off=True)
    assert flashed.image_digest != base
    state = await recycled(fvm)
    assert state.image_digest == base and state.snapshot.boot == "cold"


async def test_a_recycle_of_a_generation_already_recycled_is_refused(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    await recycled(fvm, if_generation=0)
    async with watch(fvm.vm) as seen:
        with pytest.raises(GenerationChangedError) as exc:
            await fvm.vm.recycle(if_generation=0)
    assert exc.value.code == "generation_changed" and "generation 0 was already recycled (now 1)" in exc.value.message
    assert seen.types == [] and fvm.vm.generation == 1


async def test_a_claim_takes_the_generation_and_a_second_claim_recycles_it_first(
        fake_vm: Build, fake_images: Images) -> None:
    """The second claim is the next exporter's after one died mid-lease: its lease must never see
    the first one's guest."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    before = await ready(fvm)
    async with watch(fvm.vm) as seen:
        claimed = await fvm.vm.claim()
    assert seen.types == ["claimed"] and claimed.claimed and claimed.generation == 0 and claimed.boot == before.boot
    overlay = keep_overlay(fvm)
    async with watch(fvm.vm) as seen:
        again = await fvm.vm.claim()
        await until(fvm.vm, RD)
    assert seen.phases == RECYCLED and again.claimed and again.generation == 1
    assert seen.types.index("recycled") < seen.types.index("claimed")
    assert not os.path.samefile(overlay, fvm.paths.overlay) and len(fvm.hv.alive()) == 1


# ---- memory snapshots ------------------------------------------------------------------------------
async def test_the_first_pristine_boot_is_captured_and_every_recycle_restores_it(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"))
    async with watch(fvm.vm) as seen:
        first = await ready(fvm)
    # Ready comes once the capture has been restored (which proves it loads), not at the marker
    assert seen.phases == [P, S, ST, R, RD] and first.snapshot.boot == "cold" and first.snapshot.available
    assert first.snapshot.capture_seconds is not None and first.snapshot.clock == "corrected"
    cold, continued = fvm.hv.backends
    assert not cold.alive and continued.alive and continued.restored and fvm.hv.clock_sets == 1
    async with watch(fvm.vm) as seen:
        state = await recycled(fvm)
    assert seen.phases == RECYCLED and state.snapshot.boot == "restored" and state.snapshot.reason is None
    restored = fvm.hv.current
    assert restored.restored and b"fake kernel booting" not in restored.printed["ttyS0"]
    # ... yet its console shows the pristine boot, as captured
    assert b"fake kernel booting" in await console_shows(fvm, READY_MARKER.encode())
    assert fvm.hv.clock_sets == 2 and fvm.hv.max_alive == 1


async def test_a_restored_guest_is_ready_before_its_clock_and_a_claim_and_console_input_wait_for_it(
        fake_vm: Build, fake_images: Images) -> None:
    """A restore is Ready as the guest runs; its clock is set through the agent after that
    (docs/decisions.md, "Ready before the clock"). Until it is, what a console client types waits in
    the runtime and a claim is not answered: nothing of the next lease reaches the guest on the
    capture's clock."""
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"))
    await ready(fvm)
    assert fvm.hv.clock_sets == 1  # the captured boot's
    fvm.hv.agent_gate = asyncio.Event()  # the restored guest's agent reads nothing yet
    state = await recycled(fvm)
    assert state.snapshot.boot == "restored" and state.snapshot.clock == "setting", state.snapshot
    restored = fvm.hv.current
    _, writer = await asyncio.open_unix_connection(str(fvm.paths.stream_socket(SERIAL)))
    try:
        writer.write(b"typed-before-the-clock\n")
        await writer.drain()
        claim = asyncio.ensure_future(fvm.vm.claim())
        await asyncio.sleep(0.5)
        assert not claim.done(), "the claim was answered before the restored guest's clock was set"
        assert b"typed-before-the-clock" not in restored.typed and fvm.hv.clock_sets == 1
        fvm.hv.agent_gate.set()
        claimed = await asyncio.wait_for(claim, 5)
        assert claimed.claimed and claimed.snapshot.clock == "corrected", claimed.snapshot
        assert fvm.hv.clock_sets == 2
        async with asyncio.timeout(5):
            while b"typed-before-the-clock" not in restored.typed:
                await asyncio.sleep(0.02)
    finally:
        writer.close()


async def test_a_claim_that_comes_during_a_recycle_is_answered_once_the_restored_guest_has_its_clock(
        fake_vm: Build, fake_images: Images, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jumpstarter 0.9.0 reports the exporter available before it closes the ended lease's tree, so
    the next lease's claim can come while that tree's recycle runs, its generation already moved on
    (unclaimed) and its guest not booted yet: such a claim waits for the recycle, then for the
    restored guest's clock. The recycle's boot is held where a real one waits for the last
    capture's store (``SnapshotOps.drop_staging``), which the in-memory hypervisor never makes."""
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"))
    await ready(fvm)
    store_written = asyncio.Event()
    drop_staging = fvm.vm._snapshots.drop_staging

    async def store_still_being_written() -> None:
        await store_written.wait()
        await drop_staging()

    monkeypatch.setattr(fvm.vm._snapshots, "drop_staging", store_still_being_written)
    fvm.hv.agent_gate = asyncio.Event()
    async with fvm.vm.events.listen({"recycled"}) as queue:
        recycle = asyncio.create_task(fvm.vm.recycle())
        await asyncio.wait_for(queue.get(), 5)  # the generation moved on; its boot waits for the store
    claim = asyncio.create_task(fvm.vm.claim())
    await asyncio.wait({claim}, timeout=0.3)  # must stay: time for a claim that did not wait to answer
    assert not claim.done(), f"answered before the recycle's boot: {claim.result()}"
    store_written.set()
    assert (await asyncio.wait_for(recycle, 5)).snapshot.clock == "setting"
    await asyncio.wait({claim}, timeout=0.3)
    assert not claim.done(), f"answered before the clock was set: {claim.result().snapshot}"
    fvm.hv.agent_gate.set()
    claimed = await asyncio.wait_for(claim, 5)
    assert claimed.claimed and claimed.generation == 1 and claimed.snapshot.clock == "corrected", claimed


async def test_a_guest_stopped_while_its_clock_is_set_records_the_failure_and_the_next_boot_sets_its_own(
        fake_vm: Build, fake_images: Images) -> None:
    """A restore stopped before its agent read the clock says so on its own boot (not `setting`
    for ever); the next restore sets and shows its own."""
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"))
    await ready(fvm)
    fvm.hv.agent_gate = asyncio.Event()
    assert (await recycled(fvm)).snapshot.clock == "setting"
    stopped = await fvm.vm.recycle(boot=False)  # the guest goes while its agent has not read the clock
    assert stopped.phase == S
    async with asyncio.timeout(5):
        while (fvm.vm.state().snapshot.clock or "") == "setting":
            await asyncio.sleep(0.02)
    assert (fvm.vm.state().snapshot.clock or "").startswith("failed:"), fvm.vm.state().snapshot
    fvm.hv.agent_gate.set()
    state = await recycled(fvm)
    claimed = await asyncio.wait_for(fvm.vm.claim(), 5)
    assert state.snapshot.boot == "restored" and claimed.snapshot.clock == "corrected", claimed.snapshot
    assert fvm.hv.clock_sets == 2


async def test_a_restore_a_lease_already_has_is_ready_only_once_its_clock_is_set(
        fake_vm: Build, fake_images: Images) -> None:
    """Ready comes before the clock only for a guest no lease has yet (the claim then waits for
    it). A lease that powers its VM on (after a recycle without a boot), or that claimed during the
    pull, waits for Ready: for it, Ready is a guest on the host's clock."""
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"))
    await ready(fvm)
    await fvm.vm.recycle(boot=False)
    await fvm.vm.claim()
    fvm.hv.agent_gate = asyncio.Event()
    power_on = asyncio.create_task(fvm.vm.power_on())
    await asyncio.wait({power_on}, timeout=0.5)  # must stay: time for a Ready that did not wait
    assert fvm.vm.phase == R and not power_on.done(), fvm.vm.state().snapshot
    fvm.hv.agent_gate.set()
    await asyncio.wait_for(power_on, 5)
    state = await until(fvm.vm, RD)
    assert state.claimed and state.snapshot.boot == "restored" and state.snapshot.clock == "corrected", state


async def test_a_restored_guest_that_reboots_at_once_starts_a_new_boot(fake_vm: Build, fake_images: Images) -> None:
    # a restore runs no firmware: a reset right after it is the guest's, however soon (the real guest:
    # tests/test_faults_process.py::test_a_restored_guest_that_reboots_at_once_starts_a_new_boot)
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"))
    await ready(fvm)
    before = await recycled(fvm)
    assert before.snapshot.boot == "restored"
    async with watch(fvm.vm) as seen:
        fvm.hv.current.guest_reboot()  # well within RESET_COALESCE_S of the restore's start
        await seen.next("boot")
        state = await until(fvm.vm, RD)
    assert seen.of("boot")[0].data["reason"] == "guest reboot" and seen.phases == [R, RD]
    assert state.boot == before.boot + 1 and state.generation == before.generation


async def test_a_guest_the_hypervisor_cannot_snapshot_runs_on_and_is_not_asked_again(
        fake_vm: Build, fake_images: Images) -> None:
    hv = FakeHypervisor(refuse_save="device 'vfio' blocks migration")
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    state = await ready(fvm)
    reason = "QEMU cannot snapshot this guest: QEMU cannot snapshot this guest (device 'vfio' blocks migration)"
    assert state.snapshot.reason == reason and not state.snapshot.available
    assert len(hv.backends) == 1 and not hv.current.paused  # resumed where it was
    state = await recycled(fvm)
    assert state.snapshot.boot == "cold" and state.snapshot.reason == reason and len(hv.backends) == 2


async def test_a_capture_failing_on_a_bugs_exception_is_error_naming_it_and_power_on_recovers(
        fake_vm: Build, fake_images: Images) -> None:
    """An exception nobody raises on purpose (a bug; injected into the hypervisor's save, the one
    way to produce it) while the guest is paused for its capture: the capture's task died with it,
    the guest stayed paused for good and the phase where it was (reliability.md). It must end in
    Error naming it, the guest stopped, and a power on must boot and capture again."""
    hv = FakeHypervisor(save_bugs=[RuntimeError("injected: a bug in the capture")])
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    await fvm.vm.power_on()
    state = await until(fvm.vm, E)
    assert state.last_error is not None and state.last_error["error"] == "internal_error", state.last_error
    assert "RuntimeError" in state.last_error["message"] and "injected: a bug" in state.last_error["message"]
    assert len(hv.backends) == 1 and not hv.backends[0].alive, "the paused guest was left running"
    assert not list((fvm.paths.cache / "snapshots").glob(".incoming-*")), "the capture's staging was left"
    await fvm.vm.power_on()
    await until(fvm.vm, RD)  # the same disk: a power cycle, not captured
    assert (await recycled(fvm)).snapshot.available  # a fresh disk, captured this time
    assert (await recycled(fvm)).snapshot.boot == "restored"


async def test_a_capture_failing_on_a_bugs_exception_after_its_pause_leaves_no_staging(
        fake_vm: Build, fake_images: Images, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same net after the pause: a bug's exception as the capture is committed into the store
    (injected there: no real input raises one) left the staging directory, a guest's worth of
    files, in the cache until the runtime exited (reliability.md). It must go with the error."""
    from vmsidecar_runtime.snapshots import SnapshotStore

    real_commit = SnapshotStore.commit
    bugs = [RuntimeError("injected: a bug in the store")]

    def commit(self: SnapshotStore, *args: Any, **kwargs: Any) -> Any:
        if bugs:
            raise bugs.pop()
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "commit", commit)
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"))
    await fvm.vm.power_on()
    state = await until(fvm.vm, E)
    assert state.last_error is not None and state.last_error["error"] == "internal_error", state.last_error
    assert "injected: a bug in the store" in state.last_error["message"], state.last_error
    assert not list((fvm.paths.cache / "snapshots").glob(".incoming-*")), "the capture's staging was left"
    await fvm.vm.power_on()
    await until(fvm.vm, RD)
    assert (await recycled(fvm)).snapshot.available
    assert (await recycled(fvm)).snapshot.boot == "restored"


@pytest.mark.parametrize("bug", [False, True], ids=["stored", "bug-in-the-store"])
async def test_a_captured_guest_that_went_on_is_stored_beside_it_and_a_bug_in_that_store_leaves_no_staging(
        fake_vm: Build, fake_images: Images, monkeypatch: pytest.MonkeyPatch, bug: bool) -> None:
    """A guest that goes on in its process after its capture (as under QEMU) has its snapshot written
    into the store beside it, in a task of its own. A bug's exception there (injected into the
    store's commit) killed the task: no reason said, the staging directory left in the cache until
    the runtime exited (reliability.md). The guest runs on, Ready; the reason names the bug; the
    next cold boot captures again."""
    from vmsidecar_runtime.snapshots import SnapshotStore

    real_commit = SnapshotStore.commit
    bugs = [RuntimeError("injected: a bug in the background store")] if bug else []

    def commit(self: SnapshotStore, *args: Any, **kwargs: Any) -> Any:
        if bugs:
            raise bugs.pop()
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "commit", commit)
    hv = FakeHypervisor(switches_disks=True)
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    await fvm.vm.power_on()
    await until(fvm.vm, RD)
    async with asyncio.timeout(10):  # the snapshot is written beside the guest that went on
        while (state := fvm.vm.state()).snapshot.storing:
            await asyncio.sleep(0.01)
    assert len(hv.backends) == 1 and hv.current.alive and not hv.current.paused, "the guest did not go on"
    assert state.phase == RD and state.snapshot.available is not bug, state.snapshot
    assert not list((fvm.paths.cache / "snapshots").glob(".incoming-*")), "the capture's staging was left"
    if bug:
        reason = state.snapshot.reason or ""
        assert "RuntimeError" in reason and "injected: a bug in the background store" in reason, reason
    state = await recycled(fvm)
    assert state.snapshot.boot == ("cold" if bug else "restored"), state.snapshot
    assert (await recycled(fvm)).snapshot.boot == "restored"


async def test_a_snapshot_the_hypervisor_refuses_to_load_is_discarded_and_taken_again(
        fake_vm: Build, fake_images: Images) -> None:
    hv = FakeHypervisor()
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    await ready(fvm)
    hv.refusing_restores = 1
    async with watch(fvm.vm) as seen:
        state = await recycled(fvm)
    assert seen.phases == RECYCLED and state.snapshot.boot == "cold" and state.snapshot.available
    assert state.snapshot.reason is not None and "the snapshot was refused" in state.snapshot.reason
    # cold, continued | refused restore, cold again, continued from the new capture
    assert len(hv.backends) == 5 and hv.backends[2].exit_info is not None and hv.backends[2].exit_info.returncode == 1
    assert (await recycled(fvm)).snapshot.boot == "restored"


async def test_a_guest_whose_fresh_snapshots_never_load_becomes_ready_and_is_not_captured_again(
        fake_vm: Build, fake_images: Images) -> None:
    # A snapshot QEMU saves and cannot load (a device's state that does not migrate): the capture's
    # restore failed, the boot went cold, captured again at Ready, failed again... and was never Ready.
    hv = FakeHypervisor(refusing_restores=1000)
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    state = await ready(fvm)
    assert state.snapshot.boot == "cold" and not state.snapshot.available, state.snapshot
    assert "refused twice" in (state.snapshot.reason or ""), state.snapshot
    # cold, refused restore, cold, refused restore, cold (not captured)
    assert len(hv.backends) == 5 and hv.current.alive and not hv.current.paused
    state = await recycled(fvm)
    assert state.snapshot.boot == "cold" and "refused twice" in (state.snapshot.reason or "") and len(hv.backends) == 6


async def test_libvirt_guests_boot_cold_and_say_why(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto", backend="libvirt"))
    state = await ready(fvm)
    assert state.snapshot.reason == "the libvirt backend has no memory snapshots yet" and len(fvm.hv.backends) == 1


# ---- races with a recycle that test_controller_races.py does not make ----------------------------
async def test_a_forward_port_taken_at_every_attempt_is_an_error(fake_vm: Build, fake_images: Images) -> None:
    hv = FakeHypervisor()
    fvm = await fake_vm(fake_spec(fake_images.base, network=FORWARD), hv=hv)
    await ready(fvm)
    hv.ports_stolen = 3
    with pytest.raises(VmsidecarError, match="Could not set up host forwarding rule"):
        await fvm.vm.recycle()
    assert fvm.vm.phase == E and len(hv.backends) == 4 and not hv.alive()


async def test_a_new_lease_hands_no_reader_the_previous_leases_console(fake_vm: Build, fake_images: Images) -> None:
    hv = FakeHypervisor()
    fvm = await fake_vm(fake_spec(fake_images.base), hv=hv)
    await ready(fvm)
    # a reader that stopped reading while the guest printed more than its socket and queue hold
    reader, writer = await asyncio.open_unix_connection(str(fvm.paths.stream_socket("ttyS0")))
    hv.current.type(b"lease-one-secret " * (256 << 10 >> 4))
    hv.current.type(b"lease-one-end\r\n")
    await console_shows(fvm, b"lease-one-end")
    hv.boot_lines = (b"lease-two firmware\r\n",)
    await recycled(fvm)
    got = bytearray()
    async with asyncio.timeout(5):
        while chunk := await reader.read(1 << 20):
            got += chunk
    writer.close()
    assert b"lease-two" not in got  # it ended (EOF) with the previous lease, never into the next one
    fresh = await console_shows(fvm, READY_MARKER.encode())
    assert b"lease-one" not in fresh and b"lease-two firmware" in fresh


@pytest.mark.parametrize("meanwhile", ["crash", "guest_poweroff"])
async def test_a_recycle_whose_stop_hangs_is_not_taken_for_a_crash_or_a_power_off(
        fake_vm: Build, fake_images: Images, meanwhile: str) -> None:
    gate = asyncio.Event()
    hv = FakeHypervisor(stop_gate=gate)
    fvm = await fake_vm(fake_spec(fake_images.base), hv=hv)
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        recycle = asyncio.create_task(fvm.vm.recycle())
        await hv.current.stopping.wait()
        assert fvm.vm.state().phase == SP  # answered at once, the stop holding the lock
        if meanwhile == "crash":
            await hv.current.crash()
        else:
            hv.current.guest_poweroff()
        gate.set()
        state = await recycle
        await until(fvm.vm, RD)
    assert seen.phases == RECYCLED and C not in seen.phases
    assert state.generation == 1 and fvm.vm.state().last_error is None
    assert len(hv.alive()) == 1
