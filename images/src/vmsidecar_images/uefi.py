"""The ``uefi`` builder: a base recipe's build repartitioned as a GPT disk that boots with UEFI only.

Nothing is bootstrapped again: the base build (e.g. ``debian``, from the cache) gives the root
file system partition, kernel, initramfs and command line. One function per step, :func:`build`
runs them in order:

1. :func:`base_root` - the base disk as a sparse raw file and where its root partition is (MBR p2)
2. :func:`efi_stub` - systemd's EFI stub out of the pinned ``systemd-boot-efi`` .deb
3. :func:`make_uki` - a unified kernel image: stub + ``.cmdline`` + ``.linux`` + ``.initrd``
4. :func:`make_esp` - FAT32 holding it at the removable-media path ``EFI/BOOT/BOOTX64.EFI``
5. :func:`assemble` - GPT (fixed GUIDs), a BIOS message in the protective MBR, ESP + root, qcow2

Why the removable-media path and a unified kernel image: the runtime gives every boot fresh UEFI
variables, so no boot entry survives; the firmware finds ``\\EFI\\BOOT\\BOOTX64.EFI`` on its own,
and a unified image needs no boot loader configuration (the command line and initramfs are in it).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import debs, disk
from .debs import run
from .errors import BuildError
from .recipe import SOURCE_DATE_EPOCH, Recipe

#: GPT partition type of an EFI system partition
ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
#: FAT volume id of the ESP (fixed: reproducible)
ESP_VOLUME_ID = "766D7365"  # "vmse"
#: room left after the last partition for the backup GPT (33 sectors), rounded to 1 MiB
TAIL_SECTORS = 2048
#: PE: where the PE header's offset is; the timestamp in the COFF header; CheckSum in a PE32+ optional header
_PE_POINTER, _TIMESTAMP_AT, _CHECKSUM_AT = 0x3C, 4, 64


@dataclass(frozen=True)
class GptLayout:
    """p1 the ESP, p2 the root partition (as large as the base's), a tail for the backup GPT."""

    esp_mib: int
    root_sectors: int

    @property
    def esp_start(self) -> int:
        return disk.START_SECTOR

    @property
    def esp_sectors(self) -> int:
        return self.esp_mib * disk.MIB // disk.SECTOR

    @property
    def root_start(self) -> int:
        return self.esp_start + self.esp_sectors

    @property
    def total_sectors(self) -> int:
        return self.root_start + self.root_sectors + TAIL_SECTORS

    @property
    def total_bytes(self) -> int:
        return self.total_sectors * disk.SECTOR


@dataclass(frozen=True)
class BaseRoot:
    """The base build's disk as raw, and its root partition (sectors)."""

    raw: Path
    start: int
    sectors: int


def base_root(base_disk: Path, work: Path) -> BaseRoot:
    """``qemu-img convert`` the base qcow2 to a sparse raw file and find its root partition (p2).

    :raise BuildError: when the base disk is not the MBR layout of the bootstrapped recipes.
    """
    raw = work / "base.raw"
    run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(base_disk), str(raw)],
        what="read the base disk")  # fmt: skip
    with raw.open("rb") as f:
        parts = disk.read_partitions(f.read(disk.SECTOR))
    if len(parts) != 2 or parts[1]["type"] != disk.TYPE_LINUX:
        raise BuildError(
            f"the base disk {base_disk} is not an MBR disk with the root file system as p2 (type 0x83); "
            "a uefi recipe's base must be a debian-builder recipe"
        )
    return BaseRoot(raw=raw, start=int(parts[1]["start"]), sectors=int(parts[1]["sectors"]))


def efi_stub(recipe: Recipe, arch: str, work: Path) -> Path:
    """systemd's EFI stub (``[arch.*] uki_stub``) from the pinned ``systemd-boot-efi`` package."""
    pins = recipe.arch_pins(arch)
    if not pins.tools:
        raise BuildError(f"{recipe.versions_file} pins no systemd-boot-efi for {arch} (tools = [...])")
    root = work / "stub"
    for pin in pins.tools:
        debs.extract(debs.fetch(pin, pins.deb_arch, versions_file=recipe.versions_file), root)
    stub = root / str(recipe.arch_config(arch)["uki_stub"])
    if not stub.is_file():
        raise BuildError(f"{', '.join(p.spec for p in pins.tools)} has no /{recipe.arch_config(arch)['uki_stub']}; "
                         f"check the pin in {recipe.versions_file}")
    return stub


def _pe_header(data: bytes | bytearray) -> int:
    if data[:2] != b"MZ":
        raise BuildError("the EFI stub is not a PE image (no MZ header)")
    offset = struct.unpack_from("<I", data, _PE_POINTER)[0]
    if data[offset : offset + 4] != b"PE\0\0":
        raise BuildError("the EFI stub is not a PE image (no PE signature)")
    return offset + 4  # the COFF file header


