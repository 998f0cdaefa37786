"""Attacks on lease isolation (issue 19, items 3 and 4): nothing of lease N reaches lease N+1.

- A flash by reference of lease N still pulling when lease N ends must never be installed in lease
  N+1; one disk transfer at a time per VM (409 ``transfer_in_progress``); every pull has a deadline
  (``pull_timeout``); a pull whose client went away is cancelled.
- A lease that only uses children which never call the runtime (CAN, a network forward) is still
  claimed — when the exporter hands it out — so it is recycled at its end; a lease handed out
  during the unclaimed cold boot keeps the capture of that boot from being taken.

Each pull is slowed by :class:`ThrottleProxy` in front of the real registry: the pull is provably
under way (bytes flowing) when the lease ends, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from fixtures.events import collecting
from fixtures.faults import ThrottleProxy, wait_phase
from fixtures.jmp import VM_TYPE, temp_sockets_in
from fixtures.registry import push_incompressible
from fixtures.vmdev import in_background_until_listening
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import PullTimeoutError, TransferError
from vmsidecar_images.console import Console

pytestmark = pytest.mark.timeout(600)

SLOW_REPO = "attack/lease-flash:1"
#: slow enough that the 16 MiB layer takes minutes: the pull is still running at every step below
CRAWL = 64 << 10


@pytest.fixture
def image_cache(tmp_path: Path) -> Path:
    """A cache of this test's own (overrides the session's): the slow image is never already there."""
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def slow_image(registry: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 16 MiB incompressible qcow2 in the registry (through the proxy it takes minutes)."""
    push_incompressible(registry, SLOW_REPO, tmp_path_factory.mktemp("slow-image"))
    return SLOW_REPO


@contextlib.asynccontextmanager
async def crawling(registry: Any) -> AsyncIterator[ThrottleProxy]:
    async with ThrottleProxy(("127.0.0.1", int(registry.host.rsplit(":", 1)[1])), rate=CRAWL) as proxy:
        yield proxy


async def pull_under_way(proxy: ThrottleProxy, ended: Callable[[], bool], at_least: int = 256 << 10) -> None:
    """Until the layer is flowing through the proxy (the transfer is in its pull)."""

    def flowing() -> bool:
        assert not ended(), "the transfer ended before its pull was under way"
        return proxy.forwarded >= at_least

    await wait_until_async(flowing, 120, "the pull to start", detail=lambda: f"{proxy.forwarded} bytes")


# ---- item 3: a pull belongs to its lease ------------------------------------------------------
async def test_a_flash_pull_of_lease_n_never_lands_in_lease_n_plus_1(
    start_runtime: Any, tiny_image: Any, registry: Any, slow_image: str
) -> None:
    """Lease N flashes ``oci://…`` from a crawling registry (power_off, like the driver); lease N
    ends (recycle if_generation) and lease N+1 claims while the pull runs; then the registry speeds
    up. Before the fix the pull finished, powered N+1's fresh guest off and installed N's disk."""
    spec_image = f"file:{tiny_image.disk}"
    rt = await start_runtime({"image": spec_image, "memory": "256M", "snapshot": "off"})
    client = rt.client()
    await client.wait_ready(240)
    lease_n = await client.claim()
    async with collecting(rt.client(), ["transfer_cancelled", "flashed"]) as events, crawling(registry) as proxy:
        flash = asyncio.create_task(rt.client().flash_reference(f"{proxy.host}/{slow_image}", power_off=True))
        await pull_under_way(proxy, flash.done)
        await client.recycle(boot=True, if_generation=lease_n.generation)  # lease N ends
        lease_n1 = await client.claim()  # lease N+1 starts
        assert lease_n1.generation == lease_n.generation + 1
        proxy.rate = 1 << 30  # the pull may finish now
        outcome = (await asyncio.wait_for(asyncio.gather(flash, return_exceptions=True), 180))[0]
        await events.none_within("flashed", 1)  # no late install: the pull would run at full speed now
    assert isinstance(outcome, TransferError) and outcome.code == "transfer_cancelled", (
        f"lease N's flash was not cancelled at the end of lease N: {outcome!r}")
    assert "recycle" in outcome.message and "nothing of it was installed" in outcome.message, outcome.message
    assert [e["type"] for e in events] == ["transfer_cancelled"], events  # reported, never "flashed"
    assert events[0]["data"]["generation"] == lease_n.generation
    ready = await client.wait_ready(240)
    assert ready.generation == lease_n1.generation and ready.boot == lease_n1.boot  # N+1's boot, never powered off
    assert ready.disk == spec_image and ready.image_digest == lease_n.image_digest  # the spec's pristine image


