"""The debian guest: systemd Debian 12 (mmdebstrap) on the tiny guest's loop-free BIOS disk.

The image is built once per cache (~40 s, from the machine's Debian mirror; a cache hit is well
under a second). The boot test runs it through a runtime process (TCG: ~25 s to the marker),
checks the system from its console shell, restores it from the snapshot that boot captured (its
clock set to the host's through the guest agent, which waits on its port because the runtime
holds the socket) and powers it off through the ACPI power button.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.events import collecting
from fixtures.runtime import recycle_until_ready
from vmsidecar_contract.spec import load_spec
from vmsidecar_images import disk, rootfs
from vmsidecar_images.build import BuiltImage, build_image
from vmsidecar_images.console import Console
from vmsidecar_images.recipe import load_recipe

pytestmark = pytest.mark.timeout(900)

MARKER = rb"VMSIDECAR-READY image=debian uptime=([0-9.]+) boot=([0-9a-f-]{36})"
_MTOOLS_ENV = {"MTOOLS_SKIP_CHECK": "1", "PATH": "/usr/bin:/bin"}


def _disk_head(image: BuiltImage, tmp_path: Path, mib: int) -> bytes:
    """The first ``mib`` MiB of the disk as raw bytes (MBR, p1, the start of p2)."""
    out = tmp_path / "head.img"
    subprocess.run(["qemu-img", "dd", "-f", "qcow2", "-O", "raw", "bs=1M", f"count={mib}", f"if={image.disk}",
                    f"of={out}"], check=True)  # fmt: skip
    return out.read_bytes()


def test_debian_recipe_builds(debian_image: BuiltImage) -> None:
    m = debian_image.manifest
    recipe = load_recipe("debian")
    assert (m["name"], m["arch"], m["label"], m["boot"]) == ("debian", "x86_64", "debian", "bios-disk")
    assert debian_image.dir.name == f"debian-x86_64-{m['input_hash'][:12]}"
    assert f"root=UUID={recipe.config['disk']['root_uuid']} " in m["cmdline"]
    assert "console=ttyS0,115200" in m["cmdline"] and "console=hvc0" in m["cmdline"]
    assert (m["ready_marker"], m["prompt"]) == ("VMSIDECAR-READY", "vm# ")
    assert re.match(m["ready_regex"], "VMSIDECAR-READY image=debian uptime=21.5 boot=x")
    for name, info in m["files"].items():
        data = (debian_image.dir / name).read_bytes()
        assert (info["size"], info["sha256"]) == (len(data), hashlib.sha256(data).hexdigest()), name
    assert not debian_image.disk.stat().st_mode & 0o222, "cached disk must be read-only"
    assert m["files"]["disk.qcow2"]["size"] < 400e6

    # the snapshot was installed exactly (the build checks it); what the guest needs is in it
    packages = m["pins"]["packages"]
    assert packages == recipe.pins["x86_64"].packages
    kernel = m["pins"]["kernel"]
    assert packages[kernel["package"]] == kernel["version"]
    assert {"systemd", "systemd-sysv", "udev", "dbus", "systemd-resolved", "qemu-guest-agent", "iproute2",
            "procps", "kmod", "util-linux"} <= set(packages)  # fmt: skip
    assert "usrmerge" not in packages and "perl" not in packages, "merged /usr must not pull perl"
    assert m["guest"]["init"] == f"systemd {packages['systemd']}"
    assert debian_image.kernel.read_bytes()[0x202:0x206] == b"HdrS", "bzImage"
    assert debian_image.initrd.read_bytes()[:2] == b"\x1f\x8b", "gzip initramfs"


def test_debian_disk_layout(debian_image: BuiltImage, tmp_path: Path) -> None:
    recipe = load_recipe("debian")
    boot_mib = int(recipe.config["disk"]["boot_mib"])
    data = _disk_head(debian_image, tmp_path, 1 + boot_mib + 1)
    assert data[:440] == disk.syslinux_mbr().read_bytes()[:440], "syslinux MBR boot code"
    parts = disk.read_partitions(data)
    assert [(p["type"], p["bootable"]) for p in parts] == [(0x0E, True), (0x83, False)]
    p1, p2 = parts
    assert p2["sectors"] * 512 == int(recipe.config["disk"]["root_mib"]) << 20

    # p1: syslinux, its config (the manifest's command line), Debian's kernel and initramfs
    at = f"{tmp_path / 'head.img'}@@{p1['start'] * 512}"
    listing = subprocess.run(["mdir", "-a", "-b", "-i", at, "::/"], capture_output=True, text=True, check=True,
                             env=_MTOOLS_ENV).stdout  # fmt: skip
    names = {line.strip().lstrip(":/").lower() for line in listing.splitlines() if line.strip()}
    assert {"ldlinux.sys", "ldlinux.c32", "syslinux.cfg", "vmlinuz", "initrd.gz"} <= names
    cfg = subprocess.run(["mtype", "-i", at, "::/syslinux.cfg"], capture_output=True, text=True, check=True,
                         env=_MTOOLS_ENV).stdout  # fmt: skip
    assert f"APPEND {debian_image.manifest['cmdline']}" in cfg

    # p2: the ext4 root file system, found by the UUID the command line names
    p2_head = tmp_path / "p2-head.img"
    p2_head.write_bytes(data[p2["start"] * 512 :])
    probe = subprocess.run(["blkid", "-p", "-o", "export", str(p2_head)], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    fields = dict(line.split("=", 1) for line in probe.splitlines() if "=" in line)
    assert (fields["TYPE"], fields["LABEL"]) == ("ext4", recipe.config["disk"]["root_label"])
    assert fields["UUID"] == recipe.config["disk"]["root_uuid"]


def test_debian_cache_hit_runs_no_bootstrap(debian_image: BuiltImage, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_bootstrap(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache hit must not bootstrap")

    monkeypatch.setattr(rootfs, "mmdebstrap", no_bootstrap)
    t0 = time.monotonic()
    again = build_image("debian")
    assert again.dir == debian_image.dir
    assert time.monotonic() - t0 < 5


def _synthetic_rootfs(path: Path) -> None:
    """A small root file system tarball with what an unprivileged unpack cannot reproduce itself."""

    def add(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0, data: bytes = b"", link: str = "") -> None:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.uid, info.gid, info.linkname = kind, mode, uid, gid, link
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    with tarfile.open(path, "w") as tar:
        add("./", tarfile.DIRTYPE, 0o755)
        for d in ("./etc/", "./usr/", "./usr/bin/", "./var/"):
            add(d, tarfile.DIRTYPE, 0o755)
        add("./etc/shadow", tarfile.REGTYPE, 0o640, gid=42, data=b"root:*:19000:0:99999:7:::\n")
        add("./etc/locked", tarfile.REGTYPE, 0o000, data=b"nobody may read this\n")
        add("./usr/bin/su", tarfile.REGTYPE, 0o4755, data=b"\x7fELF-ish")
        add("./usr/bin/su-again", tarfile.LNKTYPE, 0o4755, link="./usr/bin/su")
        add("./var/mail/", tarfile.DIRTYPE, 0o2775, gid=8)
        add("./proc/", tarfile.DIRTYPE, 0o555)
        add("./bin", tarfile.SYMTYPE, 0o777, link="usr/bin")
        add("./dev/", tarfile.DIRTYPE, 0o755)
        add("./dev/null", tarfile.CHRTYPE, 0o666)


def _debugfs_stat(image: Path, path: str) -> dict[str, str]:
    out = subprocess.run(["debugfs", "-R", f"stat {path}", str(image)], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    m = re.search(r"Inode: (\d+)\s+Type: (\w+)\s+Mode:\s+(\d+).*?User:\s+(\d+)\s+Group:\s+(\d+).*?Links: (\d+)", out, re.S)
    assert m, out
    return dict(zip(("inode", "type", "mode", "uid", "gid", "links"), m.groups(), strict=True))


def test_unprivileged_unpack_gives_the_ext4_the_tarball_owners_and_modes(tmp_path: Path) -> None:
    """What a non-root build writes (files owned by the builder, no set-id on others' files, 0000
    files it cannot read back) is corrected in the ext4 by debugfs: the inodes match the tarball."""
    probe = subprocess.run(["unshare", "--user", "--map-user=1234", "--map-group=1234", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("this test needs a user namespace (kernel.unprivileged_userns_clone / user.max_user_namespaces) "
                    f"to play the non-root builder: unshare --user said {probe.stderr.strip()!r}")
    tar, tree, image = tmp_path / "root.tar", tmp_path / "tree", tmp_path / "p2.img"
    _synthetic_rootfs(tar)
    script = (
        "import os, sys; from pathlib import Path; from vmsidecar_images import disk, rootfs\n"
        "assert os.geteuid() == 1234\n"
        f"fixes = rootfs.unpack(Path({str(tar)!r}), Path({str(tree)!r}))\n"
        f"disk.make_data_partition(Path({str(image)!r}), layout=disk.Layout(1, 8), label='t', "
        f"content=Path({str(tree)!r}), mke2fs_conf=Path({str(load_recipe('debian').dir / 'mke2fs.conf')!r}), "
        "inode_fixes=fixes)\n"
    )
    subprocess.run(["unshare", "--user", "--map-user=1234", "--map-group=1234", sys.executable, "-c", script],
                   check=True)  # fmt: skip
    assert not (tree / "dev" / "null").exists(), "device nodes are left out (devtmpfs at boot)"
    expect = {
        "/etc/shadow": ("regular", "0640", "0", "42"),
        "/etc/locked": ("regular", "0000", "0", "0"),
        "/usr/bin/su": ("regular", "04755", "0", "0"),
        "/var/mail": ("directory", "02775", "0", "8"),
        "/proc": ("directory", "0555", "0", "0"),
        "/bin": ("symlink", "0777", "0", "0"),
        "/": ("directory", "0755", "0", "0"),
    }
    for path, want in expect.items():
        got = _debugfs_stat(image, path)
        assert (got["type"], got["mode"], got["uid"], got["gid"]) == want, (path, got)
    su, again = _debugfs_stat(image, "/usr/bin/su"), _debugfs_stat(image, "/usr/bin/su-again")
    assert su["inode"] == again["inode"] and su["links"] == "2", "a hard link stays one inode"



#: how long the captured guest sits in the cache before the recycle: its clock would be this far behind
BEHIND_S = 20.0
#: how far the corrected clock may be from the host's (agent round trip, console, TCG load)
CLOCK_SLACK_S = 5.0


async def _shell(console_sock: Path, command: str) -> tuple[float, str, float]:
    """Host time before, what ``command`` printed on the guest's console shell, host time after."""
    con = await Console.open(console_sock)
    try:
        await con.drain_replay()
        try:
            await con.wake()
        except TimeoutError as e:  # seen once in CI (ttyS0 silent after the capture): say what the guest saw
            pytest.fail(f"{e}\nthe guest, asked over hvc0:\n{await _tty_diagnosis(console_sock.parent / 'hvc0.sock')}")
        before = time.time()
        out = await con.run(command)
        return before, out, time.time()
    finally:
        await con.close()


