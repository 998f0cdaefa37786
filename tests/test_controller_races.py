"""Recycles and leases under the races of docs/reliability.md (the "races" row and the lease rows
of the attack table), on the in-memory hypervisor (tests/fixtures/fake_backend.py): each race is
made to happen for sure (a pull, a stop or a capture held open until the test lets it go), so the
interleaving the real-guest tests (tests/test_races.py, test_attack_leases.py,
test_runtime_lifecycle.py) hit by timing is hit here every run, in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.fake_backend import Build, FakeHypervisor, FakeVm, HeldPull, Images, fake_spec, until, watch
from fixtures.waiting import wait_until_async
from vmsidecar_contract.blocking import ReadyWait
from vmsidecar_contract.errors import (
    GenerationChangedError,
    GuestError,
    StateError,
    TransferError,
    VmsidecarError,
)
from vmsidecar_contract.spec import READY_MARKER
from vmsidecar_contract.state import Phase
from vmsidecar_runtime.hostpaths import HostPathPolicy

pytestmark = pytest.mark.timeout(60)

READY, RUNNING, STOPPED = Phase.READY, Phase.RUNNING, Phase.STOPPED


async def _ready(fvm: FakeVm) -> None:
    await fvm.vm.power_on()
    await until(fvm.vm, READY)


def _allow(images: Images) -> HostPathPolicy:
    """The administrator's --allow-host-paths for the flashed image (flashes are API calls)."""
    return HostPathPolicy((images.other.parent,))


