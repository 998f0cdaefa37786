"""The debian-uefi guest: the debian guest on a GPT disk that boots with UEFI only.

Built from the cached debian build (only the disk is assembled: ~15 s; a cache hit well under a
second). The boot tests run it through a runtime process with ``firmware: uefi`` (OVMF, TCG: ~35 s
to the marker), prove the boot went through UEFI and the image's own EFI stub, and that every
boot gets fresh UEFI variables: a variable the guest writes is in the vars file of that boot and
gone after a power cycle (a new QEMU), and the distribution's template is never written. The same
disk under SeaBIOS says why it cannot boot and never becomes Ready.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from fixtures.images import DEBIAN_FAST_CPU
from fixtures.runtime import qemu_pids
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import GuestError
from vmsidecar_images import uefi
from vmsidecar_images.build import BuiltImage, build_image
from vmsidecar_images.console import Console
from vmsidecar_images.recipe import SOURCE_DATE_EPOCH, load_recipe
from vmsidecar_runtime.firmware import CANDIDATES

pytestmark = pytest.mark.timeout(900)

MARKER = rb"VMSIDECAR-READY image=debian uptime=([0-9.]+) boot=([0-9a-f-]{36})"
_MTOOLS_ENV = {"MTOOLS_SKIP_CHECK": "1", "PATH": "/usr/bin:/bin"}
#: systemd's vendor GUID for the variables its boot loader and stub set (LoaderDevicePartUUID, ...)
LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
#: a vendor GUID of our own for the variable the test writes
TEST_GUID = "766d7364-7465-7374-8000-766172696162"


@pytest.fixture(scope="session")
def debian_uefi_image() -> BuiltImage:
    """The debian guest on a GPT/ESP disk (repartitions the cached debian build)."""
    return build_image("debian-uefi", arch="x86_64")


def _ovmf_template() -> Path:
    for code, vars_template in CANDIDATES["x86_64"]:
        if Path(code).exists() and Path(vars_template).exists():
            return Path(vars_template)
    pytest.fail("no OVMF installed: apt-get install ovmf (scripts/setup installs it)", pytrace=False)


def _raw_disk(image: BuiltImage, tmp_path: Path) -> Path:
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(image.disk), str(raw)], check=True)
    return raw


def test_debian_uefi_recipe_builds_from_the_debian_build(debian_uefi_image: BuiltImage) -> None:
    m = debian_uefi_image.manifest
    base = build_image("debian")  # the cached build it was made from (a cache hit)
    assert (m["name"], m["label"], m["boot"], m["firmware"]) == ("debian-uefi", "debian", "uefi-disk", "uefi")
    assert m["base"]["input_hash"] == base.manifest["input_hash"], "built from the current debian build"
    assert m["build_steps"].get("base_build", 0) < 600
    assert m["cmdline"] == base.cmdline
    # the same kernel and initramfs (for direct kernel boot too), the systemd stub at the guest's version
    assert debian_uefi_image.kernel.read_bytes() == base.kernel.read_bytes()
    assert debian_uefi_image.initrd.read_bytes() == base.initrd.read_bytes()
    stub = m["pins"]["tools"][0]
    assert stub["package"] == "systemd-boot-efi"
    assert stub["version"] == base.manifest["pins"]["packages"]["systemd"], "the stub matches the guest's systemd"
    for name, info in m["files"].items():
        data = (debian_uefi_image.dir / name).read_bytes()
        assert (info["size"], info["sha256"]) == (len(data), hashlib.sha256(data).hexdigest()), name
    assert not debian_uefi_image.disk.stat().st_mode & 0o222, "cached disk must be read-only"


def test_debian_uefi_cache_hit_assembles_nothing(debian_uefi_image: BuiltImage,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache hit must not assemble a disk")

    monkeypatch.setattr(uefi, "build", no_build)
    t0 = time.monotonic()
    assert build_image("debian-uefi").dir == debian_uefi_image.dir
    assert time.monotonic() - t0 < 5


def test_debian_uefi_disk_is_gpt_with_an_esp_and_the_debian_root(debian_uefi_image: BuiltImage,
                                                                  tmp_path: Path) -> None:
    recipe = load_recipe("debian-uefi")
    dcfg = recipe.config["disk"]
    raw = _raw_disk(debian_uefi_image, tmp_path)
    table = json.loads(subprocess.run(["sfdisk", "--json", str(raw)], capture_output=True, text=True,
                                      check=True).stdout)["partitiontable"]  # fmt: skip
    assert (table["label"], table["id"].lower()) == ("gpt", dcfg["disk_guid"])
    esp, root = table["partitions"]
    assert (esp["type"], esp["uuid"].lower(), esp["start"]) == (uefi.ESP_TYPE, dcfg["esp_guid"], 2048)
    assert (root["type"], root["uuid"].lower()) == (recipe.config["arch"]["x86_64"]["root_type"], dcfg["root_guid"])
    head = raw.open("rb").read(1024)
    assert head[450] == 0xEE and head[510:512] == b"\x55\xaa", "protective MBR"
    assert head[512:520] == b"EFI PART", "GPT header in LBA 1"
    assert dcfg["bios_message"].encode() in head[:440], "the BIOS message is the MBR's boot code"

    # p1: FAT32 holding only the unified kernel image, at the removable-media path
    at = f"{raw}@@{esp['start'] * 512}"
    probe = subprocess.run(["blkid", "-p", "-o", "export", "-O", str(esp["start"] * 512), str(raw)],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "VERSION=FAT32" in probe and "TYPE=vfat" in probe, probe
    listing = subprocess.run(["mdir", "-/", "-b", "-i", at, "::/"], capture_output=True, text=True, check=True,
                             env=_MTOOLS_ENV).stdout  # fmt: skip
    assert [line.strip() for line in listing.splitlines() if line.strip() and not line.endswith("/")] == \
        ["::/EFI/BOOT/BOOTX64.EFI"], listing
    uki_file = tmp_path / "BOOTX64.EFI"
    subprocess.run(["mcopy", "-i", at, "::/EFI/BOOT/BOOTX64.EFI", str(uki_file)], check=True, env=_MTOOLS_ENV)
    assert hashlib.sha256(uki_file.read_bytes()).hexdigest() == debian_uefi_image.manifest["uki"]["sha256"]

    # the image: systemd's stub, the command line, kernel and initramfs of this build; a fixed timestamp
    sections = subprocess.run(["objdump", "-h", "-w", str(uki_file)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    assert "pei-x86-64" in sections and {".sdmagic", ".cmdline", ".linux", ".initrd"} <= set(re.findall(r"\s(\.\w+)\s", sections))
    for name, expected in ((".cmdline", debian_uefi_image.manifest["cmdline"].encode()),
                           (".linux", debian_uefi_image.kernel.read_bytes()),
                           (".initrd", debian_uefi_image.initrd.read_bytes())):
        out = tmp_path / f"section{name}"
        subprocess.run(["objcopy", "-O", "binary", "--only-section", name, str(uki_file), str(out)], check=True)
        assert out.read_bytes() == expected, name
    private = subprocess.run(["objdump", "-p", str(uki_file)], capture_output=True, text=True, check=True).stdout
    assert "Time/Date\t\tMon Jan  1 00:00:00 2024" in private, "SOURCE_DATE_EPOCH, not the build time"

    # p2: the debian build's root file system, byte for byte
    base = build_image("debian")
    base_raw = tmp_path / "base.raw"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(base.disk), str(base_raw)], check=True)
    base_p2 = base.manifest["disk"]["partitions"][1]
    assert root["size"] == base_p2["sectors"]
    with raw.open("rb") as new, base_raw.open("rb") as old:
        for i in range(0, root["size"] * 512, 64 << 20):  # sampled: 16 chunks of 1 MiB across 1 GiB
            new.seek(root["start"] * 512 + i)
            old.seek(base_p2["start_sector"] * 512 + i)
            assert new.read(1 << 20) == old.read(1 << 20), f"root partition differs at +{i}"


def test_unified_kernel_image_is_reproducible(tmp_path: Path) -> None:
    """Two builds seconds apart give the same bytes; the PE checksum is the one objcopy computes."""
    recipe = load_recipe("debian-uefi")
    stub = uefi.efi_stub(recipe, "x86_64", tmp_path)
    kernel, initrd = tmp_path / "k", tmp_path / "i"
    kernel.write_bytes(b"MZ-not-a-kernel" * 1000)
    initrd.write_bytes(b"\x1f\x8b" + bytes(5000))
    digests = []
    for n in range(2):
        if n:
            time.sleep(1.1)  # the clock must pass a second: a build stamping "now" would differ only then
        out = tmp_path / f"uki{n}.efi"
        uefi.make_uki(stub, kernel=kernel, initrd=initrd, cmdline="console=ttyS0", out=out, work=tmp_path)
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    # objcopy's own output (timestamp "now") carries a checksum: ours must compute the same
    plain = tmp_path / "plain.efi"
    subprocess.run(["objcopy", "--add-section", f".linux={kernel}", "--change-section-vma", ".linux=0x30000",
                    str(stub), str(plain)], check=True)  # fmt: skip
    data = plain.read_bytes()
    checksum_at = uefi._pe_header(data) + 20 + 64
    assert int.from_bytes(data[checksum_at:checksum_at + 4], "little") == uefi.pe_checksum(data, checksum_at)
    got = (tmp_path / "uki0.efi").read_bytes()
    coff = uefi._pe_header(got)
    assert int.from_bytes(got[coff + 4:coff + 8], "little") == SOURCE_DATE_EPOCH



async def _ready(rt: Any, console: Console, timeout: float = 600) -> bytes:
    """Wait for this boot's marker and Ready; returns the guest's boot id."""
    marker = asyncio.create_task(console.expect(MARKER, timeout))
    ready = asyncio.create_task(rt.client().wait_ready(timeout))
    try:
        await asyncio.gather(marker, ready)
    except Exception as exc:
        marker.cancel()
        ready.cancel()
        pytest.fail(f"no marker / not Ready: {exc!r}\nruntime log:\n{rt.log_text()[-3000:]}")
    return marker.result().group(2)


def _vars_file(rt: Any, template: Path) -> Path:
    return rt.state / "firmware" / template.name


async def test_uefi_guest_boots_and_gets_fresh_vars_each_boot(start_runtime: Any,
                                                             debian_uefi_image: BuiltImage) -> None:
    template = _ovmf_template()
    template_before = (template.stat().st_mtime_ns, hashlib.sha256(template.read_bytes()).hexdigest())
    # snapshot off: every power on is a cold boot of a new QEMU (no memory snapshot restored)
    rt = await start_runtime({"image": f"file:{debian_uefi_image.disk}", "memory": "1G", "cpu": DEBIAN_FAST_CPU,
                              "firmware": "uefi", "snapshot": "off"})
    con = await Console.open_when_served(rt.shared / "console.sock")
    t0 = time.monotonic()
    boot_id = await _ready(rt, con)
    print(f"\ndebian-uefi guest: marker and Ready {time.monotonic() - t0:.1f} s after the runtime served")
    assert b"BdsDxe: starting Boot" in con.seen, "OVMF's boot manager printed on ttyS0"

    await con.wake()
    # booted through UEFI, by the image's own systemd stub from the ESP (it names its partition)
    assert (await con.run("test -d /sys/firmware/efi && cat /sys/firmware/efi/fw_platform_size")).strip() == "64"
    assert "/dev/vda2 ext4" in await con.run("findmnt -n -o SOURCE,FSTYPE /")
    part = await con.run(f"cat /sys/firmware/efi/efivars/LoaderDevicePartUUID-{LOADER_GUID} | tail -c +5 | tr -d '\\000'")
    assert part.strip().lower() == load_recipe("debian-uefi").config["disk"]["esp_guid"], part
    assert (await con.run("mountpoint -q /sys/firmware/efi/efivars && echo rw-efivarfs")).strip() == "rw-efivarfs"

    # a non-volatile variable written in the guest lands in this boot's vars file
    token = uuid.uuid4().hex[:12]
    var = f"/sys/firmware/efi/efivars/VmsidecarTest-{TEST_GUID}"
    await con.run(f"printf '\\007\\000\\000\\000{token}' > {var}")  # attributes NV|BS|RT, then the data
    assert (await con.run(f"cat {var} | tail -c +5")).strip() == token  # efivarfs cannot seek
    vars_file = _vars_file(rt, template)
    name = "VmsidecarTest".encode("utf-16-le")
    await wait_until_async(lambda: token.encode() in vars_file.read_bytes() and name in vars_file.read_bytes(), 30,
                           "the variable to reach the vars file", interval=0.2)
    qemu_before = set(qemu_pids(str(vars_file)))
    assert len(qemu_before) == 1, qemu_before
    await con.close()

    # power cycle: the old QEMU goes, a new one starts on a new copy of the template
    state = await rt.client().power("cycle", timeout=60)
    assert state.phase.value in ("Starting", "Running", "Ready"), state.phase
    # The new boot is followed until OVMF's boot manager hands over to the disk: by then the firmware
    # has read every variable it will ever give the guest, and the vars file is the only place it
    # reads them from. (Booting on to the guest's shell to list efivars proved the same at the cost
    # of a second ~35 s TCG boot of Debian; the first boot above shows a guest's variable lands in
    # the file, so a file without it is a guest without it.)
    con = await Console.open_when_served(rt.shared / "console.sock")
    await con.expect(rb"BdsDxe: starting Boot", 300)
    qemu_after = set(qemu_pids(str(vars_file)))
    assert len(qemu_after) == 1 and qemu_after.isdisjoint(qemu_before), "a power cycle starts a new QEMU"
    data = vars_file.read_bytes()
    assert name not in data and token.encode() not in data, "no variable of the earlier boot survives"
    assert boot_id not in bytes(con.seen), "the console shows only the new boot"
    await con.close()
    await rt.client().power("off", graceful=False)

    assert (template.stat().st_mtime_ns, hashlib.sha256(template.read_bytes()).hexdigest()) == template_before, \
        "the distribution's OVMF vars template must never be written"


async def test_uefi_disk_under_bios_says_why_and_never_becomes_ready(start_runtime: Any,
                                                                    debian_uefi_image: BuiltImage) -> None:
    # graphics=off lets SeaBIOS print on the serial port (its "sercon"); QEMU merges -machine options.
    # No NIC: SeaBIOS goes from the disk straight to "No bootable device" (no iPXE DHCP round first).
    rt = await start_runtime({"image": f"file:{debian_uefi_image.disk}", "firmware": "bios", "snapshot": "off",
                              "network": {"enabled": False}, "readiness": {"timeout": 45},
                              "extra_args": ["-machine", "graphics=off"]})
    con = await Console.open_when_served(rt.shared / "console.sock")
    await con.expect(re.escape(load_recipe("debian-uefi").config["disk"]["bios_message"]), 120)
    await con.expect(rb"No bootable device", 120)
    with pytest.raises(GuestError) as failed:
        await rt.client().wait_ready(300)
    message = str(failed.value)
    assert "did not print" in message and "within 45 s" in message, message
    assert "No bootable device" in message, "the runtime's error carries the console tail"
    state = await rt.client().state()
    assert state.phase.value == "Error", state
    await con.close()