async def _tty_diagnosis(hvc0_sock: Path) -> str:
    """ttyS0's getty, the processes on it, its line settings and the UART's byte counts (rx: did input
    reach the guest at all?), as the guest's other console sees them."""
    try:
        con = await Console.open(hvc0_sock)
        try:
            await con.wake(30)
            return await con.run("SYSTEMD_COLORS=0 SYSTEMD_URLIFY=0 systemctl status --no-pager -l -n 20 "
                                 "serial-getty@ttyS0; "
                                 "ps -o pid,stat,wchan:24,args -t ttyS0; stty -a -F /dev/ttyS0; "
                                 "cat /proc/tty/driver/serial", 30)
        finally:
            await con.close()
    except (OSError, TimeoutError, EOFError) as e:
        return f"(hvc0 did not answer either: {e})"


async def _marker_diagnosis(ttys0: Console) -> str:
    """The readiness marker's service and both consoles' gettys in the guest's journal, in the order
    they ran (a getty starting on hvc0 hangs it up and flushes it), and hvc0's line settings."""
    try:
        await ttys0.wake(30)
        return await ttys0.run("SYSTEMD_COLORS=0 journalctl -b --no-pager -o short-monotonic -u vmsidecar-ready "
                               "-u serial-getty@hvc0 -u serial-getty@ttyS0; systemctl show -p "
                               "ExecMainStartTimestampMonotonic -p ExecMainExitTimestampMonotonic -p Result "
                               "vmsidecar-ready serial-getty@hvc0; stty -a -F /dev/hvc0", 30)
    except (OSError, TimeoutError, EOFError) as e:
        return f"(ttyS0 did not answer either: {e})"