# ---- the "races" row -----------------------------------------------------------------------
async def test_concurrent_power_requests_and_recycles_never_run_two_hypervisors(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    vm, hv = fvm.vm, fvm.hv
    await _ready(fvm)
    calls = [vm.power_on(), vm.cycle(), vm.power_off(graceful=False), vm.recycle(), vm.power_on(), vm.reset(),
             vm.cycle(), vm.claim(), vm.recycle(), vm.power_off(), vm.power_on()]
    results = await asyncio.gather(*calls, return_exceptions=True)
    unexpected = [r for r in results if isinstance(r, BaseException)
                  and not (isinstance(r, StateError) and r.code == "wrong_phase")]
    assert not unexpected, unexpected
    assert hv.max_alive == 1 and len(hv.alive()) <= 1
    state = await vm.recycle()
    await until(vm, READY)
    assert state.generation == vm.generation and len(hv.alive()) == 1 and hv.max_alive == 1


async def test_concurrent_dumps_each_get_their_own_whole_file_while_a_recycle_waits(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    vm = fvm.vm
    await _ready(fvm)
    await vm.power_off()
    results = await asyncio.gather(*(vm.dump() for _ in range(4)), vm.recycle(boot=False))
    outs, recycled = results[:4], results[4]
    try:
        assert len({str(p) for p in outs}) == 4  # type: ignore[union-attr]
        assert len({p.read_bytes() for p in outs}) == 1  # type: ignore[union-attr]
    finally:
        for out in outs:
            out.unlink()  # type: ignore[union-attr]
    assert recycled.generation == 1  # type: ignore[union-attr]
    assert not list(fvm.paths.state.glob("dump-*"))


async def test_a_forward_port_taken_before_the_hypervisor_binds_it_is_retried_on_new_ports(
        fake_vm: Build, fake_images: Images) -> None:
    hv = FakeHypervisor(ports_stolen=1)
    spec = fake_spec(fake_images.base, network={"forwards": [{"name": "web", "guest_port": 80}]})
    fvm = await fake_vm(spec, hv=hv)
    await _ready(fvm)
    stolen = hv.thieves[0].getsockname()[1]
    first, second = hv.backends
    assert first.exit_info is not None and first.exit_info.returncode == 1 and second.alive
    assert fvm.vm.state().forwards["web"] != f"127.0.0.1:{stolen}" and hv.max_alive == 1
    hv.ports_stolen = 1  # and again at the recycle's boot
    await fvm.vm.recycle()
    state = await until(fvm.vm, READY)
    assert state.generation == 1 and len(hv.backends) == 4 and hv.max_alive == 1


async def test_a_vm_powered_on_during_a_flash_pull_is_not_powered_off_by_the_flash(
        fake_vm: Build, fake_images: Images) -> None:
    """``flash_reference`` (power_off=false) checks the phase again under the lock after its pull."""
    held = HeldPull(f"file:{fake_images.other}")
    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=held, host_paths=_allow(fake_images))
    vm = fvm.vm
    await _ready(fvm)
    before = await vm.power_off()
    flash = asyncio.create_task(vm.flash_reference(f"file:{fake_images.other}"))
    await held.wait_started()
    on = await vm.power_on()
    assert on.phase == RUNNING and on.boot == before.boot + 1 and not flash.done()
    held.release.set()
    with pytest.raises(StateError) as exc:
        await flash
    assert exc.value.code == "wrong_phase" and "power_off=true" in exc.value.message
    state = await until(vm, READY)
    assert state.boot == on.boot and state.image_digest == before.image_digest and fvm.hv.max_alive == 1


async def test_a_new_lease_never_reads_the_previous_leases_console(fake_vm: Build, fake_images: Images) -> None:
    """The recycle ends every reader of the lease (EOF); one that connects after it gets none of its bytes."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    vm, hv = fvm.vm, fvm.hv
    await _ready(fvm)
    reader, writer = await asyncio.open_unix_connection(fvm.paths.shared / "console.sock")
    writer.write(b"echo lease-one-secret\n")  # typed by lease 1, echoed by the guest's shell
    await reader.readuntil(b"lease-one-secret")
    await vm.recycle()
    await until(vm, READY)
    reader2, writer2 = await asyncio.open_unix_connection(fvm.paths.shared / "console.sock")
    try:
        hv.current.type(b"lease-two-marker\r\n")
        seen = await asyncio.wait_for(reader2.readuntil(b"lease-two-marker"), 5)
        rest = await asyncio.wait_for(reader.read(), 5)  # returns: lease 1's reader was ended (EOF)
    finally:
        writer.close()
        writer2.close()
    assert b"lease-one-secret" not in seen and READY_MARKER.encode() in seen
    assert b"lease-two-marker" not in rest


async def test_wait_ready_gives_up_on_a_vm_that_stays_stopped(fake_vm: Build, fake_images: Images) -> None:
    """What ``wait_ready`` decides, on the states a recycle without boot leaves (one Stopped that lasts)."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    await _ready(fvm)
    await fvm.vm.recycle(boot=False)
    wait = ReadyWait(10, 0.2, time.monotonic())
    with pytest.raises(GuestError, match="nothing is booting it; power it on"):
        await wait_until_async(lambda: wait.ready(fvm.vm.state().phase.value, fvm.vm.state().last_error,
                                                  time.monotonic()), 10, "wait_ready's verdict", interval=0.02)


# ---- leases: the transfer of lease N against the recycle and the claim of lease N+1 ----------
async def test_a_flash_pull_of_lease_n_never_lands_in_lease_n_plus_1(fake_vm: Build, fake_images: Images) -> None:
    held = HeldPull(f"file:{fake_images.other}")
    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=held, host_paths=_allow(fake_images))
    vm = fvm.vm
    await vm.claim()
    await _ready(fvm)
    base = vm.state().image_digest
    async with watch(vm) as ev:
        flash = asyncio.create_task(vm.flash_reference(f"file:{fake_images.other}", power_off=True))
        await held.wait_started()
        await vm.recycle(if_generation=0)  # lease N ends
        claimed = await vm.claim()  # lease N+1 starts
        held.release.set()
        with pytest.raises(TransferError) as exc:
            await flash
    assert exc.value.code == "transfer_cancelled" and "nothing of it was installed" in exc.value.message
    assert ev.of("transfer_cancelled")[0].data["generation"] == 0
    assert claimed.generation == 1 and claimed.claimed
    state = await until(vm, READY)
    assert state.image_digest == base and state.boot == claimed.boot and not list(fvm.paths.flashed.glob("*"))