async def test_an_upload_flash_of_lease_n_is_cancelled_by_its_recycle(start_runtime: Any, tiny_image: Any) -> None:
    """Lease N uploads a disk and stops sending mid-stream (the upload holds the power lock while
    it receives). Before the fix lease N's recycle waited for that lock for ever; now it cancels
    the upload, which installs nothing."""
    rt = await start_runtime({"memory": "256M"})
    client = rt.client()
    lease_n = await client.claim()
    head = tiny_image.disk.read_bytes()[:256 << 10]
    sent = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield head
        sent.set()
        await asyncio.Event().wait()  # a client that never finishes sending

    upload = asyncio.create_task(rt.client().flash(stalls(), size=64 << 20))
    await asyncio.wait_for(sent.wait(), 30)
    await wait_until_async(lambda: any(f.stat().st_size for f in (rt.state / "flashed").glob(".incoming-*")),
                           30, "the runtime to write the upload's first bytes")
    started = time.monotonic()
    await asyncio.wait_for(client.recycle(boot=False, if_generation=lease_n.generation), 20)
    took = time.monotonic() - started
    with pytest.raises(TransferError) as exc:
        await asyncio.wait_for(upload, 20)
    assert exc.value.code == "transfer_cancelled" and "upload" in exc.value.message, exc.value
    state = await client.state()
    assert state.disk is None and state.generation == lease_n.generation + 1
    print(f"\nrecycle with a stalled upload under way: {took:.2f} s")


async def test_a_graceful_power_off_the_guest_ignores_does_not_hold_the_next_lease(
        start_runtime: Any, tiny_image: Any) -> None:
    """Lease N stops its guest's power-button handler (root on the console), asks for a graceful
    power-off with the longest timeout the API takes (an hour) and leaves. The power-off waited out
    its timeout under the power lock, and the next lease's claim waited for that lock (its client
    gives up after 120 s; the exporter claims again and again). Now the claim cuts it short: the
    guest is forced off, and lease N+1 has the VM within the bound."""
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"})
    client = rt.client()
    await client.wait_ready(240)
    lease_n = await client.claim(token="lease-n-token")
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.wake()
        assert "acpid gone" in await con.run("killall acpid; sleep 0.5; pidof acpid || echo acpid gone")
    finally:
        await con.close()
    async with collecting(client, ["phase"]) as events:
        off = asyncio.create_task(rt.client().power("off", graceful=True, timeout=3600))
        await events.wait_for(lambda e: e["data"].get("phase") == "Stopping", 30)
    await asyncio.sleep(2)  # the guest ignores the button: the power-off waits
    assert not off.done(), f"the power-off ended although the guest ignores the button: {off!r}"
    started = time.monotonic()
    lease_n1 = await asyncio.wait_for(client.claim(token="lease-n1-token"), 30)
    took = time.monotonic() - started
    assert lease_n1.generation == lease_n.generation + 1 and lease_n1.claimed, lease_n1
    await asyncio.wait_for(off, 15)  # lease N's call ends too (its guest forced off)
    print(f"\nthe next claim during lease N's graceful power-off of an hour: {took:.2f} s")


