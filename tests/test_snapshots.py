"""Leases without boots: the first Ready captures the pristine guest, recycles and warm starts
restore it, and nothing of a lease — disk, RAM, processes, console bytes, randomness — reaches
the next one."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.faults import wait_phase
from fixtures.marks import Marks
from fixtures.runtime import BACKENDS, qemu_pids
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ, runtime_command
from vmsidecar_images.console import Console

pytestmark = pytest.mark.timeout(900)

PROBE = ("ls /data/lease-file /tmp/ram-file 2>&1; ps | grep -c '[s]leep 4242'; "
         "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo")


@pytest.fixture
def image_cache(tmp_path: Path) -> Path:
    """A cache of this test's own (overrides the session's, which every xdist worker shares): these
    tests read, compare or damage the cache's entries, and another worker's captures would be among them."""
    return tmp_path / "cache"


async def _lease_leaves_traces(console_sock: Path, tag: str) -> str:
    """Write a disk file, a RAM-only file and a process; return the guest's fresh random bytes."""
    con = await Console.open(console_sock)
    try:
        await con.wake()
        await con.run(f"echo {tag} > /data/lease-file; echo {tag} > /tmp/ram-file; sync; (sleep 4242 &)")
        return (await con.run(PROBE)).strip().splitlines()[-1]
    finally:
        await con.close()


def _files_holding(root: Path, needles: tuple[bytes, ...]) -> list[Path]:
    """Every file under ``root`` that holds one of ``needles``."""
    found = []
    for path in root.rglob("*"):
        try:
            data = path.read_bytes() if path.is_file() else b""
        except OSError:  # a socket, a file gone meanwhile
            continue
        if any(n in data for n in needles):
            found.append(path)
    return found


async def _probe(console_sock: Path) -> tuple[str, str]:
    con = await Console.open(console_sock)
    try:
        await con.drain_replay()
        replay = bytes(con.seen).decode(errors="replace")
        await con.wake()
        return replay, await con.run(PROBE)
    finally:
        await con.close()


def _memfds(pid: int) -> list[str]:
    """The memfds process ``pid`` holds (a capturing boot's RAM)."""
    fds = Path(f"/proc/{pid}/fd")
    return sorted(t for t in (_readlink(f) for f in fds.iterdir()) if t.startswith("/memfd:"))


def _ram_mapping_start(pid: int, name: str) -> int:
    """Where QEMU ``pid`` maps the guest RAM file ``name`` (a memfd's ``/memfd:…`` or a path)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        start, end = (int(a, 16) for a in line.split(maxsplit=1)[0].split("-"))
        if name in line and end - start >= 64 << 20:  # the guest's RAM (256 MiB here), nothing smaller
            return start
    raise AssertionError(f"QEMU {pid} maps no guest RAM named {name}")


def _frozen_allocated(pid: int) -> int:
    """Bytes allocated in the memfd process ``pid`` holds for a capture's copy of the guest's RAM."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        if _readlink(fd).startswith("/memfd:vmsidecar-frozen-"):
            try:
                return fd.stat().st_blocks * 512
            except OSError:  # closed meanwhile
                return 0
    return 0