async def test_a_second_transfer_while_one_runs_is_refused(fake_vm: Build, fake_images: Images) -> None:
    held = HeldPull(f"file:{fake_images.other}")
    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=held, host_paths=_allow(fake_images))
    vm = fvm.vm
    first = asyncio.create_task(vm.flash_reference(f"file:{fake_images.other}"))
    await held.wait_started()
    for second in (vm.flash_reference(f"file:{fake_images.other}"), vm.flash(_stalled(fake_images.other))):
        with pytest.raises(TransferError) as exc:
            await second
        assert exc.value.code == "transfer_in_progress"
    held.release.set()
    assert (await first).image_digest is not None and vm.phase == STOPPED


async def _stalled(path: Path, sent: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """An upload that sends its first 64 KiB and then nothing (the client stalls, holding the lock)."""
    yield path.read_bytes()[:65536]
    if sent is not None:
        sent.set()
    await asyncio.Event().wait()


async def test_an_upload_flash_stalled_holding_the_lock_is_cancelled_by_the_recycle(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    vm = fvm.vm
    await _ready(fvm)
    base = vm.state().image_digest
    sent = asyncio.Event()
    flash = asyncio.create_task(vm.flash(_stalled(fake_images.other, sent), power_off=True))
    await asyncio.wait_for(sent.wait(), 5)
    started = time.monotonic()
    state = await asyncio.wait_for(vm.recycle(), 5)
    assert time.monotonic() - started < 1.0 and state.generation == 1
    with pytest.raises(TransferError) as exc:
        await flash
    assert exc.value.code == "transfer_cancelled"
    assert (await until(vm, READY)).image_digest == base and not list(fvm.paths.flashed.glob("*"))


async def test_a_pull_whose_client_went_away_is_cancelled_and_never_installed(
        fake_vm: Build, fake_images: Images) -> None:
    held = HeldPull(f"file:{fake_images.other}")
    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=held, host_paths=_allow(fake_images))
    vm = fvm.vm
    await _ready(fvm)
    base = vm.state().image_digest
    transfer = vm.transfers.begin("the flash from a client that goes away")
    flash = asyncio.create_task(vm.flash_reference(f"file:{fake_images.other}", power_off=True, transfer=transfer))
    await held.wait_started()
    vm.transfers.cancel("its client went away", transfer)
    with pytest.raises(TransferError) as exc:
        await flash
    assert exc.value.code == "transfer_cancelled" and "its client went away" in exc.value.message
    state = vm.state()
    assert state.phase == READY and state.image_digest == base and fvm.hv.current.alive  # not even powered off


async def test_a_pull_past_its_deadline_ends_with_pull_timeout_and_frees_the_slot(
        fake_vm: Build, fake_images: Images) -> None:
    held = HeldPull(f"file:{fake_images.other}")
    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=held, host_paths=_allow(fake_images), pull_timeout=1.5)
    vm = fvm.vm
    started = time.monotonic()
    with pytest.raises(TransferError) as exc:
        await vm.flash_reference(f"file:{fake_images.other}")
    assert exc.value.code == "pull_timeout" and "--pull-timeout" in exc.value.message
    # the deadline also bounds the recycle's own pull of the base below: 0.3 s was too short for
    # that real pull on a loaded CI machine
    assert 1.5 <= time.monotonic() - started < 5
    vm.transfers.end(vm.transfers.begin("the next flash"))  # the slot is free again
    await vm.recycle()
    assert (await until(vm, READY)).generation == 1


