"""Lease cycles of a real ``jmp run`` (0.9.0, controller mode) against the in-test controller.

The exporter exports ``MockPower`` (no VM). Clients are the real ``jmp shell`` or the Python
client API. See docs/testing-controller.md for the exit-after-lease findings.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from jmpctl import JmpController
from jmpctl.harness import BIN

pytestmark = pytest.mark.timeout(60)

MOCK = {"power": {"type": "jumpstarter_driver_power.driver.MockPower"}}


def start(jmpctl: JmpController, export: dict = MOCK, **extra) -> subprocess.Popen:
    proc = jmpctl.start_exporter(jmpctl.exporter_config(export, **extra))
    jmpctl.wait_registered("vm")
    jmpctl.wait_status("vm", "AVAILABLE")
    return proc


def statuses_since(jmpctl: JmpController, t: float) -> list[str]:
    return [s for ts, s in jmpctl.status_log("vm") if ts >= t]


async def test_registers_and_reports_available(jmpctl: JmpController):
    proc = jmpctl.start_exporter(jmpctl.exporter_config(MOCK))
    x = await jmpctl.wait_registered_async("vm")
    await jmpctl.wait_status_async("vm", "AVAILABLE")
    assert {r.labels["jumpstarter.dev/name"] for r in x.reports} >= {"power"}
    assert x.lease is None and x.register_count == 1
    assert proc.poll() is None


def test_two_lease_cycles_through_jmp_shell(jmpctl: JmpController):
    """lease -> ``jmp shell --lease NAME -- j power on`` via the router -> release -> AVAILABLE, twice."""
    proc = start(jmpctl)
    release_to_available = []
    for cycle in (1, 2):
        with jmpctl.lease("vm") as lease:
            r = lease.shell("j", "power", "on")
            assert r.returncode == 0, r.stdout + r.stderr
            assert lease.record.dials >= 1
        available = jmpctl.wait_status("vm", "AVAILABLE", timeout=10, since=lease.released_at)
        release_to_available.append(available - lease.released_at)
        assert jmpctl.log_text(proc).count("power on") == cycle
    assert jmpctl.exporter("vm").register_count == 1  # served by the same child, no restart
    assert jmpctl.router.stats.pairs >= 2
    print(f"release -> AVAILABLE: {[f'{t * 1000:.0f} ms' for t in release_to_available]}")
    assert max(release_to_available) < 5


def test_python_client_and_auto_lease_shell(jmpctl: JmpController):
    """The client-created lease paths: ``ClientConfigV1Alpha1.lease()`` (CreateLease/GetLease/Dial/
    DeleteLease) and ``jmp shell -n vm`` (same, plus EndSession before DeleteLease)."""
    from jumpstarter.config.client import ClientConfigV1Alpha1

    proc = start(jmpctl)
    config = ClientConfigV1Alpha1.from_file(jmpctl.client_config("c"))
    with config.lease(exporter_name="vm") as lease, lease.connect() as client:
        client.power.on()
    rec = jmpctl.registry.leases[lease.name]
    assert rec.released_by == "client c"
    jmpctl.wait_status("vm", "AVAILABLE", timeout=10, since=rec.released_at)

    r = subprocess.run([str(BIN / "jmp"), "shell", "--client-config", str(jmpctl.client_config("c")),
                        "-n", "vm", "--", "j", "power", "on"],
                       env=jmpctl.env(), capture_output=True, text=True, timeout=45, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert jmpctl.log_text(proc).count("power on") == 2
    assert all(not lease.active for lease in jmpctl.registry.leases.values())
    assert jmpctl.exporter("vm").status == "AVAILABLE"


def test_sighup_during_lease_exits_after_it(jmpctl: JmpController):
    """Recommended ExitAndReplace mechanism on 0.9.0: SIGHUP to ``jmp run`` while leased.

    The lease keeps working; once it ends the exporter unregisters (OFFLINE, never AVAILABLE)
    and ``jmp run`` exits 0 without restarting. (Internally it returns 128+SIGHUP=129, but
    ``jmp`` runs click in standalone mode, which discards a command's return value.)
    """
    proc = start(jmpctl)
    with jmpctl.lease("vm") as lease:
        # Only once the exporter has taken the lease: before its first lease, SIGHUP stops it at once.
        jmpctl.wait_status("vm", "LEASE_READY", since=lease.record.assigned_at)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1)  # that SIGHUP does not end the lease can only be shown by waiting
        assert proc.poll() is None, "SIGHUP must not end a running lease"
        r = lease.shell("j", "power", "on")
        assert r.returncode == 0, r.stdout + r.stderr
    assert proc.wait(15) == 0
    exit_delay = time.monotonic() - lease.released_at
    after = statuses_since(jmpctl, lease.released_at)
    assert "AVAILABLE" not in after and after[-1] == "OFFLINE", after
    x = jmpctl.exporter("vm")
    assert x.register_count == 1 and not x.registered
    assert any(e.startswith("unregister") for _, e in x.events)
    print(f"release -> jmp run exit 0: <= {exit_delay:.2f} s")


@pytest.mark.parametrize(("mechanism", "restarts", "available_after_release"), [
    ("afterLease-onFailure-exit", False, False),
    ("driver-close-os._exit(3)", False, True),
    ("driver-close-os._exit(0)", True, True),
])
def test_other_exit_mechanisms(jmpctl: JmpController, mechanism: str, restarts: bool,
                               available_after_release: bool):
    """Evidence for the alternatives (see docs/testing-controller.md): only a non-zero child exit
    stops ``jmp run``'s restart loop, and ``jmp run`` itself then exits 0 whatever the child's code."""
    export, extra = MOCK, {}
    if mechanism.startswith("afterLease"):
        extra = {"hooks": {"afterLease": {"script": "exit 1", "onFailure": "exit", "timeout": 20}}}
    else:
        code = int(mechanism[-2])
        export = {"power": {"type": "jmpctl.drivers.ExitOnLeaseClose", "config": {"exit_code": code}}}
    proc = start(jmpctl, export, **extra)
    with jmpctl.lease("vm") as lease:
        jmpctl.wait_status("vm", "LEASE_READY", since=lease.record.assigned_at)
    if restarts:
        jmpctl.wait_event("vm", "register", since=lease.released_at)
        assert proc.poll() is None
        jmpctl.wait_status("vm", "AVAILABLE", since=lease.released_at)
    else:
        assert proc.wait(15) == 0
        assert jmpctl.exporter("vm").register_count == 1
    assert ("AVAILABLE" in statuses_since(jmpctl, lease.released_at)) == available_after_release
