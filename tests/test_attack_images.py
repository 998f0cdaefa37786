"""Hostile disk images and documents (issue 19, items 1, 8 and 11b), carried out for real.

The lease holder and image publishers are the attackers. Each test sends what they could send
(through the real runtime API, a real registry, real qemu-img images) and checks that it is
refused with a message naming the cause and the fix, and that the previous disk is kept.

* A disk declared raw that is really qcow2/vmdk/… with a backing or extent file: flashed and
  dumped, it handed a host file back (qemu-img probed its format).
* Every qemu-img and QEMU invocation names its format (no probing anywhere).
* The disk size limit is a runtime setting (64 GiB by default); zstd windows and xz
  dictionaries are capped, so a few bytes cannot make the runtime allocate gigabytes.
* Manifests, indexes and configs nested 100000 deep are a ``bad_manifest``, never a 500.
* A qcow2 built to make qemu-img take a gigabyte, print gigabytes or run for ever is refused,
  and qemu-img itself runs bounded (security.md, row 26).

No guest is booted except in the argv test (the tiny guest, only until QEMU runs).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from fixtures.attack import memory_kib
from fixtures.registry import Crafter, RunningRegistry
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import ImageError, VmsidecarError
from vmsidecar_runtime.image.checks import check_image
from vmsidecar_runtime.image.limits import Origin
from vmsidecar_runtime.image.sniff import SNIFF_BYTES, decide_format, sniff_probed_format
from vmsidecar_runtime.oci.pack import inspect_disk

pytestmark = pytest.mark.timeout(240)

TITLE = "org.opencontainers.image.title"
SECRET = b"HOST-SECRET-3f9c1e: the lease holder must never read this\n"


def _qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True)


def vmdk_descriptor(extent: Path, *, mbr_signature: bool = False) -> bytes:
    """A VMDK text descriptor whose one extent is the host file ``extent`` (qemu-img probes it as
    vmdk); with ``mbr_signature`` it also carries the MBR boot signature, so it sniffs as raw."""
    text = (
        '# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType="monolithicFlat"\n\n'
        f'RW 1 FLAT "{extent}" 0\n\nddb.adapterType = "ide"\n'
    ).encode()
    return text.ljust(510, b"\n") + b"\x55\xaa" if mbr_signature else text


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A host file the runtime can read and the lease holder must not: one 512-byte sector."""
    path = tmp_path / "host-secret"
    path.write_bytes(SECRET.ljust(512, b"\0"))
    return path


@pytest.fixture
def disguised(tmp_path: Path, secret: Path) -> dict[str, bytes]:
    """Disks that read ``secret`` when their format is probed, made by qemu-img where it can."""
    d = tmp_path / "disguised"
    d.mkdir()
    backing, json_backing = d / "backing.qcow2", d / "json-backing.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", "-b", str(secret), "-F", "raw", str(backing))
    spec = json.dumps({"driver": "raw", "file": {"driver": "file", "filename": str(secret)}})
    _qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", f"json:{spec}", "-F", "raw", str(json_backing), "512")
    return {
        "qcow2_backing": backing.read_bytes(),
        "qcow2_json_backing": json_backing.read_bytes(),
        "vmdk": vmdk_descriptor(secret),
        "vmdk_mbr": vmdk_descriptor(secret, mbr_signature=True),
    }


async def _runtime_with_a_flashed_disk(start_runtime: Any, disk: Path, **kw: Any) -> tuple[Any, Any, str]:
    rt = await start_runtime({}, **kw)
    client = rt.client()
    state = await client.flash(disk, power_off=True)
    assert state.image_digest and state.phase.value == "Stopped"
    return rt, client, state.image_digest


# ---- item 1: a disk declared raw is raw, whatever it looks like -------------------------------------


