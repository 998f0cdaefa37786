"""Attacks on the memory snapshots in the cache (issue 19, item 10).

The snapshot files are written by the runtime and read by the next lease's QEMU. QEMU runs as the
runtime's UID, so a guest that escapes into QEMU (or any process of that UID) can chmod them back
and rewrite them. Here the attacker does that for real, between two runtime processes on one
cache; the next runtime must notice before QEMU loads anything, drop the entry, boot cold and say
why in ``GET /v1/vm`` → ``snapshot.reason``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from fixtures.attack import copy_snapshot_entry
from fixtures.waiting import file_made, wait_until_async
from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.backend import create_backend
from vmsidecar_runtime.plan import BootPlan, RamFile

pytestmark = pytest.mark.timeout(600)


def _snapshot_dir(cache: Path) -> Path:
    dirs = [p for p in (cache / "snapshots").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _flip_a_byte(path: Path) -> None:
    os.chmod(path.parent, 0o755)  # what a process of the files' own UID can always do
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))


def _rewrite_ram(path: Path) -> None:
    """Rewrite one page of guest RAM the capture wrote (not a hole): what every restore maps."""
    os.chmod(path.parent, 0o755)
    with open(path, "r+b") as f:
        data_at = os.lseek(f.fileno(), path.stat().st_size // 2, os.SEEK_DATA)
        f.seek(data_at)
        page = f.read(4096)
        f.seek(data_at)
        f.write(bytes(b ^ 0x55 for b in page))


def _evil_overlay(path: Path) -> None:
    """Replace the frozen overlay with a qcow2 whose backing file is a host file."""
    os.chmod(path.parent, 0o755)
    path.unlink()
    # -u: the attacker's qemu-img need not open the backing file; QEMU would, at the next restore
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", "/etc/hostname", "-F", "raw",
                    str(path), "64M"], check=True, timeout=30)


def _forge_seal(snap: Path, name: str) -> None:
    """Rewrite the recorded sha256 of ``name`` to match its new content (same UID: it can)."""
    meta_file = snap / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["files"][name] = _sha256(snap / name)
    os.chmod(meta_file, 0o644)
    meta_file.write_text(json.dumps(meta))


async def _refused(start_runtime: Any, spec: dict[str, Any], name: str, args: list[str], snap: Path) -> str:
    """Start a runtime on the tampered cache, wait until it says why it refused the snapshot, and stop
    it there (its cold boot has begun; that such a boot captures anew is the last case's to show).
    Returns the reason, once the entry is seen removed."""
    rt = await start_runtime(spec, name=name, extra_args=args)
    client = rt.client()

    async def refused() -> Any:
        state = await client.state()
        return state if state.snapshot.reason else None

    state = await wait_until_async(refused, 120, f"{name}: the snapshot's refusal",
                                   detail=lambda: rt.log_text()[-2000:])
    assert state.snapshot.boot == "cold" and not state.snapshot.available, state.snapshot
    assert rt.stop() == 0
    assert not snap.exists(), "the tampered entry is still in the cache"
    return state.snapshot.reason


async def test_a_tampered_snapshot_is_never_restored(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "sealed"}]}
    args = ["--cache-dir", str(cache)]

    first = await start_runtime(spec, name="capture", extra_args=args)
    await first.client().wait_ready(240)
    state = await first.client().wait_stored()
    assert state.snapshot.available, state.snapshot
    assert first.stop() == 0
    snap = _snapshot_dir(cache)
    assert (snap.stat().st_mode & 0o777) == 0o555, oct(snap.stat().st_mode)
    # the RAM file of the templated form: QEMU 7.2 opens it read-write to map it privately, so
    # it stays writable for its owner (snapshots.py); its seal is what protects it (attack 2)
    assert {p.name: p.stat().st_mode & 0o777 for p in snap.iterdir()} == dict.fromkeys(
        ("memory", "disk.qcow2", "meta.json", "ttyS0.console", "hvc0.console"), 0o444) | {"ram": 0o644}
    assert state.snapshot.form == "templated", state.snapshot
    # one capture serves every attack, each on an untouched copy at the path the frozen overlay's backing names
    pristine = tmp_path / "pristine"
    copy_snapshot_entry(snap, pristine)

    # 0. the copy untouched is restored (the attacks below are refused for what they changed, not
    # for being a copy: the index's record of the capture is about another directory, so it is hashed)
    os.chmod(snap, 0o755)
    shutil.rmtree(snap)
    copy_snapshot_entry(pristine, snap)
    restored = await start_runtime(spec, name="untouched", extra_args=args)
    assert (await restored.client().wait_ready(120)).snapshot.boot == "restored"
    assert restored.stop() == 0

    # 1. one byte of the memory stream rewritten (QEMU would load it: RAM pages carry no checksum)
    _flip_a_byte(snap / "memory")
    reason = await _refused(start_runtime, spec, "after-memory", args, snap)
    print(f"memory rewritten: {reason}")
    assert "memory" in reason and "sha256" in reason and "removed" in reason, reason

    # 2. one page of the templated snapshot's RAM file rewritten: every restore maps that file, and
    # the device state (the stream) is intact, so QEMU would run the attacker's page in the guest
    copy_snapshot_entry(pristine, snap)
    _rewrite_ram(snap / "ram")
    reason = await _refused(start_runtime, spec, "after-ram", args, snap)
    print(f"RAM file rewritten: {reason}")
    assert "ram" in reason and "BLAKE3" in reason and "removed" in reason, reason

    # 3. the frozen overlay replaced by one that makes QEMU open a host file, and its seal forged
    copy_snapshot_entry(pristine, snap)
    _evil_overlay(snap / "disk.qcow2")
    _forge_seal(snap, "disk.qcow2")
    reason = await _refused(start_runtime, spec, "after-overlay", args, snap)
    print(f"overlay replaced, seal forged: {reason}")
    assert "/etc/hostname" in reason and "backing file" in reason, reason
    assert "refused" not in reason, reason  # caught before QEMU was ever asked to load it

    # 4. the memory stream damaged and truncated, its seal rewritten to match: for a runtime that never
    # checked seals, so that QEMU itself is what refuses it; the guest boots cold, captures anew, and
    # the next recycle restores that capture
    copy_snapshot_entry(pristine, snap)
    memory = snap / "memory"
    os.chmod(snap, 0o755)
    os.chmod(memory, 0o644)
    data = bytearray(memory.read_bytes())
    data[len(data) // 2: len(data) // 2 + 4096] = b"\xa5" * 4096
    memory.write_bytes(bytes(data[: len(data) * 3 // 4]))
    _forge_seal(snap, "memory")
    rt = await start_runtime(spec, name="after-stream", extra_args=args)
    state = await rt.client().wait_ready(240)
    assert state.snapshot.boot == "cold" and "refused" in (state.snapshot.reason or ""), state.snapshot
    assert (await rt.client().wait_stored()).snapshot.available
    await rt.client().recycle()
    state = await rt.client().wait_ready(240)
    assert state.snapshot.boot == "restored", state.snapshot


async def test_a_spare_over_a_ram_file_changed_during_the_lease_is_never_adopted(
        start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    """With ``standby: true`` the spare restore maps the template's RAM file privately before the
    lease begins; pages it has not touched yet still read the file. An escaped QEMU of the lease
    (QEMU 7.2 holds that file read-write) rewrites a page during the lease: a restore would find the
    seal broken and boot cold, but the recycle adopted the spare without a look, handing the next
    lease the attacker's page."""
    cache = tmp_path / "cache"
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "spare-seal"}],
            "standby": True}
    rt = await start_runtime(spec, name="spare-seal", extra_args=["--cache-dir", str(cache)])
    client = rt.client()
    await client.wait_ready(240)
    await client.wait_stored()
    await client.recycle()  # from now on the lease's guest is a restore, and a spare is made after it
    await client.wait_ready(120)
    state = await client.wait_spare(120)
    assert state.snapshot.standby == "ready", state.snapshot
    _rewrite_ram(_snapshot_dir(cache) / "ram")  # during the lease, as its QEMU's UID
    await client.recycle()
    state = await client.wait_ready(240)
    print(f"after the recycle: {state.snapshot}")
    assert not state.snapshot.restored_ahead, "the spare over the rewritten RAM file was adopted"
    assert state.snapshot.boot == "cold", state.snapshot
    reason = state.snapshot.reason or ""
    assert "ram" in reason and "BLAKE3" in reason and "removed" in reason, reason