async def test_a_second_pull_while_one_runs_is_refused_with_409(
    start_runtime: Any, registry: Any, slow_image: str
) -> None:
    rt = await start_runtime({"memory": "256M"})  # no image: nothing boots, the flash tests stay cheap
    async with crawling(registry) as proxy:
        first = asyncio.create_task(rt.client().flash_reference(f"{proxy.host}/{slow_image}"))
        await pull_under_way(proxy, first.done)
        started = time.monotonic()
        with pytest.raises(TransferError) as exc:
            await asyncio.wait_for(rt.client().flash_reference(f"{registry.host}/{slow_image}"), 20)
        assert exc.value.code == "transfer_in_progress" and exc.value.http_status == 409, exc.value
        assert f"{proxy.host}/{slow_image}" in exc.value.message and "wait for it" in exc.value.message
        refused = time.monotonic() - started
        assert refused < 5  # refused at once, not queued
        print(f"\nsecond pull refused in {refused * 1000:.0f} ms")
        assert not first.done()  # the first one was not disturbed
        first.cancel()


async def test_a_pull_whose_client_went_away_is_cancelled_and_never_installed(
    start_runtime: Any, registry: Any, slow_image: str
) -> None:
    rt = await start_runtime({"memory": "256M"})
    client = rt.client()
    async with collecting(rt.client(), ["transfer_cancelled", "flashed"]) as events, crawling(registry) as proxy:
        gone = rt.client()
        flash = asyncio.create_task(gone.flash_reference(f"{proxy.host}/{slow_image}"))
        await pull_under_way(proxy, flash.done)
        flash.cancel()
        await gone.close()  # the client goes away mid-pull (its connection closes)

        left = time.monotonic()
        await events.wait_for("transfer_cancelled", 15)  # the runtime cancels the pull of a client that went away
        print(f"\npull cancelled {time.monotonic() - left:.2f} s after its client went away")
        proxy.rate = 1 << 30
        await events.none_within("flashed", 2)  # a pull still running would finish and install now
    assert [e["type"] for e in events] == ["transfer_cancelled"], events
    assert "went away" in events[0]["data"]["reason"], events
    assert (await client.state()).disk is None  # nothing installed
    state = await asyncio.wait_for(client.flash_reference(f"{registry.host}/{slow_image}"), 120)  # the slot is free
    assert state.disk == f"{registry.host}/{slow_image}"


async def test_a_pull_past_its_deadline_ends_with_pull_timeout(
    start_runtime: Any, registry: Any, slow_image: str
) -> None:
    rt = await start_runtime({"memory": "256M"}, extra_args=["--pull-timeout", "3"])
    client = rt.client()
    async with crawling(registry) as proxy:
        started = time.monotonic()
        with pytest.raises(PullTimeoutError) as exc:
            await asyncio.wait_for(rt.client().flash_reference(f"{proxy.host}/{slow_image}"), 60)
        took = time.monotonic() - started
    assert exc.value.code == "pull_timeout", exc.value
    assert "3 s" in exc.value.message and "--pull-timeout" in exc.value.message, exc.value.message
    assert 2.5 < took < 15, took
    print(f"\npull_timeout after {took:.2f} s (deadline 3 s)")
    assert (await client.state()).disk is None
    await asyncio.wait_for(client.flash_reference(f"{registry.host}/{slow_image}"), 120)  # nothing left held