async def test_a_disk_declared_raw_cannot_hand_a_host_file_to_dump(
    start_runtime: Any, registry: RunningRegistry, oci_qcow2: Path, disguised: dict[str, bytes], tmp_path: Path
) -> None:
    """The attack: publish (or upload) a qcow2/vmdk that names a host file, declared or sniffed raw;
    flash it; dump the disk. Before the fix the dump held the host file's bytes."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    rt, client, digest = await _runtime_with_a_flashed_disk(
        start_runtime, oci_qcow2, extra_args=["--allow-host-paths", str(allowed)]
    )
    kept = sorted(p.name for p in (rt.state / "flashed").iterdir())

    artifact = Crafter(registry=registry, repo="attack/raw-artifact")
    layer = artifact.blob(disguised["qcow2_backing"], "application/vnd.diskimage.raw", {TITLE: "disk.raw"})
    container = Crafter(registry=registry, repo="attack/containerdisk")
    (tmp_path / "x.raw").write_bytes(disguised["qcow2_json_backing"])
    with io.BytesIO() as buf:
        with tarfile.open(fileobj=buf, mode="w") as archive:
            archive.add(tmp_path / "x.raw", arcname="disk/x.raw")
        tar = buf.getvalue()
    config = container.image_config("amd64", [Crafter.digest(tar)])
    layout = Crafter(layout=allowed / "layout")
    img = layout.blob(disguised["vmdk"], "application/octet-stream", {TITLE: "disk.img"})
    (allowed / "disk.raw").write_bytes(disguised["qcow2_backing"])
    (allowed / "upload.img").write_bytes(disguised["vmdk_mbr"])

    attacks: dict[str, Callable[[], Awaitable[Any]]] = {
        "registry artifact declared raw (qcow2, backing file)": lambda: client.flash_reference(
            artifact.tag(artifact.manifest([layer], artifact_type="application/vnd.diskimage.raw"), "1"),
            power_off=True),
        "containerDisk /disk/x.raw (qcow2, json: backing)": lambda: client.flash_reference(
            container.tag(container.manifest(
                [container.blob(tar, "application/vnd.oci.image.layer.v1.tar")], config=config), "1"),
            power_off=True),
        "OCI layout disk.img (vmdk descriptor, guessed raw)": lambda: client.flash_reference(
            layout.tag(layout.manifest([img]), "1"), power_off=True),
        "file:disk.raw (qcow2, backing file)": lambda: client.flash_reference(
            f"file:{allowed / 'disk.raw'}", power_off=True),
        "upload (vmdk descriptor with an MBR signature, sniffed raw)": lambda: client.flash(
            allowed / "upload.img", power_off=True),
    }
    leaks, refusals = [], {}
    for name, attack in attacks.items():
        try:
            await attack()
        except VmsidecarError as exc:
            refusals[name] = exc
            continue
        dumped = tmp_path / "dump.raw"
        await client.dump(dumped, fmt="raw")
        leaked = SECRET in dumped.read_bytes()
        leaks.append(f"{name}: flashed; the dump {'HOLDS the host file: ' + repr(SECRET) if leaked else 'is clean'}")
    assert not leaks, "disguised disks were flashed:\n" + "\n".join(leaks)
    for name, exc in refusals.items():
        assert (exc.code, exc.http_status) == ("unsafe_disk", 422), (name, exc.code, exc.message)
        assert " raw" in exc.message and "but starts with the " in exc.message, (name, exc.message)
        assert "would open it as" in exc.message and "-O qcow2 IN OUT` and " in exc.message, (name, exc.message)
    state = await client.state()
    assert state.image_digest == digest and state.phase.value == "Stopped"
    assert sorted(p.name for p in (rt.state / "flashed").iterdir()) == kept  # the previous disk, no temp file
    dumped = tmp_path / "after.raw"
    await client.dump(dumped, fmt="raw")
    assert SECRET not in dumped.read_bytes()


def _probed_by_qemu_img(path: Path) -> str:
    """The format qemu-img's own probing gives a file (the oracle for :func:`sniff_probed_format`)."""
    out = subprocess.run(["qemu-img", "info", "--output=json", str(path)], capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)["format"])


def test_every_format_qemu_img_probes_is_refused_as_raw(tmp_path: Path, secret: Path) -> None:
    """Whatever qemu-img itself would probe as non-raw is refused when declared, guessed or sniffed raw;
    what it probes as raw is accepted. The samples are made by qemu-img where it can make them."""

    made: dict[str, Path] = {}
    creatable = {
        "qcow": [], "qcow2": [], "qed": [], "vdi": [], "vhdx": [], "vpc": [], "parallels": [],
        "vmdk": [], "vmdk-stream": ["-o", "subformat=streamOptimized"],
        "vmdk-flat": ["-o", "subformat=monolithicFlat"],  # a text descriptor + an extent file
        "vpc-fixed": ["-o", "subformat=fixed"],  # footer at the end only: QEMU probes it as raw
    }
    for name, opts in creatable.items():
        made[name] = tmp_path / f"sample.{name}"
        _qemu_img("create", "-q", "-f", name.split("-")[0], *opts, str(made[name]), "1M")
    for name, data in {
        "vmdk-descriptor": vmdk_descriptor(secret),
        "vmdk-descriptor-commented": b"# a\n   \n#b\r\n" + vmdk_descriptor(secret).replace(b"\n", b"\r\n"),
        "mbr": b"\x33\xc0" + b"\0" * 508 + b"\x55\xaa" + b"\0" * 4096,
        "text": b"version=1 is not a vmdk line\n" * 100,
    }.items():
        made[name] = tmp_path / f"sample.{name}"
        made[name].write_bytes(data)
    origin = Origin("the image", "flash the result")
    seen = set()
    for name, path in made.items():
        probed = _probed_by_qemu_img(path)
        head = path.read_bytes()[:SNIFF_BYTES]
        assert sniff_probed_format(head) == (None if probed == "raw" else probed), name
        if probed == "raw":
            assert decide_format(head, "raw", origin) == "raw", name
            continue
        seen.add(probed)
        with pytest.raises(ImageError, match=f"declared raw but starts with the {probed} signature"):
            check_image(path, "raw", origin)  # a raw cache entry kept from before the check, re-checked at use
        for declared in ("raw", None):
            if declared is None and probed in ("qcow", "qcow2"):
                continue  # the qcow2 magic undeclared is qcow2, checked as such (qcow's version 1 is refused)
            with pytest.raises(ImageError) as exc:
                decide_format(head, declared, origin, guess_raw=True)
            assert exc.value.code == "unsafe_disk", name
            assert f"starts with the {probed} signature" in exc.value.message, name
            assert f"qemu-img convert -f {probed} -O qcow2 IN OUT` and flash the result" in exc.value.message
    assert seen == {"qcow", "qcow2", "qed", "vdi", "vhdx", "vpc", "parallels", "vmdk"}
    with pytest.raises(ImageError, match=r"taken as raw .* starts with the vmdk signature"):
        inspect_disk(made["vmdk-stream"])  # push refuses what pull would refuse
    # formats qemu-img cannot create here (luks needs a CPU-time clock this container lacks): their signatures
    for fmt, head in {"bochs": b"Bochs Virtual HD Image\0", "cloop": b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop "
                      b"file=$IMAGE\n", "luks": b"LUKS\xba\xbe\0\1"}.items():
        with pytest.raises(ImageError, match=f"starts with the {fmt} signature"):
            decide_format(head.ljust(SNIFF_BYTES, b"\0"), "raw", origin)