async def test_an_overlay_made_ahead_and_rewritten_during_the_lease_is_never_booted(
        start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    """The next restore's overlay is made while a lease runs (``overlay-ahead.qcow2`` in the state
    directory) and renamed into place by that restore. An escaped QEMU of the lease (the runtime's
    UID) rewrites it: the next lease's guest booted on the attacker's clusters."""
    cache = tmp_path / "cache"
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "ahead-seal"}]}
    rt = await start_runtime(spec, name="ahead-seal", extra_args=["--cache-dir", str(cache)])
    client = rt.client()
    await client.wait_ready(240)
    await client.wait_stored()
    await client.recycle()  # a restore: the next one's overlay is made ahead during this lease
    await client.wait_ready(120)
    ahead = rt.state / "overlay-ahead.qcow2"
    await file_made(ahead)
    planted = tmp_path / "planted.qcow2"  # the same overlay, with a cluster of the attacker's
    backing = json.loads(subprocess.run(["qemu-img", "info", "-U", "--output=json", str(ahead)], check=True,
                                        capture_output=True, timeout=30).stdout)["full-backing-filename"]
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", "qcow2", str(planted)],
                   check=True, timeout=30)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 64k", str(planted)], check=True,
                   capture_output=True, timeout=30)
    shutil.copyfile(planted, ahead)  # in place, as the escaped QEMU writes it
    await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored", state.snapshot
    read = subprocess.run(["qemu-io", "-U", "-r", "-f", "qcow2", "-c", "read -P 0x5a 0 64k",
                           str(rt.state / "overlay.qcow2")], capture_output=True, text=True, timeout=30)
    assert "Pattern verification failed" in read.stdout, f"the next lease's disk reads the planted bytes: {read.stdout}"