# ---- item 4: a lease is claimed when it is handed out -------------------------------------------
def _lease_shell(lease: Any, script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(lease.argv("bash", "-c", f"set -euo pipefail\ncd {cwd}\n{script}"), env=lease.env,
                          capture_output=True, text=True, timeout=300)


#: the lease's only act: one CAN frame through upstream's CanClient (never a runtime call)
CAN_ONLY = """python - <<'EOF'
import can
from jumpstarter.utils.env import env
with env() as client:
    client.vm.can.send(can.Message(arbitration_id=0x123, data=b"\\x4c\\x31", is_extended_id=False))
EOF
"""


async def test_a_lease_that_only_uses_can_is_recycled_and_a_lease_ending_mid_pull_cancels_it(
    start_runtime: Any, tiny_image: Any, jmpctl: Any, registry: Any, slow_image: str, tmp_path: Path
) -> None:
    """The guest runs a service that writes what arrives on can0 to its disk; lease 1 only sends a
    CAN frame. Before the fix lease 1 never claimed, so nothing recycled it: lease 2 found the file.
    Lease 2 then starts ``j vm storage flash oci://…`` from a crawling registry and ends mid-pull:
    the pull is cancelled and the next lease boots the spec's image."""
    spec_image = f"file:{tiny_image.disk}"
    spec = {"image": spec_image, "memory": "256M", "can": [{"name": "can0", "bitrate": 250000}]}
    rt = await start_runtime(spec)
    client = rt.client()
    await client.wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    await con.run(in_background_until_listening("(candump -L -n 1 can0 > /data/from-can; sync) > /dev/null 2>&1"))
    cfg = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {"socket": str(rt.socket),
                                                                       "recycle": "InPlaceReuse", "spec": spec}}})
    exporter = jmpctl.start_exporter(cfg)
    await jmpctl.wait_status_async("vm", "AVAILABLE", 60)

    with jmpctl.lease("vm") as lease:
        result = await asyncio.to_thread(_lease_shell, lease, CAN_ONLY, tmp_path)
        assert result.returncode == 0, result.stderr[-3000:] + jmpctl.log_text(exporter)[-3000:]
        written = await con.run("sleep 0.5; cat /data/from-can")
        assert "can0 123#4C31" in written, written  # lease 1 changed the guest, through CAN alone
    await con.close()

    async with collecting(rt.client(), ["transfer_cancelled", "flashed"]) as events, crawling(registry) as proxy:
        with jmpctl.lease("vm") as lease:
            await jmpctl.wait_status_async("vm", "LEASE_READY", 60, since=time.monotonic() - 1)
            state = await client.wait_ready(180)
            con = await Console.open_when_served(rt.shared / "console.sock")
            try:
                await con.wake()
                check = await con.run("ls /data/from-can")
            finally:
                await con.close()
            assert "No such file or directory" in check, f"lease 1's file reached lease 2: {check!r}"
            assert state.claimed and state.generation >= 1, state  # lease 2 was told to the runtime, too
            flash = await asyncio.create_subprocess_exec(
                *lease.argv("j", "vm", "storage", "flash", f"oci://{proxy.host}/{slow_image}"),
                env=lease.env | temp_sockets_in(tmp_path),  # it is killed below
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await pull_under_way(proxy, lambda: flash.returncode is not None)  # lease 2's flash
        # lease 2 ended mid-pull

        await events.wait_for("transfer_cancelled", 60)  # the pull of a lease that ended is cancelled
        print(f"\nlease ended mid-pull: pull cancelled {time.monotonic() - lease.released_at:.2f} s after the "
              f"release ({events[0]['data']['reason']})")
        proxy.rate = 1 << 30
        await events.none_within("flashed", 2)  # a pull still running would finish and install now
    with contextlib.suppress(ProcessLookupError):
        flash.kill()
    await flash.wait()
    assert [e["type"] for e in events] == ["transfer_cancelled"], events
    assert events[0]["data"]["generation"] == state.generation
    after = await client.wait_ready(180)
    assert after.generation == state.generation + 1 and after.disk == spec_image, after


async def test_a_lease_handed_out_during_the_cold_boot_keeps_that_boot_from_being_captured(
    start_runtime: Any, tiny_image: Any, jmpctl: Any, tmp_path: Path
) -> None:
    """The guest is Ready only when the test says so (its readiness pattern), so the lease is
    handed out for certain before the first Ready. Before the fix nothing told the runtime, and the
    boot was captured as the pristine snapshot with whatever the lease had done to it."""
    marker = "LEASE-ATTACK-GO"
    cache = tmp_path / "cache"  # its own: the session's holds other workers' captures under way
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M",
                              "readiness": {"pattern": marker, "timeout": 300}}, cache=cache)
    client = rt.client()
    await wait_phase(client, "Running", timeout=60)
    cfg = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {"socket": str(rt.socket),
                                                                       "recycle": "InPlaceReuse"}}})
    jmpctl.start_exporter(cfg)
    await jmpctl.wait_status_async("vm", "AVAILABLE", 60)
    assert not (await client.state()).claimed  # the start-up driver tree claims nothing

    con = await Console.open(rt.shared / "console.sock")
    try:
        with jmpctl.lease("vm"):
            await jmpctl.wait_status_async("vm", "LEASE_READY", 60)
            await con.wake()
            await con.run(f"echo {marker}")  # the boot's first Ready, in the lease
            state = await client.wait_ready(60)
            assert state.generation == 0 and state.boot == 1
            assert state.snapshot.capture_seconds is None and not state.snapshot.available, (
                f"the boot a lease was handed out in was captured as the pristine snapshot: {state.snapshot}")
            assert "lease" in (state.snapshot.reason or ""), state.snapshot
            # that boot ran with its RAM in a templated capture's staging file: the lease's RAM must
            # not stay reachable in the cache (the file is unlinked; the lease's QEMU keeps its mapping)
            assert not list((cache / "snapshots").glob(".incoming-*")), list((cache / "snapshots").iterdir())
    finally:
        await con.close()

    # the next pristine boot (the recycle after the lease) captures it instead
    async def recycled() -> bool:
        s = await client.state()
        return s.generation == 1 and s.phase.value in ("Running", "Ready")

    await wait_until_async(recycled, 60, "the lease to be recycled")
    con = await Console.open_when_served(rt.shared / "console.sock")
    try:
        await con.wake()
        await con.run(f"echo {marker}")
        state = await client.wait_ready(60)
    finally:
        await con.close()

    async def captured() -> bool:
        s = await client.state()
        return s.snapshot.capture_seconds is not None

    await wait_until_async(captured, 60, "the next pristine boot to capture the snapshot")