def _fds(pid: int) -> set[str]:
    """What process ``pid`` has open."""
    return {_readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:  # closed meanwhile
        return ""


async def _recycle(client: RuntimeClient) -> tuple[Any, float]:
    started = time.monotonic()
    await client.recycle()
    state = await client.wait_ready(120, poll=0.02)
    return state, time.monotonic() - started


#: (backend, snapshot form): the isolation test runs on both forms of the qemu backend's snapshots
#: (templated is the default; the runtime's setting makes the full-stream one) and on libvirt (none)
#: (qemu-standby: each recycle switches to a spare restore made while the lease ran; qemu-parked:
#: each recycle loads the snapshot into a QEMU started while the lease ran)
FORMS = [pytest.param("qemu", "templated", False, id="qemu-templated"),
         pytest.param("qemu", "stream", False, id="qemu-stream"),
         pytest.param("qemu", "templated", True, id="qemu-standby"),
         pytest.param("qemu", "templated", "parked", id="qemu-parked"),
         *[pytest.param(b.values[0], None, False, id=b.values[0], marks=b.marks) for b in BACKENDS[1:]]]


@pytest.mark.parametrize(("backend", "form", "standby"), FORMS)
async def test_recycle_restores_a_pristine_guest_with_nothing_of_the_last_lease(
    start_runtime: Any, tiny_image: Any, backend: str, form: str | None, standby: bool | str
) -> None:
    # a channel no other test's spec has: a snapshot key of its own, so this first boot captures
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "isolation"}],
            "standby": standby}
    rt = await start_runtime(spec, backend=backend, env={"VMSIDECAR_SNAPSHOT_FORM": form} if form else None)
    client = rt.client()
    await client.wait_ready(240)
    first = await client.wait_stored()  # the capture is stored just after Ready
    console = rt.shared / "console.sock"
    if backend == "qemu":
        assert first.snapshot.boot == "cold" and first.snapshot.available and first.snapshot.size
        assert first.snapshot.capture_seconds is not None
        assert first.snapshot.form == form, first.snapshot
        assert first.snapshot.form_reason == (None if form == "templated" else
                                              "VMSIDECAR_SNAPSHOT_FORM=stream on this runtime"), first.snapshot
    else:
        assert not first.snapshot.available and "libvirt" in (first.snapshot.reason or "")
    seen_random = {await _lease_leaves_traces(console, "lease-one-secret")}
    guest_disk = str(rt.state / "overlay.qcow2")

    # lease 3 again on the qemu backend (a second restore, or a spare made during a restored lease);
    # on libvirt every recycle is the same cold boot, which lease 2 shows
    for lease in (2, 3) if backend == "qemu" else (2,):
        parked = None
        if standby:  # made while the lease wrote its traces: it runs (or waits) beside the lease's guest
            spare = await client.wait_spare()
            assert spare.snapshot.standby == ("ready" if standby is True else "parked"), spare.snapshot
            assert len(qemu_pids(str(rt.state))) == 2
            if standby == "parked":  # (not the last one, the guest now: its overlay was moved)
                (parked,) = [pid for pid in qemu_pids(str(rt.state / "spare")) if guest_disk not in _fds(pid)]
        leases_qemus = set(qemu_pids(str(rt.state)))
        made_ahead = None
        if backend == "qemu" and standby is False:  # made after the capture was stored, then after lease 2's restore
            ahead = rt.state / "overlay-ahead.qcow2"
            await wait_until_async(ahead.exists, 30, "the next restore's overlay to be made ahead")
            made_ahead = Marks()
            made_ahead.mark(ahead)
        state, seconds = await _recycle(client)
        assert state.generation == lease - 1
        if made_ahead is not None:  # renamed into place: what follows shows it is as pristine as one made now
            with made_ahead:
                assert made_ahead.marked(rt.state / "overlay.qcow2")
        if backend == "qemu":
            assert state.snapshot.boot == "restored", state.snapshot
            assert state.snapshot.restored_ahead == (standby is True), state.snapshot
            if parked is not None:  # the recycle loaded the snapshot into the parked QEMU: it runs the guest
                assert guest_disk in _fds(parked), parked
            assert seconds < 10, f"a restore took {seconds:.1f} s"  # ~0.5 s unloaded: see bench/snapshot.py
            # the lease's QEMU runs no guest once the recycle is over (it may still be in its exit,
            # reaped beside the restore), and is gone soon after: reaped, no zombie
            (ended,) = leases_qemus - set(qemu_pids(str(rt.state)))
            await wait_until_async(lambda ended=ended: not Path(f"/proc/{ended}").exists(), 10,
                                   "the lease's QEMU to be reaped", interval=0.05)
        replay, probe = await _probe(console)
        assert "VMSIDECAR-READY" in replay  # the pristine boot's scrollback: expect(marker) works
        assert "lease-one-secret" not in replay and "lease-two-secret" not in replay
        # no file of the runtime's kept what the last lease typed (its console log had)
        assert _files_holding(rt.state, (b"lease-one-secret", b"lease-two-secret")) == [], "a lease's file"
        lines = [line.strip() for line in probe.splitlines()]
        assert "ls: /data/lease-file: No such file or directory" in lines, probe  # disk
        assert "ls: /tmp/ram-file: No such file or directory" in lines, probe  # RAM
        assert "0" in lines, probe  # the process is gone
        random_now = lines[-1]
        assert re.fullmatch(r"[0-9a-f]{32}", random_now) and random_now not in seen_random, probe
        seen_random.add(random_now)
        seen_random.add(await _lease_leaves_traces(console, "lease-two-secret"))