# ---- item 1: every qemu-img and QEMU invocation names its format ------------------------------------

#: qemu-img subcommands that open an image, and the options naming its format
_QEMU_IMG_INPUT = {"info", "check", "convert", "compare", "map", "measure", "rebase", "resize", "snapshot",
                   "amend", "commit", "bitmap", "dd"}


def _logging_wrapper(bin_dir: Path, log: Path, program: str) -> None:
    """``bin_dir/program``: appends its argv (fields split by 0x1f) to ``log``, then runs the real one."""
    real = shutil.which(program)
    assert real, f"{program} is not installed"
    script = bin_dir / program
    script.write_text(f"#!/bin/sh\nprintf '%s\\037' \"$0\" \"$@\" >> '{log}'\necho >> '{log}'\nexec '{real}' \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def format_problems(argv: list[str]) -> list[str]:
    """Why ``argv`` (qemu-img or qemu-system) would let QEMU probe an image's format; empty if it cannot."""
    program, args = os.path.basename(argv[0]), argv[1:]
    if program == "qemu-img":
        sub, problems = args[0], []
        if sub in _QEMU_IMG_INPUT and "-f" not in args and "--image-opts" not in args:
            problems.append(f"qemu-img {sub} without -f")
        if sub == "convert" and "-O" not in args:
            problems.append("qemu-img convert without -O")
        if sub == "create" and "-b" in args and "-F" not in args:
            problems.append("qemu-img create -b without -F (the backing file's format)")
        return problems
    problems = [f"{flag} (probes the format)" for flag in args if flag in ("-hda", "-hdb", "-cdrom", "-sd", "-pflash")]
    values = {flag: [v for f, v in itertools.pairwise(args) if f == flag] for flag in ("-drive", "-blockdev")}
    problems += [f"-drive {v} without format=" for v in values["-drive"] if "format=" not in v]
    formats = [v for v in values["-blockdev"] if "driver=file," not in v]
    problems += [f"-blockdev {v}: not a raw or qcow2 node" for v in formats if not v.startswith(("driver=qcow2,",
                                                                                               "driver=raw,"))]
    for protocol in (v for v in values["-blockdev"] if "driver=file," in v):
        node = protocol.split("node-name=")[1].split(",")[0]
        if not any(f",file={node}," in f"{v}," for v in formats):
            problems.append(f"-blockdev {protocol}: no format node over it")
    return problems


def test_the_format_check_catches_probing_argv() -> None:
    """The checker the next test relies on flags each way of leaving the format out."""
    assert format_problems(["qemu-img", "convert", "-O", "raw", "a", "b"]) == ["qemu-img convert without -f"]
    assert format_problems(["qemu-img", "create", "-f", "qcow2", "-b", "a", "o"])
    assert format_problems(["qemu-img", "info", "--output=json", "a"])
    assert format_problems(["/usr/bin/qemu-system-x86_64", "-drive", "file=a,if=virtio"])
    assert format_problems(["qemu-system-x86_64", "-blockdev", "driver=file,filename=a,node-name=n"])
    assert format_problems(["qemu-system-x86_64", "-hda", "a"])
    assert not format_problems(["qemu-system-x86_64", "-blockdev", "driver=file,filename=a,node-name=n",
                                "-blockdev", "driver=raw,file=n,node-name=d"])


@pytest.mark.parametrize("disk_format", ["qcow2", "raw"])
def test_every_argv_the_builders_make_names_the_format(disk_format: str) -> None:
    """The builders themselves, for what the boot above does not use: UEFI firmware (pflash), a kernel,
    a raw disk; and libvirt's domain XML names the driver type of every disk."""
    import xml.etree.ElementTree as ET

    from vmsidecar_contract.spec import load_spec
    from vmsidecar_runtime.backend.libvirt.xml import render_domain
    from vmsidecar_runtime.backend.qemu_argv import build_argv
    from vmsidecar_runtime.plan import BootPlan, Firmware

    spec = load_spec({"image": "file:/x", "kernel": "/k", "initrd": "/i", "channels": [{"name": "a"}]})
    plan = BootPlan(spec, "tcg", Path(f"/s/disk.{disk_format}"), disk_format, Path("/r"), {},
                    Firmware(Path("/fw/CODE.fd"), Path("/s/VARS.fd")))
    argv = build_argv(plan)
    assert argv.count("-drive") == 2 and argv.count("-blockdev") == 2
    assert format_problems(argv) == []
    root = ET.fromstring(render_domain(plan, "vmsidecar-t", emulator="/usr/bin/qemu-system-x86_64"))
    disks = root.findall("devices/disk")
    assert disks and all(d.find("driver") is not None and d.find("driver").get("type") == disk_format  # type: ignore[union-attr]
                         for d in disks)


async def test_every_qemu_img_and_qemu_invocation_names_the_format(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    """A real runtime pulls, boots (overlay, QEMU), dumps both ways, flashes raw and dumps again, with
    qemu-img and qemu-system-x86_64 wrapped to record their argv: none may leave the format to probing."""
    bin_dir, log = tmp_path / "bin", tmp_path / "argv.log"
    bin_dir.mkdir()
    for program in ("qemu-img", "qemu-system-x86_64"):
        _logging_wrapper(bin_dir, log, program)
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"}
    # a cache of its own: in the session's, the image passed its checks already and is not checked again
    # (unconfined: the wrappers write their log in the test's directory, which the domains refuse)
    rt = await start_runtime(spec, env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "VMSIDECAR_QEMU_CONFINEMENT": "off"},
                             cache=tmp_path / "cache")
    client = rt.client()

    async def qemu_started() -> bool:  # not Ready: the guest's boot is not what is checked
        return "qemu-system" in (log.read_text() if log.exists() else "") or (await client.state()).phase.value == "Error"

    await wait_until_async(qemu_started, 60, "QEMU to start", interval=0.1, detail=lambda: rt.log_text()[-2000:])
    await client.power("off", graceful=False)
    await client.dump(tmp_path / "d.qcow2", fmt="qcow2")  # from the overlay
    raw = tmp_path / "disk.raw"
    raw.write_bytes(b"\0" * 510 + b"\x55\xaa" + bytes(1 << 20))
    await client.flash(raw, power_off=True)
    await client.dump(tmp_path / "d.raw", fmt="raw")  # from the flashed raw base, no overlay yet
    calls = [line.rstrip("\x1f").split("\x1f") for line in log.read_text().splitlines() if line]
    programs = {os.path.basename(c[0]) for c in calls}
    subcommands = {c[1] for c in calls if os.path.basename(c[0]) == "qemu-img"}
    assert programs == {"qemu-img", "qemu-system-x86_64"}, programs
    assert {"info", "check", "create", "convert"} <= subcommands, subcommands
    problems = [f"{' '.join(c)}: {p}" for c in calls for p in format_problems(c)]
    assert not problems, "\n".join(problems)


# ---- item 8: the disk size limit is a runtime setting, 64 GiB by default ------------------------------

SETTING = "--max-disk-size (VMSIDECAR_MAX_DISK_SIZE)"


async def test_a_1_tib_sparse_flash_is_refused_by_the_default_limit(
    start_runtime: Any, oci_qcow2: Path, tmp_path: Path
) -> None:
    """A qcow2 of 1 TiB virtual size is ~300 KiB: its guest could fill the host volume through the overlay."""
    rt, client, digest = await _runtime_with_a_flashed_disk(start_runtime, oci_qcow2)
    huge = tmp_path / "huge.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", str(huge), "1T")
    assert huge.stat().st_size < 1 << 20
    with pytest.raises(VmsidecarError) as exc:
        await client.flash(huge, power_off=True)
    assert (exc.value.code, exc.value.http_status) == ("disk_too_large", 422), exc.value.message
    assert "has a virtual size of 1 TiB, more than the 64 GiB limit" in exc.value.message
    assert SETTING in exc.value.message and "build a smaller disk" in exc.value.message
    assert (await client.state()).image_digest == digest
    assert [p.name for p in (rt.state / "flashed").iterdir() if p.name.startswith(".incoming")] == []


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_the_disk_size_limit_is_the_runtimes_setting(
    start_runtime: Any, oci_qcow2: Path, tmp_path: Path, how: str
) -> None:
    """``--max-disk-size 4M`` (or the env var) refuses a 16 MiB qcow2 by its virtual size and a raw
    stream past 4 MiB by its bytes, naming the setting; a 1 MiB raw disk still flashes."""
    kw: dict[str, Any] = {"extra_args": ["--max-disk-size", "4M"]} if how == "flag" else {
        "env": {"VMSIDECAR_MAX_DISK_SIZE": "4MiB"}}
    rt = await start_runtime({}, **kw)
    client = rt.client()
    small, large = tmp_path / "small.raw", tmp_path / "large.raw"
    small.write_bytes(b"\0" * 510 + b"\x55\xaa" + bytes(1 << 20))
    large.write_bytes(b"\0" * 510 + b"\x55\xaa" + bytes(5 << 20))
    digest = (await client.flash(small, power_off=True)).image_digest
    for disk, needle in ((oci_qcow2, "has a virtual size of 16 MiB, more than the 4 MiB limit"),
                         (large, "is larger than 4 MiB, the limit")):
        with pytest.raises(VmsidecarError) as exc:
            await client.flash(disk, power_off=True)
        assert exc.value.code == "disk_too_large", exc.value.message
        assert needle in exc.value.message and SETTING in exc.value.message, exc.value.message
    assert (await client.state()).image_digest == digest


