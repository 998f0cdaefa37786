"""Bad input to the runtime on real QEMU: each gets one clear sentence and loses nothing."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fixtures.faults import wait_phase
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_images.console import Console

pytestmark = pytest.mark.timeout(600)


async def test_unpullable_image_is_error_with_the_cause(start_runtime: Any) -> None:
    rt = await start_runtime({"image": "127.0.0.1:1/vm/nothing:1"})
    state = await wait_phase(rt.client(), "Error", timeout=60)
    assert state.last_error and state.last_error["error"] == "registry_unreachable"
    assert "127.0.0.1:1" in state.last_error["message"]
    assert await rt.client().healthy()


async def test_corrupt_qcow2_is_refused(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.qcow2"
    data = bytearray(tiny_image.disk.read_bytes())
    data[0x30:0x38] = b"\xff" * 8  # l1 table offset far past the end of the file
    bad.write_bytes(bytes(data))
    rt = await start_runtime({"image": f"file:{bad}"})
    state = await wait_phase(rt.client(), "Error", timeout=60)
    assert "is a corrupt qcow2" in state.last_error["message"]
    assert "re-download or rebuild the image" in state.last_error["message"]


async def test_missing_qemu_binary_names_the_package(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # qemu-img (and prlimit, which bounds it) but no QEMU system emulator
    bin_dir.mkdir()
    for tool in ("qemu-img", "prlimit"):
        os.symlink(shutil.which(tool), bin_dir / tool)  # type: ignore[arg-type]
    rt = await start_runtime({"image": f"file:{tiny_image.disk}"}, env={"PATH": str(bin_dir)})
    state = await wait_phase(rt.client(), "Error", timeout=60)
    assert "qemu-system-x86_64 is not installed" in state.last_error["message"]
    assert "apt-get install qemu-system-x86" in state.last_error["message"]


async def test_guest_that_never_prints_the_marker(start_runtime: Any, tiny_image: Any) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "readiness": {"pattern": "NEVER-PRINTED", "timeout": 25}}
    rt = await start_runtime(spec)
    state = await wait_phase(rt.client(), "Error", timeout=120)
    message = state.last_error["message"]
    assert "did not print 'NEVER-PRINTED' on ttyS0 within 25 s" in message
    assert "VMSIDECAR-READY" in message  # the console tail shows what the guest did print
    assert state.console_tail and "VMSIDECAR-READY" in state.console_tail
    async with RuntimeClient(rt.socket) as client:
        assert (await client.power("off", graceful=False)).phase.value == "Stopped"


async def test_bad_flashes_keep_the_old_disk(start_runtime: Any, tiny_image: Any, tmp_path: Path,
                                             tiny_b_image: Any) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})  # the suite's common key
    client = rt.client()
    ready = await client.wait_ready(180)

    # while running, a flash without power_off is refused
    with pytest.raises(VmsidecarError) as exc:
        await client.flash(tiny_b_image.disk)
    assert exc.value.code == "wrong_phase"
    assert "cannot flash the disk while the VM is Ready" in exc.value.message and "power_off=true" in exc.value.message

    await client.power("off")
    garbage = tmp_path / "garbage.img"
    garbage.write_bytes(os.urandom(3 << 20))
    with pytest.raises(VmsidecarError) as exc:
        await client.flash(garbage)
    assert "not a disk image" in exc.value.message

    truncated = tmp_path / "truncated.qcow2"
    truncated.write_bytes(tiny_b_image.disk.read_bytes()[: 1 << 20])
    with pytest.raises(VmsidecarError) as exc:
        await client.flash(truncated)
    assert "the flashed image is a corrupt qcow2" in exc.value.message

    # a qcow2 whose backing file is a host file: QEMU would open /etc/hostname as the guest's disk
    evil = tmp_path / "evil.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/hostname", str(evil)],
                   check=True)
    with pytest.raises(VmsidecarError) as exc:
        await client.flash(evil)
    assert exc.value.code == "unsafe_disk" and "names a backing file (/etc/hostname)" in exc.value.message

    # a client that dies mid-upload: announces the whole image, sends 1 MiB, disconnects
    await asyncio.to_thread(_upload_then_vanish, rt.socket, tiny_b_image.disk.read_bytes()[: 1 << 20],
                            tiny_b_image.disk.stat().st_size)
    await wait_until_async(lambda: "the image stream was cut off after" in rt.log_text(), 5,
                           "the runtime to log the cut-off upload", detail=lambda: rt.log_text()[-2000:])
    assert "the previous disk is kept" in rt.log_text()
    state = await client.state()
    assert state.image_digest == ready.image_digest  # the old disk is untouched
    assert not list((rt.state / "flashed").glob(".incoming-*"))  # no half-written file left

    await client.power("on")
    await client.wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    await con.expect("VMSIDECAR-READY image=tiny ")
    await con.close()


def _upload_then_vanish(api: Path, data: bytes, announced: int) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(api))
        head = (f"PUT /v1/vm/disk HTTP/1.1\r\nHost: vm\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {announced}\r\n\r\n")
        s.sendall(head.encode() + data)


async def test_good_flash_boots_the_new_image(start_runtime: Any, tiny_image: Any, tiny_b_image: Any) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})  # the suite's common key
    client = rt.client()
    ready = await client.wait_ready(180)
    state = await client.flash(tiny_b_image.disk, power_off=True)
    assert state.phase.value == "Stopped" and state.image_digest != ready.image_digest
    await client.power("on")
    await client.wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    await con.expect("VMSIDECAR-READY image=tiny-b ")
    await con.close()
    await client.power("off", graceful=False)
    dumped = rt.state.parent / "dump.qcow2"
    size = await client.dump(dumped)
    assert size > 0 and dumped.read_bytes()[:4] == b"QFI\xfb"
    state = await client.recycle(boot=False)  # back to the spec's image, not the flashed one
    await client.power("on")
    state = await client.wait_ready(180)
    assert state.generation == 1 and state.image_digest == ready.image_digest


def test_a_shared_dir_too_deep_for_its_sockets_is_named_with_the_fix(tmp_path: Path) -> None:
    # a unix socket's path holds at most 107 bytes: the runtime says so before it binds anything,
    # rather than dying mid-start with "AF_UNIX path too long" (QEMU's own sockets are in a short
    # private run dir; the state and cache dirs hold no socket)
    deep = tmp_path / ("d" * 40) / ("e" * 20)
    argv = [shutil.which("vmsidecar-runtime") or "vmsidecar-runtime", "serve", "--shared-dir", str(deep),
            "--cache-dir", str(tmp_path / "cache"), "--state-dir", str(tmp_path / "state"),
            "--image", "file:/nonexistent.qcow2"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    message = result.stderr.strip()
    assert message.startswith("error: ") and "Traceback" not in message, message
    assert str(deep) in message and "108" in message and "--shared-dir" in message, message


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_log_level_in_lower_case_is_taken_and_an_unknown_level_or_format_is_named(tmp_path: Path, how: str) -> None:
    """``--log-level debug`` (the case the JSON log prints) was handed to ``logging`` as it was and
    ended the start with a traceback ("Unknown level: 'debug'"); an unknown level did the same."""
    runtime = shutil.which("vmsidecar-runtime") or "vmsidecar-runtime"
    base = [runtime, "serve", "--cache-dir", str(tmp_path / "cache"), "--state-dir", str(tmp_path / "state"),
            "--shared-dir", str(tmp_path / "shared"), "--cache-budget", "lots"]

    def serve(level: str) -> subprocess.CompletedProcess[str]:
        argv, env = ([*base, "--log-level", level], None) if how == "flag" else (
            base, {**os.environ, "VMSIDECAR_LOG_LEVEL": level})
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)

    taken = serve("debug")  # gets past the logging set-up to the cache budget, checked next
    assert taken.returncode == 2 and "Traceback" not in taken.stderr, taken.stderr[-2000:]
    assert "'lots' is not a size" in taken.stderr and "log level" not in taken.stderr, taken.stderr[-2000:]
    refused = serve("chatty")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "'chatty' is not a log level" in refused.stderr and "debug" in refused.stderr, refused.stderr
    # the format too: VMSIDECAR_LOG_FORMAT=xml was taken as text, as a default is not held to the choices
    argv, env = ([*base, "--log-format", "xml"], None) if how == "flag" else (
        base, {**os.environ, "VMSIDECAR_LOG_FORMAT": "xml"})
    xml = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert xml.returncode == 2 and "'xml' is not a log format (text or json" in xml.stderr, xml.stderr[-2000:]


def test_a_grace_that_is_no_time_is_named_and_zero_is_taken(tmp_path: Path) -> None:
    """``--grace -5`` was taken, and SIGTERM then logged "guest did not stop within -5 s; killed";
    ``nan`` and ``inf`` were taken too (a stop that never gives up). 0 pulls the plug at once."""
    runtime = shutil.which("vmsidecar-runtime") or "vmsidecar-runtime"
    base = [runtime, "serve", "--cache-dir", str(tmp_path / "cache"), "--state-dir", str(tmp_path / "state"),
            "--shared-dir", str(tmp_path / "shared"), "--cache-budget", "lots"]  # the next check after the flags
    for bad in ("-5", "nan", "inf", "soon"):
        result = subprocess.run([*base, "--grace", bad], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert f"--grace: {bad!r} is not a number of seconds" in result.stderr, result.stderr
    zero = subprocess.run([*base, "--grace", "0"], capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "'lots' is not a size" in zero.stderr and "--grace" not in zero.stderr, zero.stderr


@pytest.mark.parametrize("owner", ["-1", "65532:-1", "4294967295", "99999999999999999999", "nobody"])
def test_a_socket_owner_that_is_no_user_is_named(tmp_path: Path, owner: str) -> None:
    """``VMSIDECAR_SOCKET_OWNER=-1`` was taken: chown's "leave it as it is", so the sockets stayed
    root's and the exporter's user could not connect, with nothing said."""
    argv = [shutil.which("vmsidecar-runtime") or "vmsidecar-runtime", "serve", "--cache-dir", str(tmp_path / "cache"),
            "--state-dir", str(tmp_path / "state"), "--shared-dir", str(tmp_path / "shared")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "VMSIDECAR_SOCKET_OWNER": owner})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"VMSIDECAR_SOCKET_OWNER={owner!r} is not UID or UID:GID" in result.stderr, result.stderr


def _host_memory_mib() -> int:
    """RAM and swap of this host, in MiB (``/proc/meminfo``)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) for name in ("MemTotal", "SwapTotal")) >> 10