# ---- leases: claims against boots, captures and recycles ------------------------------------
async def test_a_claim_during_the_first_boots_pull_answers_at_once(fake_vm: Build, fake_images: Images) -> None:
    held = HeldPull(f"file:{fake_images.base}")
    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=held)
    vm = fvm.vm
    boot = asyncio.create_task(vm.power_on())
    await held.wait_started()
    # the exporter's claim at hand-out carries its spec (the same); it waits for the claim before it
    # serves the lease (the spec's call waited for the pull's lock: the claim timed out, and a lease
    # using only CAN was never recycled)
    claimed = await asyncio.wait_for(vm.claim(token="lease-token", spec=fake_spec(fake_images.base)), 1)
    assert claimed.claimed and claimed.generation == 0 and claimed.phase == Phase.PULLING
    held.release.set()
    await boot
    assert (await until(vm, READY)).generation == 0 and vm.state().claimed


async def test_a_pool_pods_first_claim_takes_its_spec_and_answers_during_the_pull(
        fake_vm: Build, fake_images: Images) -> None:
    """A pool pod's runtime starts with no spec; the first tree's claim brings it (the start-up
    tree's offer may not have landed yet): it answered only after the whole pull."""
    held = HeldPull(f"file:{fake_images.base}")
    fvm = await fake_vm(None, pull_fn=held, host_paths=_allow(fake_images))
    vm = fvm.vm
    claimed = await asyncio.wait_for(vm.claim(token="lease-token", spec=fake_spec(fake_images.base)), 1)
    assert claimed.claimed and claimed.generation == 0 and vm.spec == fake_spec(fake_images.base)
    await held.wait_started()
    held.release.set()
    assert (await until(vm, READY)).generation == 0 and vm.state().claimed


async def test_a_recycle_during_the_first_boots_pull_waits_for_that_boot_then_recycles(
        fake_vm: Build, fake_images: Images) -> None:
    held = HeldPull(f"file:{fake_images.base}")
    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=held)
    vm = fvm.vm
    boot = asyncio.create_task(vm.power_on())
    await held.wait_started()
    recycle = asyncio.create_task(vm.recycle(if_generation=0))
    await asyncio.wait({recycle}, timeout=0.1)  # must stay: time for a recycle that did not wait to happen
    assert not recycle.done() and vm.generation == 0 and vm.phase == Phase.PULLING
    held.release.set()
    await boot
    state = await recycle
    assert state.generation == 1 and (await until(vm, READY)).boot == 1 and fvm.hv.max_alive == 1


async def test_a_lease_handed_out_during_the_cold_boot_keeps_that_boot_from_being_captured(
        fake_vm: Build, fake_images: Images) -> None:
    hv = FakeHypervisor(ready_line=None)
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    vm = fvm.vm
    await vm.power_on()
    await vm.claim()  # the exporter hands a lease out while the first boot is not Ready yet
    hv.current.type(READY_MARKER.encode() + b"\r\n")  # the lease's own activity, then Ready
    state = await until(vm, READY)
    assert not state.snapshot.available and "a lease was handed out" in (state.snapshot.reason or "")
    assert len(hv.backends) == 1 and not hv.current.saving.is_set()
    hv.ready_line = FakeHypervisor.ready_line
    await vm.recycle()  # the next pristine boot captures
    state = await until(vm, READY)
    assert state.snapshot.available and hv.backends[1].saving.is_set()


async def test_a_claim_during_a_capture_waits_until_it_is_done(fake_vm: Build, fake_images: Images) -> None:
    gate = asyncio.Event()
    hv = FakeHypervisor(save_gate=gate)
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    vm = fvm.vm
    await vm.power_on()
    await asyncio.wait_for(hv.current.saving.wait(), 5)  # the unclaimed first boot is being captured
    claim = asyncio.create_task(vm.claim())
    await asyncio.wait({claim}, timeout=0.1)  # must stay: time for a claim that did not wait to answer
    assert not claim.done() and vm.phase == RUNNING
    gate.set()
    claimed = await asyncio.wait_for(claim, 5)
    assert claimed.phase == READY and claimed.snapshot.available and claimed.generation == 0
    # the lease's recycle restores what was captured before it
    await vm.recycle(if_generation=0)
    assert vm.state().snapshot.boot == "restored"


