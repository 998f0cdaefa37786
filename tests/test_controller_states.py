"""VmController's state machine on the in-memory hypervisor (tests/fixtures/fake_backend.py): every
transition between the phases of ``vmsidecar_contract.state.Phase``, and every refusal, in seconds.

The controller is driven through its public calls only; what the guest or the host does on its
own (a crash, a panic, a full disk, a hung stop) is the fake's. The same behaviour under a real
guest and QEMU is in test_runtime_lifecycle.py, test_faults_*.py and test_snapshots.py; recycles
and the races of docs/reliability.md are in test_controller_recycle.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
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
from vmsidecar_contract.errors import StateError, VmsidecarError
from vmsidecar_contract.spec import READY_MARKER
from vmsidecar_contract.state import Phase
from vmsidecar_runtime.controller import machine
from vmsidecar_runtime.hostpaths import HostPathPolicy

#: ``require``'s wording of the phases a fresh boot may start from, and of those with a live guest
BOOTABLE = "Crashed|Error|Stopped"
LIVE = "Ready|Running|Starting"


async def refused(call: Awaitable[Any], code: str, *words: str) -> VmsidecarError:
    """The error ``call`` ends with: its code, and the words its message must have."""
    with pytest.raises(VmsidecarError) as exc:
        await call
    assert exc.value.code == code, exc.value.message
    for word in words:
        assert word in exc.value.message, exc.value.message
    return exc.value


async def wrong_phase(call: Awaitable[Any], actual: Phase, required: str, *words: str) -> None:
    error = await refused(call, "wrong_phase", *words)
    assert isinstance(error, StateError) and (error.actual, error.required) == (actual.value, required)


async def ready(fvm: FakeVm) -> None:
    await fvm.vm.power_on()
    await until(fvm.vm, RD)


async def chunks(path: Path) -> AsyncIterator[bytes]:
    yield path.read_bytes()


def failing(phase: Phase) -> dict[str, Any]:
    """Spec fields for a guest that fails its readiness fast when the test wants it in Error (the
    fake guest of such a test never prints the marker)."""
    return {"readiness": {"timeout": 0.1}} if phase == E else {}


# ---- power on ----------------------------------------------------------------------------------
async def test_first_power_on_pulls_starts_runs_then_is_ready(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    async with watch(fvm.vm) as seen:
        running = await fvm.vm.power_on()
        state = await until(fvm.vm, RD)
    # Pulling hands back the phase it came from before the boot starts
    assert seen.phases == [P, S, ST, R, RD]
    assert running.phase == R and running.boot == 1 and running.accel == "tcg"
    assert state.image_digest is not None and state.timings.ready is not None and state.timings.pull is not None
    assert [e.data["reason"] for e in seen.of("boot")] == ["power-on"] and len(seen.of("pulled")) == 1
    assert fvm.hv.current.printed["ttyS0"].startswith(b"fake firmware")
    assert len(fvm.hv.alive()) == 1


async def test_start_boots_a_spec_with_an_image_by_itself(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base), boot=True)
    state = await until(fvm.vm, RD)
    assert state.boot == 1 and len(fvm.hv.backends) == 1


async def test_a_runtime_without_an_image_boots_when_a_spec_with_one_arrives(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(None, boot=True)
    assert fvm.vm.phase == S and not fvm.hv.backends
    assert await fvm.vm.set_spec(fake_spec(fake_images.base), from_api=False)
    state = await until(fvm.vm, RD)
    assert state.boot == 1 and state.image == f"file:{fake_images.base}"


async def test_power_on_while_live_is_a_latched_switch(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base), hv=FakeHypervisor(ready_line=None))
    running = await fvm.vm.power_on()
    assert (await fvm.vm.power_on()).boot == running.boot == 1 and fvm.vm.phase == R
    await console_shows(fvm, b"fake kernel booting")
    fvm.hv.current.type(READY_MARKER.encode() + b"\r\n")
    await until(fvm.vm, RD)
    assert (await fvm.vm.power_on()).boot == 1 and len(fvm.hv.backends) == 1


async def test_a_failed_pull_is_error_and_power_off_clears_it(fake_vm: Build, tmp_path: Path) -> None:
    fvm = await fake_vm(fake_spec(tmp_path / "missing.qcow2"))
    async with watch(fvm.vm) as seen:
        error = await refused(fvm.vm.power_on(), "file_not_found", "missing.qcow2")
    assert seen.phases == [P, E] and not fvm.hv.backends
    assert fvm.vm.state().last_error == error.to_dict()
    async with watch(fvm.vm) as seen:
        assert (await fvm.vm.power_off()).phase == S
    assert seen.phases == [S]  # nothing ran: no Stopping


async def test_a_launch_failure_is_error_with_qemus_words_then_power_on_recovers(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base), hv=FakeHypervisor(failing_launches=1))
    async with watch(fvm.vm) as seen:
        await refused(fvm.vm.power_on(), "host_error", "Permission denied", "fix the cause")
    assert seen.phases == [P, S, ST, E] and not fvm.hv.alive()
    assert fvm.vm.state().last_exit is not None and fvm.vm.state().last_exit.returncode == 1
    async with watch(fvm.vm) as seen:
        await ready(fvm)
    assert seen.phases == [ST, R, RD] and len(fvm.hv.alive()) == 1


async def test_a_guest_that_never_gets_ready_is_error_with_its_console_tail(
        fake_vm: Build, fake_images: Images) -> None:
    spec = fake_spec(fake_images.base, **failing(E))
    fvm = await fake_vm(spec, hv=FakeHypervisor(ready_line=None))
    async with watch(fvm.vm) as seen:
        await fvm.vm.power_on()
        state = await until(fvm.vm, E)
    assert seen.phases == [P, S, ST, R, E]
    assert state.last_error is not None and state.last_error["error"] == "guest_error"
    assert "did not print" in state.last_error["message"] and "fake kernel booting" in (state.console_tail or "")
    # the hypervisor still runs: Error -> Stopping -> Stopped ends it
    assert fvm.hv.current.alive
    async with watch(fvm.vm) as seen:
        await fvm.vm.power_off()
    assert seen.phases == [SP, S] and not fvm.hv.alive()


async def test_power_on_from_error_boots_again(fake_vm: Build, fake_images: Images) -> None:
    hv = FakeHypervisor(ready_line=None)
    fvm = await fake_vm(fake_spec(fake_images.base, **failing(E)), hv=hv)
    await fvm.vm.power_on()
    await until(fvm.vm, E)
    hv.ready_line = FakeHypervisor().ready_line
    await fvm.vm.set_spec(fake_spec(fake_images.base), from_api=False)  # the default readiness timeout
    async with watch(fvm.vm) as seen:
        await ready(fvm)
    # the Error's hypervisor still runs: it is ended first, with no Stopped in between
    assert seen.phases == [SP, ST, R, RD] and fvm.vm.state().boot == 2
    assert len(hv.backends) == 2 and len(hv.alive()) == 1  # the Error's hypervisor was ended first


# ---- power off -----------------------------------------------------------------------------------
async def test_graceful_power_off_of_a_ready_guest_presses_the_power_button(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        state = await fvm.vm.power_off(graceful=True, timeout=5)
    assert seen.phases == [SP, S] and state.phase == S
    assert seen.of("phase")[0].data["graceful"] is True
    assert "guest.powerdown_requested" in seen.types and "guest.powered_off" in seen.types
    assert "powerdown_timeout" not in seen.types and not fvm.hv.alive()


async def test_a_guest_ignoring_acpi_is_forced_off_after_the_timeout(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base), hv=FakeHypervisor(acpi=False))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        await fvm.vm.power_off(graceful=True, timeout=0.1)
    assert seen.phases == [SP, S] and seen.of("powerdown_timeout")[0].data["timeout"] == 0.1
    assert not fvm.hv.alive()


async def test_power_off_while_booting_is_hard(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base), hv=FakeHypervisor(ready_line=None))
    await fvm.vm.power_on()
    async with watch(fvm.vm) as seen:
        await fvm.vm.power_off(graceful=True)
    assert seen.phases == [SP, S] and seen.of("phase")[0].data["graceful"] is False
    assert "guest.powerdown_requested" not in seen.types and not fvm.hv.alive()


async def test_power_off_of_a_stopped_vm_changes_nothing(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    async with watch(fvm.vm) as seen:
        assert (await fvm.vm.power_off()).phase == S
    assert seen.types == [] and not fvm.hv.backends


async def test_a_guest_that_powers_itself_off_is_stopped(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        fvm.hv.current.guest_poweroff()
        await until(fvm.vm, S)
    assert seen.phases == [SP, S] and seen.of("phase")[-1].data["reason"] == "guest-shutdown"
    assert not fvm.hv.alive() and fvm.vm.state().last_error is None


async def test_shutdown_stops_the_guest_and_asks_the_runtime_to_exit(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        await fvm.vm.shutdown()
    assert seen.phases == [SP, S] and seen.of("phase")[-1].data["reason"] == "shutdown"
    assert fvm.vm.shutdown_requested.is_set() and not fvm.hv.alive()


async def test_close_and_kill_end_the_hypervisor(fake_vm: Build, fake_images: Images) -> None:
    first = await fake_vm(fake_spec(fake_images.base))
    await ready(first)
    await first.vm.close()
    assert first.hv.current.exit_info is not None and first.hv.current.exit_info.reason == "host-qmp-quit"
    second = await fake_vm(fake_spec(fake_images.base))
    await ready(second)
    await second.vm.kill()
    assert second.hv.current.exit_info is not None and second.hv.current.exit_info.signal == 9


async def test_a_stopped_or_crashed_guest_has_no_forward_address(fake_vm: Build, fake_images: Images) -> None:
    """A forward's host port is QEMU's only while QEMU runs: after a power-off, a crash or a recycle
    without a boot, the state used to report the old port, and the forward driver connected to
    whatever process of the pod bound it next (it says "power the VM on first" when there is none)."""
    fvm = await fake_vm(fake_spec(fake_images.base, network={"forwards": [{"name": "ssh", "guest_port": 22}]}))
    await ready(fvm)
    assert set(fvm.vm.state().forwards) == {"ssh"}
    await fvm.vm.power_off(graceful=False)
    assert fvm.vm.state().forwards == {}, "a stopped guest reported a forward"
    await ready(fvm)
    assert set(fvm.vm.state().forwards) == {"ssh"}
    await fvm.hv.current.crash()
    await until(fvm.vm, C)
    assert fvm.vm.state().forwards == {}, "a crashed guest reported a forward"
    await ready(fvm)
    await fvm.vm.claim()
    await fvm.vm.recycle(boot=False)
    assert fvm.vm.state().forwards == {}, "the next generation, not booted, reported the last one's forward"


# ---- reset, reboot, cycle ------------------------------------------------------------------------
async def test_reset_starts_a_new_boot_on_the_same_disk(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    overlay = keep_overlay(fvm)
    async with watch(fvm.vm) as seen:
        state = await fvm.vm.reset()
        await until(fvm.vm, RD)
    assert seen.phases == [R, RD] and state.boot == 2 and seen.of("phase")[0].data["reason"] == "reset"
    assert [e.data["reason"] for e in seen.of("boot")] == ["reset"]  # the guest.reset it caused is the same boot
    assert os.path.samefile(overlay, fvm.paths.overlay) and len(fvm.hv.backends) == 1


async def test_a_guest_reset_right_after_its_boot_began_belongs_to_that_boot(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        fvm.hv.current.guest_reboot()  # firmware resets within RESET_COALESCE_S of the boot's start
        await seen.next("guest.reset")
        await until(fvm.vm, RD)
    assert "boot" not in seen.types and fvm.vm.state().boot == 1


async def test_a_guest_kernel_panic_reboots_into_a_new_boot(fake_vm: Build, fake_images: Images,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # a reboot within RESET_COALESCE_S of the boot's start is taken for the firmware's own resets
    # (its own test: test_a_guest_reset_right_after_its_boot_began_belongs_to_that_boot); none here
    monkeypatch.setattr(machine, "RESET_COALESCE_S", 0.0)
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        fvm.hv.current.panic()
        await seen.next("boot")
        state = await until(fvm.vm, RD)
    assert seen.phases == [R, RD] and seen.of("phase")[0].data["reason"] == "guest reset"
    assert "guest.panicked" in seen.types and seen.of("boot")[0].data["reason"] == "guest reboot"
    assert state.boot == 2 and state.generation == 0 and len(fvm.hv.backends) == 1


async def test_cycle_is_off_then_on_keeping_the_leases_disk(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    overlay = keep_overlay(fvm)
    async with watch(fvm.vm) as seen:
        state = await fvm.vm.cycle()
        await until(fvm.vm, RD)
    assert seen.phases == [SP, S, ST, R, RD] and state.boot == 2 and state.generation == 0
    assert os.path.samefile(overlay, fvm.paths.overlay)
    assert len(fvm.hv.backends) == 2 and len(fvm.hv.alive()) == 1


async def test_cycle_of_a_stopped_vm_boots_it(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    async with watch(fvm.vm) as seen:
        await fvm.vm.cycle()
    assert seen.phases == [P, S, ST, R]


# ---- crashes and host faults ---------------------------------------------------------------------
@pytest.mark.parametrize("when", [R, RD])
async def test_a_hypervisor_that_dies_is_crashed_then_power_on_recovers(
        fake_vm: Build, fake_images: Images, when: Phase) -> None:
    hv = FakeHypervisor(ready_line=None if when == R else FakeHypervisor().ready_line)
    fvm = await fake_vm(fake_spec(fake_images.base), hv=hv)
    await fvm.vm.power_on()
    await until(fvm.vm, when)
    await console_shows(fvm, b"fake kernel booting")
    async with watch(fvm.vm) as seen:
        await hv.current.crash(9)
        state = await until(fvm.vm, C)
    assert seen.phases == [C] and state.last_exit is not None and state.last_exit.signal == 9
    assert state.last_error is not None and state.last_error["error"] == "guest_error"
    assert "QEMU died unexpectedly (signal 9; stderr: qemu-system-x86_64: terminating on signal 9)" in \
        state.last_error["message"]
    assert "fake kernel booting" in (state.console_tail or "")
    hv.ready_line = FakeHypervisor().ready_line
    async with watch(fvm.vm) as seen:
        await ready(fvm)
    assert seen.phases == [ST, R, RD] and len(hv.alive()) == 1


async def test_a_crashed_vm_powered_off_is_stopped_without_stopping(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    await fvm.hv.current.crash()
    await until(fvm.vm, C)
    async with watch(fvm.vm) as seen:
        await fvm.vm.power_off()
    assert seen.phases == [S]


async def test_a_destroyed_libvirt_domain_is_crashed_with_libvirts_reason(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base, backend="libvirt"))
    await ready(fvm)
    await fvm.hv.current.crash()
    state = await until(fvm.vm, C)
    assert state.last_error is not None
    assert "the libvirt domain died unexpectedly (domain stopped: crashed" in state.last_error["message"]


@pytest.mark.parametrize("nospace", [True, False])
async def test_a_host_disk_error_pauses_the_guest_in_error(
        fake_vm: Build, fake_images: Images, nospace: bool) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    async with watch(fvm.vm) as seen:
        fvm.hv.current.disk_error(nospace=nospace)
        state = await until(fvm.vm, E)
    assert seen.phases == [E] and state.last_error is not None and state.last_error["error"] == "host_error"
    assert ("the state volume is full" if nospace else "could not be written") in state.last_error["message"]
    assert fvm.hv.current.alive and fvm.hv.current.paused  # paused, not gone: a recycle or power off ends it


# ---- refusals, phase by phase --------------------------------------------------------------------
async def test_without_a_spec_nothing_can_boot(fake_vm: Build) -> None:
    fvm = await fake_vm(None)
    for call in (fvm.vm.power_on(), fvm.vm.cycle(), fvm.vm.pull()):
        await refused(call, "no_spec", "PUT /v1/vm/spec")
    assert fvm.vm.phase == S and not fvm.hv.backends


@pytest.mark.parametrize("phase", [S, C, E])
async def test_reset_is_refused_unless_the_guest_runs(fake_vm: Build, fake_images: Images, phase: Phase) -> None:
    spec = fake_spec(fake_images.base, **failing(phase))
    fvm = await fake_vm(spec, hv=FakeHypervisor(ready_line=None if phase == E else FakeHypervisor().ready_line))
    if phase != S:
        await fvm.vm.power_on()
        if phase == C:
            await fvm.hv.current.crash()
        await until(fvm.vm, phase)
    await wrong_phase(fvm.vm.reset(), phase, LIVE, "cannot reset")
    assert fvm.vm.phase == phase


@pytest.mark.parametrize("phase", [R, RD])
async def test_while_the_guest_runs_its_disk_and_spec_stay(
        fake_vm: Build, fake_images: Images, phase: Phase) -> None:
    spec = fake_spec(fake_images.base)
    hv = FakeHypervisor(ready_line=None if phase == R else FakeHypervisor().ready_line)
    fvm = await fake_vm(spec, hv=hv, host_paths=HostPathPolicy((fake_images.other.parent,)))
    await fvm.vm.power_on()
    before = await until(fvm.vm, phase)
    await wrong_phase(fvm.vm.set_spec(fake_spec(fake_images.other), from_api=False), phase, BOOTABLE,
                      "cannot replace the spec")
    await wrong_phase(fvm.vm.dump(), phase, BOOTABLE, "power it off first")
    await wrong_phase(fvm.vm.flash(chunks(fake_images.other)), phase, BOOTABLE, "power_off=true")
    await wrong_phase(fvm.vm.flash_reference(f"file:{fake_images.other}"), phase, BOOTABLE, "power_off=true")
    assert not await fvm.vm.set_spec(spec, from_api=False)  # the same spec: nothing to do, in any phase
    after = fvm.vm.state()
    assert (after.phase, after.boot, after.image_digest) == (phase, before.boot, before.image_digest)
    assert len(hv.backends) == 1 and hv.current.alive


@pytest.mark.parametrize("phase", [S, C, E])
async def test_a_vm_that_does_not_run_takes_a_new_spec_and_dumps(
        fake_vm: Build, fake_images: Images, phase: Phase) -> None:
    spec = fake_spec(fake_images.base, **failing(phase))
    fvm = await fake_vm(spec, hv=FakeHypervisor(ready_line=None if phase == E else FakeHypervisor().ready_line))
    await fvm.vm.power_on()
    if phase == S:
        await fvm.vm.power_off()
    elif phase == C:
        await fvm.hv.current.crash()
    await until(fvm.vm, phase)
    dump = await fvm.vm.dump()
    assert dump.read_bytes()[:4] == b"QFI\xfb"
    dump.unlink()
    async with watch(fvm.vm) as seen:
        assert await fvm.vm.set_spec(fake_spec(fake_images.other), from_api=False)
    assert seen.types == ["spec"] and fvm.vm.phase == phase
    assert fvm.vm.state().image_digest is None  # another image: the next boot pulls it
    fvm.hv.ready_line = FakeHypervisor().ready_line
    async with watch(fvm.vm) as seen:
        await ready(fvm)
    if phase == E:  # its hypervisor still runs and is ended first (see test_power_on_from_error_boots_again)
        assert seen.phases[0] == SP and seen.phases[-3:] == [ST, R, RD] and P in seen.phases
    else:
        assert seen.phases == [P, phase, ST, R, RD]


async def test_specs_over_the_api_may_not_name_host_paths_or_extra_args(fake_vm: Build, fake_images: Images) -> None:
    spec = fake_spec(fake_images.base)
    fvm = await fake_vm(spec)
    await refused(fvm.vm.set_spec(fake_spec(fake_images.other)), "host_path_not_allowed", "--allow-host-paths")
    extra = spec.model_copy(update={"extra_args": ["-no-reboot"]})
    await refused(fvm.vm.set_spec(extra), "invalid_spec", "--allow-extra-args")
    assert fvm.vm.spec == spec
    assert await fvm.vm.set_spec(extra, from_api=False)  # the runtime's own config may


async def test_flash_with_power_off_stops_the_guest_and_boots_the_flashed_disk(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await ready(fvm)
    base = fvm.vm.state().image_digest
    async with watch(fvm.vm) as seen:
        state = await fvm.vm.flash(chunks(fake_images.other), power_off=True)
    assert seen.phases == [SP, S] and seen.of("phase")[-1].data["reason"] == "flash"
    assert state.image_digest != base and seen.of("flashed")[0].data["digest"] == state.image_digest
    await ready(fvm)
    assert fvm.hv.current.plan.disk == fvm.paths.overlay and fvm.vm.state().image_digest == state.image_digest


async def test_flash_by_reference_of_a_stopped_vm(fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base), host_paths=HostPathPolicy((fake_images.other.parent,)))
    await fvm.vm.power_on()
    await fvm.vm.power_off()
    base = fvm.vm.state().image_digest
    async with watch(fvm.vm) as seen:
        state = await fvm.vm.flash_reference(f"file:{fake_images.other}")
    assert seen.types[:2] == ["pulled", "flashed"] and seen.phases == [] and state.image_digest != base


async def test_flash_by_reference_of_a_host_path_needs_the_administrators_leave(
        fake_vm: Build, fake_images: Images) -> None:
    fvm = await fake_vm(fake_spec(fake_images.base))
    await refused(fvm.vm.flash_reference(f"file:{fake_images.other}"), "host_path_not_allowed")
    assert fvm.vm.state().image_digest is None


async def test_operations_sent_while_stopping_wait_for_the_stop(fake_vm: Build, fake_images: Images) -> None:
    """Every call takes the power lock, so none meets Stopping: each is answered in the phase the
    stop ends in, in order; ``state()`` and a first claim answer at once."""
    gate = asyncio.Event()
    hv = FakeHypervisor(stop_gate=gate)
    fvm = await fake_vm(fake_spec(fake_images.base), hv=hv)
    await ready(fvm)
    off = asyncio.create_task(fvm.vm.power_off(graceful=False))
    await until(fvm.vm, SP)
    await hv.current.stopping.wait()
    reset = asyncio.create_task(fvm.vm.reset())
    on = asyncio.create_task(fvm.vm.power_on())
    assert fvm.vm.state().phase == SP and (await fvm.vm.claim()).claimed
    assert not reset.done() and not on.done()
    gate.set()
    assert (await off).phase == S
    await wrong_phase(reset, S, LIVE)
    assert (await on).phase == R and len(hv.alive()) == 1 and hv.max_alive == 1


@pytest.mark.parametrize("uri", [
    "qemu+ssh://%2Ftmp%2Fscript@localhost/system?command=/bin/sh",  # runs the file named as the user
    "qemu+ext:///system?command=/tmp/x",                            # runs any program
    "qemu+unix:///system?socket=/run/other.sock",                   # any socket of the host
    "qemu+ssh://localhost/system?keyfile=/etc/shadow",
    "QEMU+EXT:///system",
    "qemu:///system?socket=/tmp/x",
])
async def test_a_libvirt_uri_that_runs_a_program_or_names_a_file_is_the_administrators_alone(
        fake_vm: Build, fake_images: Images, uri: str) -> None:
    """libvirt's ``ext`` transport and the ``command``/``netcat``/``socket``/``keyfile``… parameters
    make ``virConnectOpen`` run a program or open a path of the URI's choosing, as the runtime's user;
    an API caller (a lease holder, as admission.py has it) could set one and boot. The runtime's own
    spec may (its administrator's); the API only a plain URI, or the one the runtime already has."""
    fvm = await fake_vm(None)
    image = "registry.example/vm/guest:1"  # (no host path: the API refuses those for reasons of its own)
    spec = fake_spec(image, backend="libvirt", libvirt_uri=uri)
    await refused(fvm.vm.set_spec(spec), "invalid_spec", "libvirt_uri", "administrator", "--spec")
    assert fvm.vm.spec is None
    assert await fvm.vm.set_spec(spec, from_api=False)  # the runtime's own --spec file
    assert not await fvm.vm.set_spec(spec)  # the exporter sending the same spec again changes nothing
    for plain in ("qemu:///system", "qemu:///session", "qemu+ssh://user@host.example/system",
                  "qemu+tls://host.example/system", "qemu+unix:///system"):
        assert await fvm.vm.set_spec(fake_spec(image, backend="libvirt", libvirt_uri=plain))


async def test_a_boot_failing_on_a_bugs_exception_is_error_naming_it_and_power_on_recovers(
        fake_vm: Build, fake_images: Images, fake_pull: Any) -> None:
    """An exception no input raises on purpose (a bug; injected here into the pull, the one way to
    produce it) ends the boot in Error naming it, not in the phase it raised in: a runtime whose cold
    boot raised so once stayed in Starting for good, its log the only trace (reliability.md)."""
    failures = [RuntimeError("injected: a bug")]

    def pull_with_a_bug(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return fake_pull(*args, **kwargs)

    fvm = await fake_vm(fake_spec(fake_images.base), pull_fn=pull_with_a_bug)
    async with watch(fvm.vm) as seen:
        await refused(fvm.vm.power_on(), "internal_error", "RuntimeError", "injected: a bug", "report it")
    assert seen.phases == [P, E] and not fvm.hv.backends
    assert fvm.vm.state().last_error["error"] == "internal_error"
    await fvm.vm.power_on()
    assert (await until(fvm.vm, RD)).boot == 1