async def test_a_call_of_an_ended_lease_acts_on_nothing_of_the_next(start_runtime: Any,
                                                                   tmp_path: Path) -> None:
    """The exporter may still run lease N's tree while lease N+1's claims (its session ends with a
    grace period, the next is handed out meanwhile): a call of N's tree that came after N+1's claim
    was carried out on N+1's VM (here: N's tree changed N+1's spec). Each call now names its
    lease's generation and is refused once the VM moved on; a runtime that restarted (its
    generations begun anew, unclaimed) is claimed again by the tree, as before."""
    from jumpstarter_driver_vmsidecar.link import RuntimeLink
    from vmsidecar_contract.spec import load_spec

    rt = await start_runtime({"memory": "256M"})
    lease_n, lease_n1 = RuntimeLink(rt.socket), RuntimeLink(rt.socket)
    try:
        await lease_n.call(lambda c: c.state())  # claims generation 0
        await lease_n1.call(lambda c: c.state())  # the next lease claims: generation 0 is recycled
        assert lease_n1.claimed_generation == 1
        with pytest.raises(ValueError) as refused:
            await lease_n.call(lambda c: c.put_spec(load_spec({"memory": "300M"})))
        assert "has ended" in str(refused.value), refused.value
        spec = await lease_n1.call(lambda c: c.get_spec())
        assert spec is not None and spec.memory == 256, spec  # MiB
        # the runtime restarts: lease N+1's tree claims the new process's VM and goes on
        assert rt.stop() == 0
        again = await start_runtime({"memory": "256M"})
        assert again.socket == rt.socket
        state = await lease_n1.call(lambda c: c.state())
        assert state.claimed and lease_n1.claimed_generation == state.generation == 0, state
    finally:
        for link in (lease_n, lease_n1):
            if link._client is not None:
                await link._client.close()


@contextlib.asynccontextmanager
async def _two_lease_trees(socket: Path, spec: dict[str, Any] | None = None
                           ) -> AsyncIterator[tuple[Any, Any]]:
    """The exporter's driver trees of lease N and lease N+1 on one runtime (InPlaceReuse)."""
    from jumpstarter_driver_vmsidecar.driver import VirtualMachine

    trees = tuple(VirtualMachine(socket=str(socket), spec=spec, recycle="InPlaceReuse") for _ in range(2))
    try:
        yield trees
    finally:
        for vm in trees:
            if vm.link._client is not None:
                await vm.link._client.close()