async def _guest_clock(console_sock: Path) -> tuple[float, float, float, float]:
    """Host time before, the guest's wall clock and uptime, host time after."""
    before, out, after = await _shell(console_sock, "echo CLOCK $(date +%s.%N) $(cut -d' ' -f1 /proc/uptime)")
    m = re.search(r"CLOCK ([0-9.]+) ([0-9.]+)", out)
    assert m, out
    return before, float(m.group(1)), float(m.group(2)), after


async def _agent_waits(console_sock: Path) -> list[str]:
    """Where the guest's qemu-ga sleeps, sampled ten times over ~0.5 s (``/proc/PID/wchan``)."""
    _, out, _ = await _shell(console_sock, "p=$(pidof qemu-ga); for i in 0 1 2 3 4 5 6 7 8 9; do "
                             "echo WCHAN $(cat /proc/$p/wchan); sleep 0.05; done")
    waits = re.findall(r"WCHAN (\S+)", out)
    assert len(waits) == 10, out
    return waits


def _agent_blocks_on_its_port(waits: list[str]) -> None:
    """The runtime holds the agent's socket (backend/guest_agent.py): the agent waits in poll() for a
    command (or for ``hwclock``, a clock set's child), never in the 100 ms sleep it spins on while
    nobody holds the host side (qga/main.c: EOF, usleep, read again)."""
    assert "hrtimer_nanosleep" not in waits and "do_sys_poll" in waits, waits