async def test_a_recycle_during_a_capture_waits_for_it_then_restores_it(fake_vm: Build, fake_images: Images) -> None:
    gate = asyncio.Event()
    hv = FakeHypervisor(save_gate=gate)
    fvm = await fake_vm(fake_spec(fake_images.base, snapshot="auto"), hv=hv)
    vm = fvm.vm
    await vm.power_on()
    await asyncio.wait_for(hv.current.saving.wait(), 5)
    recycle = asyncio.create_task(vm.recycle())
    await asyncio.wait({recycle}, timeout=0.1)  # must stay: time for a recycle that did not wait to start
    assert not recycle.done() and vm.generation == 0 and not hv.current.stopping.is_set()
    gate.set()
    state = await asyncio.wait_for(recycle, 5)
    assert state.phase == READY and state.generation == 1 and state.snapshot.boot == "restored"
    assert hv.max_alive == 1


@pytest.mark.parametrize("event", ["crash", "guest_poweroff", "disk_error"])
async def test_a_guest_that_fails_as_the_recycle_begins_never_fails_the_next_lease(
        fake_vm: Build, fake_images: Images, event: str) -> None:
    """The event of lease N's guest arrives while the recycle holds the lock: it is lease N's, and
    the next lease's guest is neither Crashed, nor Stopped, nor in Error because of it."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    vm, hv = fvm.vm, fvm.hv
    await _ready(fvm)
    old = hv.current
    async with watch(vm) as ev:
        # each event is delivered before the recycle is called, and the recycle takes the lock
        # before the event's handler task first runs: the handler waits behind the whole recycle
        if event == "crash":
            await old.crash()  # EXITED is reported as the process ends (no yield in between)
        else:
            if event == "guest_poweroff":
                old.guest_poweroff()
            else:
                old.disk_error(nospace=True)
            await asyncio.sleep(0)  # the fake reports these from the loop: delivered during this yield
        await vm.recycle()
        state = await until(vm, READY)
        await asyncio.sleep(0.05)  # must stay: the queued handler runs now, after the recycle, if it runs at all
    assert state.generation == 1 and vm.phase == READY and hv.current is not old and hv.max_alive == 1
    assert ev.phases[ev.phases.index("Starting"):] == ["Starting", "Running", "Ready"]
    assert "Crashed" not in ev.phases and vm.state().last_error is None and vm.state().last_exit is None


async def test_recycle_of_a_crashed_guest_boots_the_next_lease(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await _ready(fvm)
    await fvm.hv.current.crash()
    await until(fvm.vm, Phase.CRASHED)
    async with watch(fvm.vm) as ev:
        await fvm.vm.recycle()
        state = await until(fvm.vm, READY)
    assert ev.phases == ["Stopped", "Starting", "Running", "Ready"] and state.last_exit is None
    assert state.last_error is None and state.generation == 1


async def test_a_recycle_while_the_hypervisor_is_slow_to_stop_starts_the_next_one_after_it(
        fake_vm: Build, fake_images: Images) -> None:
    gate = asyncio.Event()
    hv = FakeHypervisor(stop_gate=gate)
    fvm = await fake_vm(fake_spec(fake_images.base), hv=hv)
    vm = fvm.vm
    await _ready(fvm)
    recycle = asyncio.create_task(vm.recycle())
    await asyncio.wait_for(hv.current.stopping.wait(), 5)
    on = asyncio.create_task(vm.power_on())  # a power request of the next lease, during the stop
    await asyncio.wait({on}, timeout=0.1)  # must stay: time for a launch that did not wait to begin
    assert len(hv.backends) == 1 and vm.phase == Phase.STOPPING and not recycle.done() and not on.done()
    gate.set()
    await recycle
    await on
    assert (await until(vm, READY)).generation == 1 and len(hv.backends) == 2 and hv.max_alive == 1


async def test_two_recycles_of_one_generation_recycle_once(fake_vm: Build, fake_images: Images) -> None:
    """The exporter's late recycle of lease N and the next lease's racing one: one wins, one is a no-op."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    vm = fvm.vm
    await _ready(fvm)
    results = await asyncio.gather(vm.recycle(if_generation=0), vm.recycle(if_generation=0),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, VmsidecarError)]
    assert len(errors) == 1 and isinstance(errors[0], GenerationChangedError) and vm.generation == 1
    assert (await until(vm, READY)).generation == 1 and fvm.hv.max_alive == 1