def _image_end(stub: Path) -> int:
    """The first address after the stub's sections (where the added sections may start)."""
    data = stub.read_bytes()
    coff = _pe_header(data)
    nsections, _, _, _, opt_size = struct.unpack_from("<HIIIH", data, coff + 2)
    table = coff + 20 + opt_size
    end = 0
    for i in range(nsections):
        vsize, vaddr = struct.unpack_from("<II", data, table + 40 * i + 8)
        end = max(end, vaddr + vsize)
    return end


def pe_checksum(data: bytes | bytearray, checksum_at: int) -> int:
    """The PE image checksum (16-bit one's-complement-style sum, the checksum field read as 0, plus the length)."""
    total = 0
    padded = bytes(data) + b"\0" * (len(data) % 2)
    words = struct.unpack(f"<{len(padded) // 2}H", padded)
    skip = checksum_at // 2
    for i, word in enumerate(words):
        if i in (skip, skip + 1):
            continue
        total += word
        total = (total & 0xFFFF) + (total >> 16)
    return ((total & 0xFFFF) + (total >> 16) + len(data)) & 0xFFFFFFFF


def fix_pe_timestamp(path: Path, epoch: int = SOURCE_DATE_EPOCH) -> None:
    """objcopy stamps the PE header with the build time: set it to ``epoch`` and redo the checksum."""
    data = bytearray(path.read_bytes())
    coff = _pe_header(data)
    struct.pack_into("<I", data, coff + _TIMESTAMP_AT, epoch)
    checksum_at = coff + 20 + _CHECKSUM_AT
    struct.pack_into("<I", data, checksum_at, 0)
    struct.pack_into("<I", data, checksum_at, pe_checksum(data, checksum_at))
    path.write_bytes(data)


def _align(value: int, to: int = 0x1000) -> int:
    return (value + to - 1) // to * to


def make_uki(stub: Path, *, kernel: Path, initrd: Path, cmdline: str, out: Path, work: Path) -> dict[str, int]:
    """A unified kernel image: the stub with ``.cmdline``, ``.linux`` and ``.initrd`` sections added.

    The sections go one after the other above the stub's own, page-aligned (the stub copies the
    kernel to an aligned address itself when needed). Returns each added section's address.
    """
    cmdline_file = work / "cmdline.txt"
    cmdline_file.write_text(cmdline)  # no newline: the stub passes the section as is
    addresses: dict[str, int] = {}
    at = _align(_image_end(stub), 0x10000)
    argv = ["objcopy"]
    for name, src in ((".cmdline", cmdline_file), (".linux", kernel), (".initrd", initrd)):
        addresses[name] = at
        argv += ["--add-section", f"{name}={src}", "--change-section-vma", f"{name}={at:#x}"]
        at = _align(at + src.stat().st_size)
    run([*argv, str(stub), str(out)], what="build the unified kernel image")
    fix_pe_timestamp(out)
    return addresses