async def _write_and_list(console_sock: Path, tag: str) -> list[str]:
    """Dirty RAM (a RAM-only file of 8 MiB and a marker naming ``tag``), return the markers the guest sees."""
    con = await Console.open(console_sock)
    try:
        await con.wake()
        await con.run(f"dd if=/dev/urandom of=/tmp/fill-{tag} bs=1M count=8 2>/dev/null; echo {tag} > /tmp/marker-{tag}")
        out = await con.run("echo MARKERS $(cat /tmp/marker-* 2>/dev/null)")
    finally:
        await con.close()
    return next(line for line in out.splitlines() if line.startswith("MARKERS")).split()[1:]


#: pods of one node on one cache in the templating test (the issue's ten)
INSTANCES = 10


async def test_instances_of_one_template_keep_their_ram_to_themselves(start_runtime: Any, tiny_image: Any,
                                                                     image_cache: Path) -> None:
    # ten pods of one node on one cache: the first captures the template, the nine others restore it;
    # all ten run from the same RAM file and write their own data to their RAM at once
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "template"}]}
    tags = [f"pod{i}" for i in range(INSTANCES)]
    first = await start_runtime(spec, name=tags[0])
    await first.client().wait_ready(240)
    state = await first.client().wait_stored()
    assert state.snapshot.form == "templated" and state.snapshot.available, state.snapshot
    snap = next(p for p in (image_cache / "snapshots").iterdir() if not p.name.startswith("."))
    ram = snap / "ram"
    before = hashlib.sha256(ram.read_bytes()).hexdigest(), ram.stat().st_mtime_ns, ram.stat().st_ctime_ns
    others = await asyncio.gather(*(start_runtime(spec, name=tag) for tag in tags[1:]))
    for rt in others:
        state = await rt.client().wait_ready(240)
        assert state.snapshot.boot == "restored" and state.snapshot.form == "templated", state.snapshot
    runtimes = [first, *others]
    # every QEMU maps the RAM on a 2 MiB boundary, where shmem can be huge pages (qemu_argv.RAM_ALIGN):
    # the capturing boot's memfd, which it runs on, and the restores' private mappings of the template
    for rt, name in zip(runtimes, ["/memfd:vmsidecar-ram-"] + [str(ram)] * len(others), strict=True):
        (qemu,) = qemu_pids(str(rt.state))
        assert _ram_mapping_start(qemu, name) % (2 << 20) == 0, Path(f"/proc/{qemu}/maps").read_text()
    for _ in range(2):  # the second time, after all ten wrote
        seen = await asyncio.gather(*(_write_and_list(rt.shared / "console.sock", tag)
                                      for tag, rt in zip(tags, runtimes, strict=True)))
        assert seen == [[tag] for tag in tags], seen
    # the restores' writes never reached the template (mapped copy-on-write)
    after = hashlib.sha256(ram.read_bytes()).hexdigest(), ram.stat().st_mtime_ns, ram.stat().st_ctime_ns
    assert after == before
    # and a recycle of one restores the template again: pristine
    await runtimes[1].client().recycle()
    state = await runtimes[1].client().wait_ready(120)
    assert state.snapshot.boot == "restored", state.snapshot
    assert await _write_and_list(runtimes[1].shared / "console.sock", "again") == ["again"]