# ---- a call of lease N queued behind lease N+1's claim --------------------------------------------
async def test_a_call_of_lease_n_that_waited_behind_the_next_claim_never_acts_on_its_guest(
        fake_vm: Build, fake_images: Images, tmp_path: Path) -> None:
    """The power lock is held (:func:`_lock_held`), the next lease's claim waits for it, and
    lease N sends one more call: it passed the generation check (N was still the VM's, claimed) and
    waited for the lock behind the claim, then powered off lease N+1's fresh guest. It must be
    refused once it has the lock, naming both generations."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    await _ready(fvm)
    async with _served_api(fvm, tmp_path) as (lease_n, exporter):
        lease_n.generation = (await lease_n.claim()).generation
        hold = asyncio.create_task(_lock_held(fvm.vm, 2))
        await wait_until_async(fvm.vm._phases.lock.locked, 5, "the lock to be held")
        claim = asyncio.create_task(exporter.claim())  # lease N+1 handed out: waits for the lock
        await wait_until_async(fvm.vm._phases.lock.wanted.is_set, 5, "the claim to wait for the lock")
        late = asyncio.create_task(lease_n.power("off", graceful=False))  # lease N, once more
        await asyncio.sleep(0.3)  # (it is past the generation check and waits for the lock too)
        state = await claim
        assert state.generation == lease_n.generation + 1 and state.claimed
        with pytest.raises(GenerationChangedError, match=f"generation {lease_n.generation}, which has ended"):
            await late
        await until(fvm.vm, READY)
        assert fvm.vm.generation == state.generation and fvm.vm.phase == READY, "lease N+1's guest was touched"
        await hold


async def test_a_claim_whose_caller_gave_up_while_it_waited_for_the_lock_does_nothing(
        fake_vm: Build, fake_images: Images, tmp_path: Path) -> None:
    """The lock is held past a claim's bound (:func:`_lock_held`); a claim (an ended lease's
    tree's, its client given up: the exporter's claims are bounded) waits for it, and the VM's
    current lease (here the one already claimed) goes on. Once the lock frees, the runtime carried
    the claim out for nobody: it recycled the current lease's guest under it. A claim whose caller
    has gone is dropped when it gets the lock."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    await _ready(fvm)
    async with _served_api(fvm, tmp_path) as (current, gone):
        held = (await current.claim(token="current-lease")).generation
        hold = asyncio.create_task(_lock_held(fvm.vm, 1.5))
        await wait_until_async(fvm.vm._phases.lock.locked, 5, "the lock to be held")
        with pytest.raises(TimeoutError):  # the caller gives up while its claim waits for the lock
            await asyncio.wait_for(gone.claim(token="ended-lease"), 0.5)
        await hold
        await asyncio.sleep(0.5)  # (the dropped claim has had the lock)
        state = await current.state()
        assert state.generation == held and state.claimed, f"a claim nobody waited for recycled the VM: {state}"
        assert (await current.claim(token="current-lease")).generation == held, "the current lease lost the VM"
        assert fvm.hv.current.alive and len(fvm.hv.backends) == 1, "the current lease's guest was recycled"