async def test_a_guest_memory_the_host_cannot_give_names_the_spec_and_the_fix(start_runtime: Any, tiny_image: Any) -> None:
    """Twice the host's RAM and swap, in a boot that captures nothing (its RAM is QEMU's own
    anonymous memory; a capturing boot's is a memfd, which the kernel lets a guest overcommit):
    under the kernel's default overcommit heuristic (mode 0, as Debian ships) QEMU's allocation fails
    as it starts. The message says it was the spec's memory, how much, and what to change, not only
    QEMU's "Cannot allocate memory"."""
    assert Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "1", (
        "vm.overcommit_memory=1 lets any allocation through: this test needs the default (0) or 2")
    memory = min(2 * _host_memory_mib(), 1 << 20)
    assert memory > _host_memory_mib(), "the host has 1 TiB or more: no spec memory is too much for it"
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": memory, "snapshot": "off"})
    state = await wait_phase(rt.client(), "Error", timeout=60)
    message = state.last_error["message"]
    assert f"could not allocate the guest's {memory} MiB of RAM" in message, message
    assert "lower the spec's memory" in message and "Cannot allocate memory" in message, message
    assert await rt.client().healthy()


@pytest.mark.parametrize(("field", "value", "words"), [
    ("machine", "pc-q99", "-machine help"),
    ("cpu", "Pentium-Z9", "-cpu help"),
])
async def test_a_machine_or_cpu_model_qemu_does_not_have_names_the_spec_field(
    start_runtime: Any, tiny_image: Any, field: str, value: str, words: str
) -> None:
    """Valid names (the spec checks their form) that this QEMU has no such thing of: the Error names
    the spec's field and value and where the list of real ones is, besides QEMU's own words."""
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", field: value, "snapshot": "off"})
    state = await wait_phase(rt.client(), "Error", timeout=60)
    message = state.last_error["message"]
    assert f"the spec's {field} '{value}' is not one this QEMU has" in message, message
    assert f"qemu-system-x86_64 {words}" in message and f"leave {field} out" in message, message