async def test_warm_start_restores_from_the_cache(start_runtime: Any, tiny_image: Any, image_cache: Path) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "warm"}]}
    first = await start_runtime(spec, name="first")
    await first.client().wait_ready(240)
    assert (await first.client().wait_stored()).snapshot.available
    # nothing of the capture lingers beside the guest: the one memfd the runtime holds is the RAM the
    # captured guest runs on (its QEMU maps it; the runtime frees it once that QEMU is gone)
    (qemu,) = qemu_pids(str(first.state))
    held = _memfds(first.proc.pid)
    assert len(held) <= 1 and set(held) <= set(_memfds(qemu)), (held, _memfds(qemu))
    assert first.stop() == 0
    started = time.monotonic()
    second = await start_runtime(spec, name="second", wait=False)
    await second.wait_serving()
    state = await second.client().wait_ready(120, poll=0.02)
    took = time.monotonic() - started
    assert state.snapshot.boot == "restored" and state.boot == 1, state.snapshot
    assert took < 15, f"warm start took {took:.1f} s"  # ~1 s unloaded: see bench/snapshot.py
    replay, _ = await _probe(second.shared / "console.sock")
    assert "VMSIDECAR-READY" in replay
    # the capturing runtime recorded its files' stat seals in the cache index: this new process
    # trusts them while they hold and hashes nothing (the RAM file alone: ~60 ms of a warm start)
    snap = next(p for p in (image_cache / "snapshots").iterdir() if not p.name.startswith("."))
    assert "hashed against its seal" not in second.log_text(), second.log_text()[-2000:]
    assert second.stop() == 0

    # a file whose ctime moved (chmod back to the same mode: content unchanged) is hashed again
    # by the next process, passes, and its new stat is what the record holds from then on
    ram = snap / "ram"
    ram.chmod(ram.stat().st_mode & 0o777)
    third = await start_runtime(spec, name="third")
    state = await third.client().wait_ready(120, poll=0.02)
    assert state.snapshot.boot == "restored", state.snapshot
    assert re.search(r"snapshot \w+: ram hashed against its seal", third.log_text()), third.log_text()[-2000:]
    assert third.stop() == 0
    fourth = await start_runtime(spec, name="fourth")
    assert (await fourth.client().wait_ready(120, poll=0.02)).snapshot.boot == "restored"
    assert "hashed against its seal" not in fourth.log_text(), fourth.log_text()[-2000:]


async def test_a_kernel_or_initrd_rebuilt_at_its_path_is_booted_not_the_snapshot_of_the_one_before(
    start_runtime: Any, tiny_image: Any, tiny_b_image: Any, tmp_path: Path
) -> None:
    """A spec that boots a kernel and initrd from files (a kernel developer's loop: rebuild, run
    again) is captured under a key with those files' contents: the initrd rebuilt at the same path
    boots, where the snapshot of the one before came back; the same files again restore."""
    initrd = tmp_path / "initrd.gz"
    shutil.copyfile(tiny_image.initrd, initrd)
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "kernel": str(tiny_image.kernel),
            "initrd": str(initrd), "cmdline": tiny_image.manifest["cmdline"]}
    cache = tmp_path / "cache"  # its own: nothing of another test's key in it
    first = await start_runtime(spec, name="first", cache=cache)
    await first.client().wait_ready(240)
    assert (await first.client().wait_stored()).snapshot.available
    assert first.stop() == 0
    shutil.copyfile(tiny_b_image.initrd, initrd)  # rebuilt: another label in its init
    second = await start_runtime(spec, name="second", cache=cache)
    state = await second.client().wait_ready(240)
    replay, _ = await _probe(second.shared / "console.sock")
    assert state.snapshot.boot != "restored", state.snapshot
    assert "VMSIDECAR-READY image=tiny-b " in replay, replay
    assert (await second.client().wait_stored()).snapshot.available
    assert second.stop() == 0
    third = await start_runtime(spec, name="third", cache=cache)  # the same files: the new capture serves
    state = await third.client().wait_ready(120)
    replay, _ = await _probe(third.shared / "console.sock")
    assert state.snapshot.boot == "restored", state.snapshot
    assert "VMSIDECAR-READY image=tiny-b " in replay, replay


async def test_runtimes_sharing_a_cache_capture_the_same_key_at_once(start_runtime: Any, tiny_image: Any,
                                                                     tmp_path: Path) -> None:
    # pods of one node sharing a cache volume: both cold boot and capture the same key together;
    # the first complete snapshot wins, the other runtime restores from it, both reach Ready.
    # A cache of their own: the session's is shared by every xdist worker, whose captures of other
    # keys may be under way in it at any moment
    image_cache = tmp_path / "node-cache"
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "shared-cache"}]}
    one, two = await asyncio.gather(start_runtime(spec, name="one", cache=image_cache),
                                    start_runtime(spec, name="two", cache=image_cache))
    await asyncio.gather(one.client().wait_ready(240), two.client().wait_ready(240))
    states = await asyncio.gather(one.client().wait_stored(), two.client().wait_stored())
    assert all(s.snapshot.available for s in states), [s.snapshot for s in states]
    root = image_cache / "snapshots"
    assert not list(root.glob(".incoming-*")) and not list(root.glob(".trash-*")), list(root.iterdir())
    for rt in (one, two):  # and each guest answers, from the snapshot now in the cache
        state, _ = await _recycle(rt.client())
        assert state.snapshot.boot == "restored", state.snapshot
        replay, _ = await _probe(rt.shared / "console.sock")
        assert "VMSIDECAR-READY" in replay