def test_a_bad_disk_size_setting_stops_the_runtime_at_start(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "vmsidecar_runtime.cli", "serve", "--shared-dir",
            str(tmp_path / "s"), "--state-dir", str(tmp_path / "st"), "--cache-dir", str(tmp_path / "c")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMSIDECAR_")}
    for extra, extra_env, needle in (
        (["--max-disk-size", "lots"], {}, "--max-disk-size 'lots' is not a size"),
        ([], {"VMSIDECAR_MAX_DISK_SIZE": "0"}, "VMSIDECAR_MAX_DISK_SIZE '0' is not a size"),
    ):
        result = subprocess.run([*base, *extra], env={**env, **extra_env}, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and "64G" in result.stderr and "Traceback" not in result.stderr


# ---- item 8: a few bytes cannot make the decoder allocate gigabytes --------------------------------


def memory_hungry_streams(disk: bytes) -> dict[str, bytes]:
    """``disk`` as a zstd frame with a 2 GiB window (``zstd --long=31``) and as an xz stream whose
    LZMA2 dictionary is 1.5 GiB (what ``xz --lzma2=dict=1536MiB`` writes; the decoder allocates it
    whatever the input's size, and xz itself would shrink it for a small input, so the one header
    byte is set here and its CRC32 recomputed)."""
    import lzma
    import struct
    import zlib

    import zstandard

    params = zstandard.ZstdCompressionParameters(window_log=31, enable_ldm=True)
    zobj = zstandard.ZstdCompressor(compression_params=params).compressobj()  # no content size: the window counts
    zst = zobj.compress(disk) + zobj.flush()
    assert zstandard.get_frame_parameters(zst).window_size == 2 << 30
    xz = bytearray(lzma.compress(disk, format=lzma.FORMAT_XZ, filters=[{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 20}]))
    assert xz[12:17] == b"\x02\x00\x21\x01\x10"  # block header: 12 bytes, one filter, LZMA2, dict 1 MiB
    xz[16] = 37  # dict = 3 << (37 // 2 + 11) = 1.5 GiB
    struct.pack_into("<I", xz, 20, zlib.crc32(bytes(xz[12:20])))
    return {"zstd": zst, "xz": bytes(xz)}


async def test_zstd_windows_and_xz_dictionaries_are_capped(start_runtime: Any, oci_qcow2: Path, tmp_path: Path) -> None:
    """Flashed through the real API: refused at once, naming the memory asked for, the runtime's RSS small."""
    import time

    rt, client, digest = await _runtime_with_a_flashed_disk(start_runtime, oci_qcow2)
    disk = b"\0" * 510 + b"\x55\xaa" + bytes(1 << 20)
    for name, data in memory_hungry_streams(disk).items():
        path = tmp_path / f"disk.raw.{name}"
        path.write_bytes(data)
        started = time.monotonic()
        with pytest.raises(VmsidecarError) as exc:
            await client.flash(path, power_off=True)
        took = time.monotonic() - started
        assert (exc.value.code, exc.value.http_status) == ("unsupported_compression", 422), (name, exc.value.message)
        asked = "a zstd window of 2 GiB" if name == "zstd" else "more than 256 MiB of memory"
        assert f"is {name} data whose decoder would need {asked}" in exc.value.message, exc.value.message
        assert "compress the disk again with default settings" in exc.value.message
        assert took < 10, (name, took)
    assert memory_kib(rt.proc.pid)["VmHWM"] < 400 << 10  # KiB: the decoders allocated nothing big
    assert (await client.state()).image_digest == digest


def test_the_decoders_still_read_default_streams_and_concatenations() -> None:
    """The caps refuse only what needs the memory: default zstd/xz, several xz streams with padding."""
    import lzma

    from vmsidecar_runtime.image.decompress import open_decompressed

    disk = b"\0" * 510 + b"\x55\xaa" + os.urandom(1 << 16)
    xz = lzma.compress(disk[:1000], preset=9) + b"\0" * 8 + lzma.compress(disk[1000:])
    _, stream = open_decompressed(io.BytesIO(xz), "auto", Origin("the image", "flash it"))
    assert stream.read() == disk
    with pytest.raises(ImageError, match="could not be decompressed") as exc:
        open_decompressed(io.BytesIO(xz[:-30]), "auto", Origin("the image", "flash it"))[1].read()
    assert exc.value.code == "bad_compression"


# ---- item 11b: documents nested 100000 deep ----------------------------------------------------------

DEPTH = 100_000


def _deep(depth: int = DEPTH) -> str:
    return "[" * depth + "]" * depth


async def test_manifests_indexes_and_configs_nested_deep_are_bad_manifests(
    start_runtime: Any, registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    """A registry and an OCI layout serving ``{"a":[[[[…]]]]}`` 100000 deep as the manifest, the index, the
    image config and the layout's index.json: each pull is a 422 ``bad_manifest``, never a 500."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    rt, client, digest = await _runtime_with_a_flashed_disk(
        start_runtime, oci_qcow2, extra_args=["--allow-host-paths", str(allowed)]
    )
    deep = _deep()
    manifest_type, index_type = "application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json"
    refs: dict[str, str] = {}
    for where, crafter in (("registry", Crafter(registry=registry, repo="attack/deep")),
                           ("layout", Crafter(layout=allowed / "deep"))):
        layer = crafter.blob(oci_qcow2.read_bytes(), "application/vnd.diskimage.qcow2", {TITLE: "d.qcow2"})
        config = crafter.blob(f'{{"architecture":"amd64","os":"linux","a":{deep}}}'.encode(),
                              "application/vnd.oci.image.config.v1+json")
        refs[f"{where}: image config"] = crafter.tag(crafter.manifest([layer], config=config), "config")
        if where == "layout":  # the registry's manifests follow, less deep
            for name, media_type in (("manifest", manifest_type), ("index", index_type)):
                doc = f'{{"schemaVersion":2,"mediaType":"{media_type}","a":{deep}}}'.encode()
                refs[f"layout: {name}"] = crafter.tag(crafter.blob(doc, media_type), name)
    index_json = allowed / "deep-index-json"
    Crafter(layout=index_json)
    (index_json / "index.json").write_text(f'{{"schemaVersion":2,"manifests":[],"a":{deep}}}')
    refs["layout: index.json"] = f"oci-layout:{index_json}:x"
    # distribution refuses to store a manifest nested past Go's encoding/json limit (10000); just under it
    # is ten times what Python's parser survives
    registry_crafter = Crafter(registry=registry, repo="attack/deep")
    near = _deep(9_990)
    layer = registry_crafter.blob(oci_qcow2.read_bytes(), "application/vnd.diskimage.qcow2", {TITLE: "d.qcow2"})
    manifest = json.dumps({"schemaVersion": 2, "mediaType": manifest_type, "config": registry_crafter.blob(
        b"{}", "application/vnd.oci.empty.v1+json"), "layers": [layer]})
    index = json.dumps({"schemaVersion": 2, "mediaType": index_type, "manifests": []})
    for name, doc, media_type in (("manifest", manifest, manifest_type), ("index", index, index_type)):
        assert registry_crafter.client is not None
        registry_crafter.client.put_manifest(name, f'{doc[:-1]},"a":{near}}}'.encode(), media_type)
        refs[f"registry: {name} (9990 deep)"] = f"{registry.host}/attack/deep:{name}"
    failures = []
    for name, ref in refs.items():
        try:
            await client.flash_reference(ref, power_off=True)
            failures.append(f"{name}: flashed")
        except VmsidecarError as exc:
            if (exc.code, exc.http_status) != ("bad_manifest", 422) or "nested more than" not in exc.message:
                failures.append(f"{name}: {exc.http_status} {exc.code}: {exc.message[:300]}")
    assert not failures, "\n".join(failures)
    assert (await client.state()).image_digest == digest
    assert "Traceback" not in rt.log_text() and "RecursionError" not in rt.log_text()


#: what a containerDisk layer's tar header may claim for a GNU long name that tarfile would read whole
#: into memory: 512 MiB of it, zstd-compressed to a few KB (the decompressed size limit is 64 GiB)
LONG_NAME_BYTES = 512 << 20

#: printed last by every program run by :func:`_in_a_child`: the program's own peak (VmHWM: ru_maxrss
#: would count the forking pytest worker's, kept across exec) and the peak of the largest child it ran
_PEAKS = """
import resource
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


class ChildRun(NamedTuple):
    verdict: str  #: the program's one line: "passed", "pulled" or "refused CODE MESSAGE"
    own_mib: int  #: the program's own peak memory
    child_mib: int  #: the peak of the largest process it ran (qemu-img)


def _in_a_child(program: str, *args: str, timeout: float = 120) -> ChildRun:
    """``program`` (which prints one verdict line) in a Python process of its own, and its peaks."""
    out = subprocess.run([sys.executable, "-c", program + _PEAKS, *args],
                         capture_output=True, text=True, timeout=timeout)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 3, out
    return ChildRun(lines[0], int(lines[1]) // 1024, int(lines[2]) // 1024)


_PULL = """
import sys
from vmsidecar_contract.errors import ImageError
from vmsidecar_runtime.oci.pull import pull
try:
    pull(sys.argv[1], sys.argv[2], arch="x86_64")
    print("pulled")
except ImageError as e:
    print("refused", e.code, e.message.replace("\\n", " "))
"""


def test_a_tar_header_claiming_a_huge_long_name_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """tarfile reads a GNU long name (or a pax header) whole into memory, as long as its header says:
    a containerDisk layer of a few KB made the runtime allocate what the header claimed."""
    import zstandard

    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = tarfile.GNUTYPE_LONGNAME, LONG_NAME_BYTES
    compressor = zstandard.ZstdCompressor().compressobj()
    layer = bytearray(compressor.compress(header.tobuf(tarfile.USTAR_FORMAT)))
    chunk = b"a" * (1 << 20)
    for _ in range(LONG_NAME_BYTES // len(chunk)):
        layer += compressor.compress(chunk)
    layer += compressor.flush()
    c = Crafter(layout=tmp_path / "layout")
    ref = c.tag(c.manifest([c.blob(bytes(layer), "application/vnd.oci.image.layer.v1.tar+zstd")]), "v1")
    run = _in_a_child(_PULL, ref, str(tmp_path / "cache"))
    assert run.own_mib < 256, f"the pull's process peaked at {run.own_mib} MiB for a {len(layer)}-byte layer"
    assert run.verdict.startswith("refused") and "extended tar header" in run.verdict, run.verdict


# ---- a qcow2 whose check would take the host's memory or time -------------------------------------

_CHECK = """
import sys
from pathlib import Path
from vmsidecar_contract.errors import ImageError
from vmsidecar_runtime.image import checks
from vmsidecar_runtime.image.limits import Origin
for name, value in (a.split("=") for a in sys.argv[2:]):  # the bounds, lowered by a test
    setattr(checks, name, float(value) if "TIMEOUT" in name else int(value))
try:
    checks.check_image(Path(sys.argv[1]), "qcow2", Origin("the flashed image", "flash the result"))
    print("passed")
except ImageError as e:
    print("refused", e.code, e.message.replace("\\n", " "))
"""


def _check_in_a_child(disk: Path, *bounds: str, timeout: float = 120) -> ChildRun:
    """:func:`check_image` of ``disk`` in a process of its own (``bounds``: ``NAME=VALUE`` settings
    of :mod:`checks` to lower): its verdict, its own peak memory and its qemu-img's."""
    return _in_a_child(_CHECK, str(disk), *bounds, timeout=timeout)


def _sparse_qcow2(path: Path, options: str) -> Path:
    """A qcow2 whose *file* is 60 GiB long (a sparse tail: a few hundred KiB on the host, a few KiB
    compressed): qemu-img check sizes its refcount array by the file, not by the disk's 1 GiB (a
    60 GiB disk in 512-byte clusters takes qemu-img create 16 s to write; the check is the same)."""
    _qemu_img("create", "-q", "-f", "qcow2", "-o", options, str(path), "1G")
    os.truncate(path, 60 << 30)
    return path


def test_a_qcow2_whose_check_would_take_a_gigabyte_is_refused_before_qemu_img_checks_it(
    tmp_path: Path,
) -> None:
    """``qemu-img check`` keeps one refcount per cluster of the file: 512-byte clusters with 64-bit
    refcounts over a 60 GiB file made it allocate 1 GiB (RSS 1,021 MB in 1.5 s) on every pull,
    flash or ``file:`` boot of the image, in the runtime's memory budget, for a disk that is a few
    KiB compressed."""
    disk = _sparse_qcow2(tmp_path / "greedy.qcow2", "cluster_size=512,refcount_bits=64")
    verdict, _, peak_mib = _check_in_a_child(disk)
    assert verdict.startswith("refused unsafe_disk"), verdict
    assert "60 GiB file in 512-byte clusters with 64-bit refcounts" in verdict, verdict
    assert "would take 960 MiB of memory, more than 256 MiB" in verdict, verdict
    assert "qemu-img convert -O qcow2 IN OUT" in verdict and "flash the result" in verdict, verdict
    assert peak_mib < 200, f"a qemu-img of {peak_mib} MiB ran"
    # the same geometry over a file of ordinary length passes: the refusal is the memory, not the options
    small = tmp_path / "small.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", "-o", "cluster_size=512,refcount_bits=64", str(small), "1G")
    assert _check_in_a_child(small).verdict == "passed"


def test_qemu_img_is_held_to_a_memory_and_a_time_bound_whatever_the_image(tmp_path: Path) -> None:
    """What the header does not tell: every qemu-img run on an image runs with the kernel holding its
    memory (RLIMIT_DATA) and the runtime its time. Both bounds lowered here so that a real image
    (16-bit refcounts: a 240 MiB array, under the refusal above) meets them for real."""
    disk = _sparse_qcow2(tmp_path / "hungry.qcow2", "cluster_size=512")
    verdict, _, peak_mib = _check_in_a_child(disk, f"QEMU_IMG_MEMORY={96 << 20}")
    assert verdict.startswith("refused unsafe_disk"), verdict
    assert "qemu-img check needed more than 96 MiB of memory" in verdict, verdict
    assert "qemu-img convert -O qcow2 IN OUT" in verdict, verdict
    assert peak_mib < 200, f"a qemu-img of {peak_mib} MiB ran"
    verdict = _check_in_a_child(disk, "QEMU_IMG_TIMEOUT=0.001").verdict
    assert verdict.startswith("refused unsafe_disk"), verdict
    assert "did not finish within 0.001 s" in verdict, verdict
    assert "qemu-img convert -O qcow2 IN OUT" in verdict, verdict
    assert _check_in_a_child(disk).verdict == "passed"  # the runtime's own bounds let an honest odd disk pass


def _leaky_qcow2(path: Path, cluster_bits: int, file_size: int) -> Path:
    """A qcow2 whose refcounts say every cluster of a ``file_size``-long file is in use while nothing
    references them (every refcount table entry names one refcount block full of 1s; the file a
    sparse tail): ``qemu-img check`` prints a "Leaked cluster" line for each."""
    cluster = 1 << cluster_bits
    _qemu_img("create", "-q", "-f", "qcow2", "-o", f"cluster_size={cluster}", str(path), "1G")
    with open(path, "r+b") as f:
        (reftable_offset,) = struct.unpack_from(">Q", f.read(104), 48)
        f.seek(reftable_offset)
        (refblock,) = struct.unpack(">Q", f.read(8))
        f.seek(refblock)
        f.write(struct.pack(">H", 1) * (cluster // 2))
        table = struct.pack(">Q", refblock) * -(-(file_size // cluster) // (cluster // 2))
        offset = -(-os.fstat(f.fileno()).st_size // cluster) * cluster
        f.seek(offset)
        f.write(table)
        f.seek(48)
        f.write(struct.pack(">QI", offset, -(-len(table) // cluster)))
    os.truncate(path, file_size)
    return path


def test_what_qemu_img_prints_about_a_disk_is_read_bounded(tmp_path: Path) -> None:
    """``qemu-img check`` prints a line per cluster whose refcount is off: a crafted qcow2 of 4 KiB
    clusters over a 16 GiB file (a few KB compressed) made it print 4 million lines, and the runtime,
    reading them whole (``communicate``), held them twice (bytes and text)."""
    disk = _leaky_qcow2(tmp_path / "leaky.qcow2", 12, 16 << 30)
    run = _check_in_a_child(disk, timeout=200)
    assert run.verdict.startswith("refused bad_disk"), run.verdict
    assert "corrupt qcow2 (2048 corruptions, 4194297 leaks)" in run.verdict, run.verdict
    assert run.own_mib < 150, f"the checking process peaked at {run.own_mib} MiB"


def _many_snapshots(path: Path, count: int) -> Path:
    """A qcow2 of ``count`` internal snapshots: one made by qemu-img, its table entry repeated."""
    _qemu_img("create", "-q", "-f", "qcow2", str(path), "1G")
    _qemu_img("snapshot", "-c", "s", str(path))
    with open(path, "r+b") as f:
        nb, offset = struct.unpack_from(">IQ", f.read(72), 60)
        assert nb == 1
        f.seek(offset)
        fixed = f.read(40)
        extra = f.read(struct.unpack_from(">I", fixed, 36)[0])
        entries = bytearray()
        for i in range(count):
            ident, name = str(i + 1).encode(), f"s{i}".encode()
            entry = bytearray(fixed)
            struct.pack_into(">HH", entry, 12, len(ident), len(name))
            entry += extra + ident + name
            entries += entry + bytes(-len(entry) % 8)
        table = -(-os.fstat(f.fileno()).st_size // 65536) * 65536
        f.seek(table)
        f.write(entries)
        f.seek(60)
        f.write(struct.pack(">IQ", count, table))
    return path


def test_a_qcow2_that_makes_qemu_img_print_megabytes_is_refused_for_it(tmp_path: Path) -> None:
    """10,000 internal snapshots (a 1.2 MB file; QEMU takes up to 65,536) make ``qemu-img info``
    print 2.7 MB of JSON: the runtime reads 1 MiB of it, stops qemu-img and says why."""
    verdict = _check_in_a_child(_many_snapshots(tmp_path / "snapshots.qcow2", 10_000)).verdict
    assert verdict.startswith("refused unsafe_disk"), verdict
    assert "qemu-img info printed more than 1 MiB about it" in verdict, verdict
    few = tmp_path / "few.qcow2"  # an honest disk with internal snapshots passes
    _qemu_img("create", "-q", "-f", "qcow2", str(few), "1G")
    for name in ("a", "b", "c"):
        _qemu_img("snapshot", "-c", name, str(few))
    assert _check_in_a_child(few).verdict == "passed"


def test_a_qcow2_whose_bitmaps_would_take_hundreds_of_megabytes_is_refused(tmp_path: Path) -> None:
    """Persistent dirty bitmaps are loaded whole by every QEMU and qemu-img that opens the disk: 40
    bitmaps of 512-byte granularity over 64 GiB (1,083 bytes zstd-compressed) passed the check, within
    its memory bound, then took 674 MB in each overlay's ``qemu-img create``, each dump's ``convert``
    and the guest's QEMU, none of them bounded. No disk from a registry or a flash needs them."""
    disk = tmp_path / "bitmaps.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", str(disk), "64G")
    for n in range(3):
        _qemu_img("bitmap", "--add", "-g", "512", str(disk), f"b{n}")
    verdict, _, _ = _check_in_a_child(disk)
    assert verdict.startswith("refused unsafe_disk"), verdict
    assert "3 persistent bitmaps" in verdict and "48 MiB" in verdict, verdict
    assert "qemu-img convert -O qcow2 IN OUT" in verdict, verdict
    # a bitmap of the default granularity over the same disk costs 128 KiB: it passes
    small = tmp_path / "one-bitmap.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", str(small), "64G")
    _qemu_img("bitmap", "--add", str(small), "backup")
    assert _check_in_a_child(small).verdict == "passed"