async def test_the_client_commands_name_a_local_file_they_cannot_use_and_leave_nothing(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    """``flash`` of a directory, ``dump`` into a directory or a directory that does not exist, and
    ``console`` with a file or /dev/null as its input (which epoll cannot watch) each ended in a
    traceback; ``dump`` into a directory had already written the whole disk beside it (``DIR.part``)."""
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})  # the suite's common key
    folder = tmp_path / "folder"
    folder.mkdir()

    def cli(*args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["vmsidecar-runtime", args[0], "--socket", str(rt.socket), *args[1:]], stdin=stdin,
                              capture_output=True, text=True, timeout=60)

    for args, words in (
        (("flash", str(folder)), f"cannot read {folder}: it is a directory; name a disk image file"),
        (("flash", str(tmp_path / "nothing.qcow2")), f"cannot read {tmp_path / 'nothing.qcow2'}: No such file"),
        (("dump", str(folder)), f"cannot write the disk to {folder}: it is a directory; name a file"),
        (("dump", str(tmp_path / "no" / "d.qcow2")), f"cannot write the disk to {tmp_path / 'no' / 'd.qcow2'}: "
                                                      f"{tmp_path / 'no'} does not exist"),
    ):
        result = cli(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
        assert words in result.stderr, (args, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "rt"]  # no .part of a dump beside them


    await rt.client().wait_ready(300)  # (its console socket is there once a guest runs)
    log = tmp_path / "input.txt"
    log.write_text("echo hi\n")
    with log.open("rb") as from_file:
        for stdin in (subprocess.DEVNULL, from_file):
            result = cli("console", stdin=stdin)
            assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("flag", ["--shared-dir", "--cache-dir", "--state-dir"])
def test_a_file_where_a_directory_goes_is_named_as_a_file(tmp_path: Path, flag: str) -> None:
    """It said "cannot be created (File exists) …; make it writable by this user (chown …)": neither
    is the cause nor the fix."""
    runtime = shutil.which("vmsidecar-runtime") or "vmsidecar-runtime"
    dirs = {name: str(tmp_path / name.strip("-")) for name in ("--shared-dir", "--cache-dir", "--state-dir")}
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    dirs[flag] = str(a_file)
    result = subprocess.run([runtime, "serve", *(x for pair in dirs.items() for x in pair)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{a_file} is a file, not a directory; remove it or pass another {flag}" in result.stderr, result.stderr
    assert a_file.read_text() == "not a directory\n"