async def test_snapshot_off_boots_cold_at_every_recycle(start_runtime: Any, tiny_image: Any) -> None:
    # (a snapshot QEMU itself refuses to load: test_attack_snapshots.py, the tampered snapshot's last case)
    off = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"}, name="off")
    state = await off.client().wait_ready(240)
    assert state.snapshot.boot == "cold" and state.snapshot.reason == "snapshot: off in the spec"
    await off.client().recycle()
    state = await off.client().wait_ready(240)
    assert state.snapshot.boot == "cold"


async def test_relative_directories_restore_like_absolute_ones(tmp_path: Path, tiny_image: Any) -> None:
    """``serve --cache-dir cache --state-dir state --shared-dir shared`` (relative, as typed in a
    shell): an overlay's backing file named relative to the runtime's directory is read by qemu-img
    relative to the overlay's, so every restore was refused and each recycle booted cold."""
    root = tmp_path / "rel"
    root.mkdir()
    (root / "spec.json").write_text(json.dumps({"image": f"file:{tiny_image.disk}", "memory": "256M"}))
    argv = [*runtime_command(), "serve", "--shared-dir", "shared", "--state-dir", "state", "--cache-dir", "cache",
            "--spec", "spec.json", "--grace", "5"]
    with open(root / "runtime.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=clean_environ())
    with RuntimeProcess(proc, root / "shared", root / "state", root / "runtime.log") as rt:
        await rt.wait_serving()
        async with RuntimeClient(rt.socket) as client:
            assert (await client.wait_ready(240)).snapshot.boot == "cold"
            assert (await client.wait_stored()).snapshot.available
            await client.recycle()
            state = await client.wait_ready(120, poll=0.02)
            assert state.snapshot.boot == "restored", (state.snapshot, rt.log_text()[-3000:])
        assert "not made ahead" not in rt.log_text(), rt.log_text()[-3000:]


async def _boot_until_captured_on_output(start_runtime: Any, tiny_image: Any) -> tuple[Any, Console]:
    """A runtime whose guest becomes Ready (and is captured) when it prints CAPTURE-NOW, and a
    console at its prompt."""
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M",
                              "readiness": {"pattern": "CAPTURE-NOW", "timeout": 300}})
    con = await Console.open_when_served(rt.shared / "console.sock")
    await con.wake()
    assert (await rt.client().state()).phase.value == "Running"
    return rt, con


async def test_console_keystrokes_typed_across_the_capture_all_reach_the_guest(start_runtime: Any,
                                                                                tiny_image: Any) -> None:
    """The capture pauses the guest (and moves it to a new QEMU where it cannot go on in its own).
    Keystrokes typed meanwhile (one every 5 ms, from the readiness line on) must reach the guest in
    order, none lost: before the fix, those written between the old QEMU's pause and the new one's
    start went to the old one and were lost."""
    rt, con = await _boot_until_captured_on_output(start_runtime, tiny_image)
    try:
        con.writer.write(b"echo CAPTURE-\'\'NOW\n")  # its output, not the echo of the typed line, matches
        await con.writer.drain()
        await con.expect(rb"\nCAPTURE-NOW\r?\n", 60)
        typed = "".join(str(i % 10) for i in range(400))  # busybox's line editor keeps 1024 bytes
        con.writer.write(b"echo ")
        for key in typed:
            con.writer.write(key.encode())
            await con.writer.drain()
            await asyncio.sleep(0.005)  # a typist's pace: the keystrokes span the whole capture
        con.writer.write(b"\n")
        await con.writer.drain()
        await con.expect(rf"\n{typed}\r?\n", 60)
        state = await rt.client().wait_ready(60)
    finally:
        await con.close()
    assert state.snapshot.capture_seconds is not None and state.boot == 1, state.snapshot