def make_esp(out: Path, *, layout: GptLayout, label: str, files: dict[str, Path]) -> None:
    """FAT32 in a file with ``files`` (path inside the ESP -> source); directories made as needed."""
    env = {"SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH), "MTOOLS_SKIP_CHECK": "1", "TZ": "UTC"}
    run(
        [
            "mkfs.fat", "-F", "32", "-n", label, "--invariant", "-i", ESP_VOLUME_ID,
            "-h", str(layout.esp_start), "-C", str(out), str(layout.esp_sectors * disk.SECTOR // 1024),
        ],
        what="create the EFI system partition",
        env=env,
    )  # fmt: skip
    made: set[str] = set()
    for dest, src in sorted(files.items()):
        parents = Path(dest).parents
        for parent in reversed(list(parents)[:-1]):  # EFI, EFI/BOOT (not ".")
            if parent.as_posix() not in made:
                run(["mmd", "-i", str(out), f"::/{parent.as_posix()}"], what=f"make /{parent} on the ESP", env=env)
                made.add(parent.as_posix())
        os.utime(src, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH))
        run(["mcopy", "-m", "-i", str(out), str(src), f"::/{dest}"], what=f"copy {dest} to the ESP", env=env)


def bios_message_code(message: str) -> bytes:
    """x86 real-mode boot code for the protective MBR: print ``message`` via the BIOS, then int 18h.

    int 18h tells the BIOS this disk cannot boot; SeaBIOS then tries the next device and ends with
    "No bootable device.". Must fit the MBR's 440 bytes of code.
    """
    text = message.encode("ascii") + b"\r\n\0"
    code = bytes.fromhex(
        "31c0"      # xor ax, ax
        "8ed8"      # mov ds, ax
        "be1b7c"    # mov si, 0x7c1b (the message, right after this code)
        "fc"        # cld
        "ac"        # .next: lodsb
        "84c0"      # test al, al
        "7409"      # jz .done
        "b40e"      # mov ah, 0x0e (teletype output)
        "bb0700"    # mov bx, 0x0007
        "cd10"      # int 0x10
        "ebf2"      # jmp .next
        "cd18"      # .done: int 0x18 (boot failure: back to the BIOS)
        "f4"        # hlt
        "ebfd"      # jmp hlt
    )  # fmt: skip
    assert len(code) == 0x1B
    blob = code + text
    if len(blob) > 440:
        raise BuildError(f"the BIOS message is {len(text)} bytes; at most {440 - len(code)} fit the MBR")
    return blob


def assemble(out: Path, *, layout: GptLayout, dcfg: dict, arch_cfg: dict, esp: Path, root: BaseRoot) -> None:
    """GPT with sfdisk (fixed disk and partition GUIDs), the BIOS message, then the ESP and the root."""
    with out.open("wb") as f:
        f.truncate(layout.total_bytes)
    script = (
        "label: gpt\n"
        f"label-id: {dcfg['disk_guid']}\n"
        "unit: sectors\n"
        f"first-lba: {layout.esp_start}\n\n"
        f'start={layout.esp_start}, size={layout.esp_sectors}, type={ESP_TYPE}, uuid={dcfg["esp_guid"]}, '
        'name="EFI system partition"\n'
        f'start={layout.root_start}, size={layout.root_sectors}, type={arch_cfg["root_type"]}, '
        f'uuid={dcfg["root_guid"]}, name="{dcfg["root_name"]}"\n'
    )
    run(["sfdisk", "--no-reread", "--no-tell-kernel", "-q", str(out)], what="write the GPT", input=script)
    fd = os.open(out, os.O_WRONLY)
    try:
        os.pwrite(fd, bios_message_code(str(dcfg["bios_message"])), 0)  # code only: the table stays
        disk._copy_sparse(esp, fd, layout.esp_start * disk.SECTOR)
        _copy_range_sparse(root.raw, root.start * disk.SECTOR, root.sectors * disk.SECTOR, fd,
                           layout.root_start * disk.SECTOR)
    finally:
        os.close(fd)


def _copy_range_sparse(src: Path, offset: int, length: int, dst_fd: int, dst_offset: int) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src`` to ``dst_offset``, skipping holes and zero blocks."""
    block = 1 << 20
    with src.open("rb") as f:
        fd = f.fileno()
        pos = offset
        end = offset + length
        while pos < end:
            try:
                data_at = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                return
            if data_at >= end:
                return
            hole_at = min(os.lseek(fd, data_at, os.SEEK_HOLE), end)
            pos = data_at
            while pos < hole_at:
                chunk = os.pread(fd, min(block, hole_at - pos), pos)
                if chunk.count(0) != len(chunk):
                    os.pwrite(dst_fd, chunk, dst_offset + pos - offset)
                pos += len(chunk)


def build(
    work: Path,
    *,
    recipe: Recipe,
    arch: str,
    base_disk: Path,
    kernel: Path,
    initrd: Path,
    cmdline: str,
    disk_out: Path,
    step: Callable[[str], None],
) -> dict[str, object]:
    """Build the UEFI disk from the base build's disk, kernel, initramfs and command line."""
    dcfg, arch_cfg = recipe.config["disk"], recipe.arch_config(arch)
    root = base_root(base_disk, work)
    step("base")
    uki = work / "BOOTX64.EFI"
    sections = make_uki(efi_stub(recipe, arch, work), kernel=kernel, initrd=initrd, cmdline=cmdline, out=uki,
                        work=work)
    step("uki")
    layout = GptLayout(esp_mib=int(dcfg["esp_mib"]), root_sectors=root.sectors)
    esp, raw = work / "esp.img", work / "disk.img"
    removable = str(arch_cfg["removable_path"])
    make_esp(esp, layout=layout, label=str(dcfg["esp_label"]), files={removable: uki})
    assemble(raw, layout=layout, dcfg=dcfg, arch_cfg=arch_cfg, esp=esp, root=root)
    root.raw.unlink()
    disk.to_qcow2(raw, disk_out, compress=bool(arch_cfg.get("qcow2_compress", False)))
    step("disk")
    uki_size = uki.stat().st_size
    return {
        "boot": "uefi-disk",
        "firmware": "uefi",
        "uki": {"path": removable, "size": uki_size, "sha256": debs.sha256_file(uki),
                "sections": {k: f"{v:#x}" for k, v in sections.items()}},
        "disk": {
            "format": "qcow2",
            "label": "gpt",
            "disk_guid": str(dcfg["disk_guid"]),
            "virtual_size": layout.total_bytes,
            "partitions": [
                {
                    "number": 1, "fs": "vfat", "type": ESP_TYPE, "guid": str(dcfg["esp_guid"]),
                    "start_sector": layout.esp_start, "sectors": layout.esp_sectors, "content": [removable],
                },
                {
                    "number": 2, "fs": "ext4", "type": str(arch_cfg["root_type"]), "guid": str(dcfg["root_guid"]),
                    "start_sector": layout.root_start, "sectors": layout.root_sectors, "mount": "/",
                },
            ],
        },
    }  # fmt: skip