async def test_debian_guest_boots_to_marker_is_restored_and_switched_to_a_spare_with_its_clock_set_and_powers_off(
    start_runtime: Any, debian_image: BuiltImage
) -> None:
    # The default spec (CPU model included) but for a channel no other test's spec has: a snapshot
    # key of its own, so this boot is cold and captures. One Debian boot serves the boot, the
    # restored clock, a spare restore's clock and the power button (each a TCG boot of ~50 CPU-s
    # on its own).
    spec = {"image": f"file:{debian_image.disk}", "memory": "1G", "channels": [{"name": "clock"}]}
    rt = await start_runtime(spec)
    client = rt.client()
    ttys0 = await Console.open_when_served(rt.shared / "console.sock")
    hvc0 = await Console.open_when_served(rt.shared / "hvc0.sock")
    t0 = time.monotonic()
    marker = asyncio.create_task(ttys0.expect(MARKER, 600))
    ready = asyncio.create_task(client.wait_ready(600))  # fails fast if the runtime gives up
    try:
        await asyncio.gather(marker, ready)
    except Exception as exc:
        marker.cancel()
        ready.cancel()
        pytest.fail(f"no marker: {exc!r}\nruntime log:\n{rt.log_text()[-3000:]}")
    boot_id = marker.result().group(2)
    print(f"\ndebian guest: marker {time.monotonic() - t0:.1f} s after the runtime served")
    first = await client.wait_stored()  # the capture is stored just after Ready
    assert first.snapshot.boot == "cold" and first.snapshot.available, first.snapshot
    # the capture found the agent, and the captured boot going on in its process had its clock set
    assert first.snapshot.clock == "corrected", first.snapshot
    _, _, uptime_at_capture, captured_at = await _guest_clock(rt.shared / "console.sock")
    _agent_blocks_on_its_port(await _agent_waits(rt.shared / "console.sock"))
    try:
        on_hvc0 = await hvc0.expect(MARKER, 60)
    except TimeoutError as e:  # seen once in CI (its login there, no marker): say what the guest saw
        pytest.fail(f"{e}\nthe guest, asked over ttyS0:\n{await _marker_diagnosis(ttys0)}")
    assert on_hvc0.group(2) == boot_id, "the same boot's marker on hvc0"

    # root is logged in on both consoles; the system came up whole
    for con in (ttys0, hvc0):
        await con.wake()
        assert (await con.run("id -un")).strip() == "root"
    assert (await ttys0.run("systemctl is-system-running --wait", 120)).strip() == "running", \
        await ttys0.run("systemctl --failed --no-legend --no-pager")
    assert (await ttys0.run("cat /proc/sys/kernel/random/boot_id")).strip() == boot_id.decode()
    assert "/dev/vda2 ext4" in await ttys0.run("findmnt -n -o SOURCE,FSTYPE /")
    assert (await ttys0.run("cat /etc/vmsidecar-image")).strip() == "debian"
    assert (await ttys0.run("systemctl is-active systemd-logind systemd-networkd dbus")).split() == ["active"] * 3
    address = await ttys0.run("for i in $(seq 30); do ip -4 -o addr show scope global | grep -q . && break; "
                              "sleep 1; done; ip -4 -o addr show scope global")
    assert "inet 10.0.2.15/" in address, address
    await ttys0.close()
    await hvc0.close()

    # restored: the guest resumes at the capture instant; its clock is set to the host's right after
    # Ready, before what a console client types right at Ready reaches it and before a claim's answer
    await asyncio.sleep(max(0.0, captured_at + BEHIND_S - time.time()))  # the snapshot's clock falls behind
    state, seconds = await recycle_until_ready(client)
    assert state.snapshot.boot == "restored" and state.snapshot.clock in ("setting", "corrected"), state.snapshot
    assert seconds < 30, f"restore took {seconds:.1f} s"
    before, guest_now, uptime_now, after = await _guest_clock(rt.shared / "console.sock")
    assert (await client.claim()).snapshot.clock == "corrected"
    assert before - CLOCK_SLACK_S <= guest_now <= after + CLOCK_SLACK_S, (before, guest_now, after)
    # the fix matters: the restored guest lived only seconds since the capture (its uptime is the
    # snapshot's), while the host lived over BEHIND_S; its own clock would be that far behind
    guest_lived, host_lived = uptime_now - uptime_at_capture, after - captured_at
    print(f"guest lived {guest_lived:.1f} s, host {host_lived:.1f} s; recycle -> Ready {seconds:.2f} s; "
          f"guest clock - host clock {guest_now - (before + after) / 2:+.2f} s")
    assert host_lived - guest_lived >= BEHIND_S - CLOCK_SLACK_S, (guest_lived, host_lived)
    _agent_blocks_on_its_port(await _agent_waits(rt.shared / "console.sock"))  # as the snapshot holds it

    # a spare restore (standby: the same snapshot, whose clock is over BEHIND_S behind): made after
    # a Ready, its clock set then, running on until the recycle switches to it, which sets nothing.
    # The next lease's claim serves the spec (as an exporter's config would): a spec a lease PUT
    # would end with it, at the recycle
    await client.claim(token="lease-with-a-spare", spec=load_spec({**spec, "standby": True}))
    await client.wait_ready(120)
    assert (await client.wait_spare(120)).snapshot.standby == "ready"
    state, seconds = await recycle_until_ready(client)
    assert state.snapshot.restored_ahead and state.snapshot.clock == "corrected", state.snapshot
    before, guest_now, _, after = await _guest_clock(rt.shared / "console.sock")
    print(f"spare adopted: recycle -> Ready {seconds:.2f} s; guest clock - host clock "
          f"{guest_now - (before + after) / 2:+.2f} s")
    assert before - CLOCK_SLACK_S <= guest_now <= after + CLOCK_SLACK_S, (before, guest_now, after)
    _agent_blocks_on_its_port(await _agent_waits(rt.shared / "console.sock"))

    # graceful off, the adopted spare: QMP system_powerdown -> ACPI power button -> logind -> poweroff
    async with collecting(client, ["guest.powerdown_requested", "guest.powered_off"]) as events:
        t0 = time.monotonic()
        # typically ~10 s; a CI run with three TCG guests and an image build on two cores took the
        # boot 160 s and the shutdown past 60 s (the runtime then stopped QEMU hard): a generous bound
        state = await client.power("off", graceful=True, timeout=240)
        print(f"debian guest: graceful power off took {time.monotonic() - t0:.1f} s")
        assert state.phase.value == "Stopped"
        await events.wait_for("guest.powered_off", 90)
    kinds = [(e["type"], e["data"].get("reason")) for e in events]
    assert ("guest.powerdown_requested", None) in kinds
    assert ("guest.powered_off", "guest-shutdown") in kinds, kinds