async def test_a_ready_guest_is_captured_once_it_settled_and_what_is_typed_meanwhile_stays_out_of_it(
        start_runtime: Any, tiny_image: Any) -> None:
    """Ready comes at the marker; the capture waits until the guest's vCPUs went idle (a systemd
    guest's boot goes on for seconds after its marker, and a snapshot taken then makes every restore
    run that tail again). Input typed in between reaches the guest after the capture: never the
    snapshot, nor the next lease."""
    rt, con = await _boot_until_captured_on_output(start_runtime, tiny_image)
    client, tag = rt.client(), f"typed-{os.getpid()}-{time.monotonic_ns()}"
    try:
        con.writer.write(b"echo CAPTURE-\'\'NOW\n")
        await con.writer.drain()
        await con.expect(rb"\nCAPTURE-NOW\r?\n", 60)
        ready = await client.wait_ready(30, poll=0.01)
        assert ready.snapshot.storing and not ready.snapshot.available, ready.snapshot  # Ready, not captured yet
        con.writer.write(f"echo {tag} > /tmp/typed\n".encode())  # while the guest settles: held
        await con.writer.drain()
        state = await client.wait_stored(60)
        assert state.timings.ready == ready.timings.ready  # the boot's Ready is its marker's, not the capture's
        assert state.snapshot.available and state.snapshot.captured_when == "settled", state.snapshot
        assert state.snapshot.settle_seconds is not None and state.snapshot.settle_seconds >= 1.9, state.snapshot
        assert tag in await con.run("cat /tmp/typed")  # it reached the guest, after the capture
    finally:
        await con.close()
    await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored", state.snapshot
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.drain_replay()
        replay = bytes(con.seen)
        await con.wake()
        assert "No such file" in await con.run("cat /tmp/typed")
    finally:
        await con.close()
    assert tag.encode() not in replay  # nor in the scrollback the snapshot keeps


async def test_a_guest_that_powers_off_while_it_settles_is_not_captured(start_runtime: Any, tiny_image: Any) -> None:
    rt, con = await _boot_until_captured_on_output(start_runtime, tiny_image)
    client = rt.client()
    try:
        # typed before Ready, so not held: the guest prints its marker, then powers itself off while it settles
        con.writer.write(b"echo CAPTURE-\'\'NOW; sleep 0.3; poweroff -f\n")
        await con.writer.drain()
        await con.expect(rb"\nCAPTURE-NOW\r?\n", 60)
    finally:
        await con.close()
    await wait_phase(client, "Stopped", timeout=60)
    state = await client.wait_stored(30)
    assert not state.snapshot.available and "before it settled" in (state.snapshot.reason or ""), state.snapshot
    assert state.snapshot.captured_when is None, state.snapshot


async def test_a_claim_at_ready_captures_at_once(start_runtime: Any, tiny_image: Any) -> None:
    """A claim that comes while the guest settles does not wait for it: the capture is taken at once,
    and the claim returns when it is (the lease never acts on a guest not yet captured)."""
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "claim-at-ready"}]})
    client = rt.client()
    await client.wait_ready(240, poll=0.01)
    started = time.monotonic()
    state = await client.claim()
    claimed_in = time.monotonic() - started
    assert state.snapshot.captured_when == "requested" and state.snapshot.capture_seconds is not None, state.snapshot
    assert claimed_in < 20, claimed_in  # not the settle limit (30 s)
    state = await client.wait_stored(60)
    assert state.snapshot.available, state.snapshot


async def test_the_captured_boot_goes_on_in_its_process_and_its_lease_keeps_its_disk(
    start_runtime: Any, tiny_image: Any, image_cache: Path, tmp_path: Path
) -> None:
    """The first lease runs on the QEMU process that booted and was captured, over a new overlay on
    the frozen one: what it writes survives its power cycle and is in its dump, and is in no
    snapshot (the next lease is restored without it)."""
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "in-place"}]}
    rt = await start_runtime(spec)
    client = rt.client()
    await wait_phase(client, "Running", timeout=240)
    booting = qemu_pids(str(rt.state))
    await client.wait_ready(240)
    first = await client.wait_stored()
    assert first.snapshot.boot == "cold" and first.snapshot.available and first.snapshot.capture_seconds, first.snapshot
    assert len(booting) == 1 and qemu_pids(str(rt.state)) == booting, "the captured boot moved to another QEMU"
    assert (rt.state / "overlay-base.qcow2").is_file()
    # the runtime holds the guest's RAM while its QEMU runs (QEMU's exit then does not free it: the
    # runtime does, beside what comes next), and lets it go once that QEMU is gone
    assert len(_memfds(rt.proc.pid)) == 1 and set(_memfds(booting[0])) == set(_memfds(rt.proc.pid))

    tag = f"in-place-{time.time_ns()}"
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.wake()
        await con.run(f"echo {tag} > /data/lease-file; sync")
    finally:
        await con.close()
    await client.power("off", graceful=False)
    await wait_until_async(lambda: not _memfds(rt.proc.pid), 10, "the runtime to free the RAM of the stopped guest")
    dump = tmp_path / "dump.qcow2"
    assert await client.dump(dump) > 0
    assert tag.encode() in dump.read_bytes(), "the dump lacks what the lease wrote after the capture"
    snapshot_disks = list((image_cache / "snapshots").glob("*/disk.qcow2"))
    assert snapshot_disks and all(tag.encode() not in d.read_bytes() for d in snapshot_disks)

    await client.power("on")
    again = await client.wait_ready(240)
    assert again.snapshot.boot == "cold" and "lease's changes" in (again.snapshot.reason or ""), again.snapshot
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.wake()
        assert tag in await con.run("cat /data/lease-file")
    finally:
        await con.close()

    state, _ = await _recycle(client)
    assert state.snapshot.boot == "restored", state.snapshot
    _, probe = await _probe(rt.shared / "console.sock")
    assert "ls: /data/lease-file: No such file or directory" in probe, probe
    assert not (rt.state / "overlay-base.qcow2").exists(), "the frozen overlay outlived its lease"