@contextlib.asynccontextmanager
async def _served_api(fvm: Any, tmp_path: Path) -> AsyncIterator[tuple[Any, Any]]:
    """The controller's API on a Unix socket, and two clients of it; the guest is forced off at the end."""
    from aiohttp import web

    from vmsidecar_contract.client import RuntimeClient
    from vmsidecar_runtime.api.server import make_app

    runner = web.AppRunner(make_app(fvm.vm))
    await runner.setup()
    sock = Path(f"/tmp/vmr-{id(tmp_path)}.sock")
    await web.UnixSite(runner, str(sock)).start()
    first, second = RuntimeClient(sock), RuntimeClient(sock)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()
        await runner.cleanup()
        sock.unlink(missing_ok=True)
        await fvm.vm.power_off(graceful=False)


async def _lock_held(vm: Any, seconds: float) -> None:
    """The power lock held for ``seconds``, as it can still be held past a claim's bound: a pod's
    first pull of a large image, or, under an exporter that names no spec, the boot of the image a
    lease set (docs/security.md, rows 65-66). (A graceful power-off the guest ignores, which these
    tests held it with before, is cut short by the next claim now; so is a lease's own boot.)"""
    async with vm._phases.lock:
        await asyncio.sleep(seconds)


def test_a_lease_whose_claim_outlasts_its_bound_is_claimed_later_and_recycled(
        fake_images: Images, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree handed to a lease claims in ``reset()`` within a bound (120 s); past it, the tree gave up
    for good unless the runtime did not answer at all: served unclaimed, a lease that used only CAN
    (which asks the runtime nothing) was never recycled, and the next lease got its guest. Here the
    runtime holds its power lock past the bound (:func:`_lock_held`); the tree must claim once
    it can, and recycle at its close."""
    import jumpstarter_driver_vmsidecar.link as link_module
    from fixtures.fake_backend import served_on_a_thread
    from jumpstarter_driver_vmsidecar.driver import VirtualMachine
    from vmsidecar_contract.client import RuntimeClient

    monkeypatch.setattr(link_module, "CLAIM_TIMEOUT_S", 1.0)
    spec = fake_spec(fake_images.base)
    with served_on_a_thread(tmp_path / "vm", spec, FakeHypervisor()) as served:
        vm = served.fvm.vm

        async def lease_n_holds_the_lock() -> Any:
            async with RuntimeClient(served.socket) as client:
                client.generation = (await client.claim()).generation
                await client.power("on")
                await client.wait_ready(30)
                return asyncio.create_task(_lock_held(vm, 4))

        tree = VirtualMachine(socket=str(served.socket), spec=spec.model_dump(mode="json"), recycle="InPlaceReuse")
        hold = served.run(lease_n_holds_the_lock())
        served.run(wait_until_async(vm._phases.lock.locked, 5, "lease N's power-off to hold the lock"))
        tree.reset()  # lease N+1 handed out: its claim waits behind the lock past its bound
        assert tree.link.claimed_generation is None, "the claim did not wait for the lock: no race here"
        deadline = time.monotonic() + 20
        while tree.link.claimed_generation is None and time.monotonic() < deadline:
            time.sleep(0.1)
        # the claim given up at its bound is still carried out once the lock is free; the retry names
        # the same token, so it is answered with that generation, not recycled a second time
        assert tree.link.claimed_generation == 1, "the tree never claimed once the runtime could answer"
        assert vm.generation == 1 and vm.state().claimed, vm.state()
        tree.close()  # the lease ends: its generation is recycled
        assert vm.generation == 2, f"the lease's generation was not recycled ({vm.generation})"
        del hold


def test_the_last_leases_claim_retry_never_lands_after_the_next_leases_claim(
        fake_images: Images, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's lock is held past the claim's bound (:func:`_lock_held`, until released
    here); lease N's tree gives its claim up at the bound and retries in the background; lease N+1
    is handed out (0.9.0 builds its tree before it closes lease N's) and claims. A retry of lease
    N's sent after that claim was carried out after it: it recycled lease N+1's guest, and the VM
    was lease N's, whose lease had ended. Now lease N+1's tree supersedes lease N's: no retry of
    lease N's is sent after lease N+1's claim."""
    import jumpstarter_driver_vmsidecar.link as link_module
    from fixtures.fake_backend import served_on_a_thread
    from jumpstarter_driver_vmsidecar.driver import SPEC_RETRY_EVERY_S, SUPERSEDE_WAIT_S, VirtualMachine
    from vmsidecar_contract.client import RuntimeClient

    spec = fake_spec(fake_images.base)
    with served_on_a_thread(tmp_path / "vm", spec, FakeHypervisor()) as served:
        vm = served.fvm.vm
        held: list[asyncio.Task[None]] = []

        async def the_lock_held() -> asyncio.Event:
            async with RuntimeClient(served.socket) as client:  # lease N-1 has the VM
                await client.claim(token="lease-n-minus-1")
            release = asyncio.Event()

            async def hold() -> None:
                async with vm._phases.lock:
                    await release.wait()

            held.append(asyncio.create_task(hold()))
            return release

        async def release_it(release: asyncio.Event) -> None:
            release.set()

        release = served.run(the_lock_held())
        served.run(wait_until_async(vm._phases.lock.locked, 5, "the lock to be held"))
        tree_n = VirtualMachine(socket=str(served.socket), spec=spec.model_dump(mode="json"), recycle="InPlaceReuse")
        tree_n1 = VirtualMachine(socket=str(served.socket), spec=spec.model_dump(mode="json"), recycle="InPlaceReuse")
        try:
            monkeypatch.setattr(link_module, "CLAIM_TIMEOUT_S", 1.0)
            tree_n.reset()  # lease N: its claim gives up at its bound, then retries in the background
            assert tree_n.link.claimed_generation is None, "the claim did not wait for the lock: no race here"
            monkeypatch.setattr(link_module, "CLAIM_TIMEOUT_S", 60.0)  # the next attempts wait for the lock
            next_lease = threading.Thread(target=tree_n1.reset)  # lease N+1 handed out: its claim waits
            next_lease.start()
            time.sleep(SUPERSEDE_WAIT_S + 4 * SPEC_RETRY_EVERY_S)  # (lease N's retry had sent one more by now)
            served.run(release_it(release))
            next_lease.join(30)
            assert not next_lease.is_alive(), "lease N+1's claim never got an answer"
            time.sleep(1.0)  # anything queued behind it has had the lock
            state = vm.state()
            assert tree_n1.link.claimed_generation == state.generation and state.claimed, (
                f"lease N+1 claimed generation {tree_n1.link.claimed_generation}, the VM is at {state.generation}: "
                "a claim after its own recycled its guest")
            assert tree_n.link.claimed_generation is None, "lease N's tree claimed after the next lease was handed out"
        finally:
            tree_n1.close()
            tree_n.close()
            served.run(release_it(release))


async def test_a_claim_asked_again_with_its_token_is_answered_not_made_twice(
        fake_vm: Build, fake_images: Images) -> None:
    """A claim whose answer was lost (the tree gave up at its bound while the runtime carried it out)
    is asked again: with the same token it gets the generation it holds; a second claim without one,
    or with another token (the next lease), recycles as any claim of a claimed generation does."""
    fvm = await fake_vm(fake_spec(fake_images.base))
    await _ready(fvm)
    first = await fvm.vm.claim(token="lease-one-token")
    assert (first.generation, first.claimed) == (0, True)
    again = await fvm.vm.claim(token="lease-one-token")
    assert again.generation == 0 and fvm.hv.current.alive and len(fvm.hv.backends) == 1, "claimed twice"
    other = await fvm.vm.claim(token="lease-two-token")
    assert other.generation == 1, "another lease's claim did not recycle"
    assert (await fvm.vm.claim(token="lease-one-token")).generation == 2, "a past lease's token held the VM"