async def _connect_as_the_next_lease_claims(trees: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch,
                                            module: Any, name: str, connect: Callable[[], Any],
                                            then: Callable[[], Any]) -> None:
    """Lease N claims; its ``connect()`` is refused when lease N+1's claim (and ``then()``) lands
    between N's API call and the ``module.name`` connect it makes next (the one seam)."""
    lease_n, lease_n1 = trees
    real = getattr(module, name)

    async def next_lease_claims_first(*args: Any) -> Any:
        await lease_n1.link.check()  # lease N+1 claims: N's generation is recycled
        await then()
        return await real(*args)

    await lease_n.link.check()  # lease N claims
    monkeypatch.setattr(module, name, next_lease_claims_first)
    try:
        with pytest.raises(ValueError, match="has ended"):
            async with connect():
                pytest.fail(f"lease N's tree got a {name} stream of lease N+1's VM")
    finally:
        monkeypatch.setattr(module, name, real)
    assert lease_n1.link.claimed_generation == (lease_n.link.claimed_generation or 0) + 1


async def test_a_console_opened_as_the_next_lease_claims_is_not_the_ended_leases(
        start_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A console connection of lease N's tree checks the generation with an API call, then opens the
    socket: when lease N+1 claimed between the two, N's stream was attached to N+1's console (its
    output, its input). The one seam: N+1's claim is made to land in that instant. The tree now checks
    again once connected (the claim drops every client it sees, and one it did not see is refused)."""
    from jumpstarter_driver_vmsidecar import console as console_mod

    rt = await start_runtime({"memory": "256M"})

    async def nothing() -> None:
        pass

    async with _two_lease_trees(rt.socket) as trees:
        await _connect_as_the_next_lease_claims(trees, monkeypatch, console_mod, "connect_unix",
                                                trees[0].children["console"].connect, nothing)
        async with trees[1].children["console"].connect():  # the next lease's own console opens
            pass


async def test_a_forward_opened_as_the_next_lease_claims_is_not_the_ended_leases(
        start_runtime: Any, tiny_image: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same instant on a port forward: lease N's tree asked the API for the forward's address,
    lease N+1 claimed (its guest booted on the same fixed host port), and N's connection reached N+1's
    guest. The tree checks again once connected (a claim after that stops the QEMU the connection
    goes through)."""
    from fixtures.ports import free_port
    from jumpstarter_driver_vmsidecar import network as network_mod

    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
            "network": {"forwards": [{"name": "web", "guest_port": 80, "host_port": free_port()}]}}
    rt = await start_runtime(spec)

    async def forwarded() -> None:
        async def running() -> bool:
            return "web" in (await rt.client().state()).forwards

        await wait_until_async(running, 60, "lease N+1's guest to run")  # on the same host port

    await rt.client().wait_ready(240)
    async with _two_lease_trees(rt.socket, spec) as trees:
        await _connect_as_the_next_lease_claims(trees, monkeypatch, network_mod, "connect_tcp",
                                                trees[0].children["web"].connect, forwarded)


async def test_the_next_lease_reads_no_count_of_the_last_leases_boots(start_runtime: Any,
                                                                     tiny_image: Any) -> None:
    """``boot`` in the state a lease reads (the driver's ``state()``) counted every boot since the
    runtime started: lease N+1 read how often lease N power-cycled or its guest rebooted. It counts
    the generation's boots: the boot that hands a lease its guest is 1."""
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"})
    client = rt.client()
    await client.wait_ready(240)
    assert (await client.claim()).boot == 1  # lease N
    for boots in (2, 3):
        assert (await client.power("reset")).boot == boots  # N's power cycles
    async with collecting(client, ["boot"]) as events:
        state = await client.claim()  # lease N+1: recycled, booted anew
        assert state.generation == 1 and state.boot == 1, state
        await events.wait_for("boot", 30)
    assert [e["data"]["boot"] for e in events] == [1], events.events
    assert (await client.power("reset")).boot == 2  # N+1's own power cycle