def test_a_link_in_a_snapshot_entry_breaks_its_seal(tmp_path: Path) -> None:
    """A process of the cache's UID (an escaped QEMU, another pod on the cache volume) adds a link to a
    file it cannot read but the next reader can (the pusher's registry credentials) and seals it in
    meta.json: the seal check hashed through the link and passed, and `vmsidecar-oci snapshot push`
    uploaded the target to the repository every pod reads."""
    from vmsidecar_runtime.disk import DiskImage
    from vmsidecar_runtime.oci.cache import hash_file
    from vmsidecar_runtime.snapshots import SnapshotStore

    secret = tmp_path / "pusher-only" / "config.json"
    secret.parent.mkdir()
    secret.write_text('{"auths": {"registry.example": {"auth": "c2VjcmV0"}}}')
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "1M"], check=True)
    cache = tmp_path / "cache"
    (cache / "locks").mkdir(parents=True)
    entry = cache / "snapshots" / "k"
    entry.mkdir(parents=True)
    (entry / "memory").write_bytes(b"device state")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", str(base), "-F", "qcow2",
                    str(entry / "disk.qcow2"), "1M"], check=True)
    os.symlink(secret, entry / "creds")
    files = {name: hash_file(entry / name) for name in ("memory", "disk.qcow2", "creds")}
    (entry / "meta.json").write_text(json.dumps({"guest_agent": False, "files": files, "form": "stream"}))
    store = SnapshotStore(cache)
    snap = store.find("k")
    assert snap is not None
    broken = store.verify(snap, DiskImage(base, "qcow2", "sha256:" + "0" * 64, "file:base"))
    assert broken is not None and "creds is not a regular file" in broken, broken


async def test_the_snapshot_reaches_qemu_only_after_its_seal_check(tiny_image: Any) -> None:
    # A warm start hashes the RAM file and the memory stream while QEMU starts (issue 21): QEMU
    # starts paused, the RAM file mapped, waiting for a stream, and must be handed nothing (no
    # migration begins) until the check says the snapshot holds its seal.
    run_dir = Path(tempfile.mkdtemp(prefix="vmsidecar-"))  # short: Unix socket paths are limited
    overlay = run_dir / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(tiny_image.disk),
                    str(overlay)], check=True, timeout=30)
    ram = run_dir / "ram"
    with open(ram, "wb") as f:  # a templated snapshot's RAM file (sparse)
        f.truncate(256 << 20)
    check: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
    spec = load_spec({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    # no such stream: had the backend opened it to hand it over, the error would say QEMU could not load it
    plan = BootPlan(spec, "tcg", overlay, "qcow2", run_dir, incoming=run_dir / "memory",
                    ram=RamFile(ram, share=False), incoming_check=check, disk_chain=(tiny_image.disk,))
    backend = create_backend(plan, lambda event, data: None)
    launch = asyncio.create_task(backend.launch())
    try:
        await wait_until_async(plan.qmp_socket.exists, 60, "QEMU's QMP socket")
        await asyncio.wait({launch}, timeout=1.0)  # the launch must not end without the check's verdict
        assert not launch.done(), launch  # QEMU is up and waits; the backend waits for the check
        check.set_result("ram does not match the BLAKE3 recorded at capture (altered on disk)")
        with pytest.raises(HostError, match=r"^the memory snapshot was not loaded: ram does not match"):
            await asyncio.wait_for(launch, 30)
    finally:
        await backend.kill()
        await backend.close()
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_an_aarch64_guest_is_never_restored_without_a_new_rng_seed(start_runtime: Any, tmp_path: Path) -> None:
    # QEMU's `virt` machine has no vmgenid: a restored aarch64 guest would never learn that it is
    # a copy, and every lease would draw the same "random" numbers as the capture's guest
    from vmsidecar_images.build import build_image

    image = build_image("tiny", arch="aarch64")
    spec = {"image": f"file:{image.disk}", "arch": "aarch64", "kernel": str(image.kernel),
            "initrd": str(image.initrd), "cmdline": image.cmdline, "memory": "256M"}
    cache = tmp_path / "cache"
    rt = await start_runtime(spec, name="aarch64", extra_args=["--cache-dir", str(cache)])
    state = await rt.client().wait_ready(240)
    assert state.snapshot.boot == "cold" and not state.snapshot.available, state.snapshot
    assert state.snapshot.reason == "aarch64: no vmgenid, the guest's RNG would repeat — cold boot", state.snapshot
    await rt.client().recycle()
    state = await rt.client().wait_ready(240)
    assert state.snapshot.boot == "cold", state.snapshot
    assert not [p for p in (cache / "snapshots").glob("*") if not p.name.startswith(".")]