async def test_a_boot_that_never_gets_ready_lets_go_of_the_copy_its_capture_would_have_made(
    start_runtime: Any, tiny_image: Any
) -> None:
    """The copy a capture makes of the guest's RAM is allocated as the guest boots; a boot whose
    readiness times out (phase Error, the guest left running to be looked at) captures nothing,
    and must not hold a second copy of its RAM for as long as it runs."""
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M",
            "readiness": {"pattern": "NEVER-PRINTED", "timeout": 8}}
    rt = await start_runtime(spec)
    await wait_phase(rt.client(), "Running", timeout=120)
    await wait_until_async(lambda: _frozen_allocated(rt.proc.pid) > 16 << 20, 60,
                           "the capture's copy to be allocated while the guest boots")
    await wait_phase(rt.client(), "Error", timeout=60)
    # neither the copy nor the runtime's descriptor of the guest's RAM: QEMU keeps its own mapping
    assert _memfds(rt.proc.pid) == []
    assert qemu_pids(str(rt.state)), "the guest that did not get Ready was stopped"


async def test_a_killed_runtimes_capture_staging_is_removed_and_a_live_ones_is_kept(
    start_runtime: Any, tiny_image: Any, image_cache: Path
) -> None:
    """A cold boot that is to capture a templated snapshot has a staging directory in the cache, and
    its RAM is memory (a memfd QEMU maps, and the memfd its copy goes into), not a file there: the
    guest's page faults never write to the cache's disk. A runtime SIGKILLed mid-boot leaves that directory behind: the next
    runtime on the cache removes it, and leaves alone the staging of a runtime still alive."""
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M",
            "readiness": {"pattern": "NEVER-PRINTED", "timeout": 300}}  # stays Running: its capture pends
    snapshots = image_cache / "snapshots"

    def staging() -> set[str]:
        return {p.name for p in snapshots.glob(".incoming-*")} if snapshots.is_dir() else set()

    killed = await start_runtime(spec, name="killed")
    await wait_phase(killed.client(), "Running", timeout=120)
    left = staging()
    assert len(left) == 1, left
    assert list((snapshots / next(iter(left))).iterdir()) == [], "the booting guest's RAM is not on the cache's disk"
    key = next(iter(left)).split("-")[1]
    # the boot's RAM, and the copy the capture's pause is to make of it, allocated as the guest boots
    assert set(_memfds(killed.proc.pid)) == {f"/memfd:vmsidecar-ram-{key} (deleted)",
                                             f"/memfd:vmsidecar-frozen-{key} (deleted)"}
    killed.stop(signal.SIGKILL)
    await wait_until_async(lambda: not qemu_pids(str(killed.state)), 30, "the killed runtime's QEMU to end")

    alive = await start_runtime(spec, name="alive")
    await wait_phase(alive.client(), "Running", timeout=120)
    mine = staging() - left
    assert len(mine) == 1, staging()
    assert not left & staging(), f"the killed runtime's staging (its guest's RAM) is still in the cache: {left}"

    third = await start_runtime(spec, name="third")
    await wait_phase(third.client(), "Running", timeout=120)
    assert mine <= staging(), f"a live runtime's staging was removed by another runtime: {mine} not in {staging()}"
