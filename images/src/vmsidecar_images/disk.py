"""The BIOS disk: MBR (syslinux mbr.bin) + p1 FAT16 boot (syslinux) + p2 ext4 data. No root, no mount."""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from .debs import run
from .errors import BuildError, ToolError
from .recipe import SOURCE_DATE_EPOCH

SECTOR = 512
MIB = 1 << 20
#: first partition starts at 1 MiB (sector 2048), like every modern partitioner
START_SECTOR = 2048
#: MBR partition types
TYPE_FAT16_LBA = 0x0E
TYPE_LINUX = 0x83
#: fixed identifiers, so two builds give the same bytes
DISK_ID = 0x766D7364  # "vmsd"
FAT_VOLUME_ID = "766D7362"  # "vmsb"
EXT4_UUID = "766d7364-6174-4100-8000-766d73696465"
EXT4_HASH_SEED = "766d7364-6174-4100-8000-686173687365"

SYSLINUX_MBR_CANDIDATES = (
    Path("/usr/lib/syslinux/mbr/mbr.bin"),  # Debian/Ubuntu (syslinux-common)
    Path("/usr/share/syslinux/mbr.bin"),  # Fedora/Arch
    Path("/usr/lib/syslinux/bios/mbr.bin"),
)


@dataclass(frozen=True)
class Layout:
    boot_mib: int
    data_mib: int

    @property
    def boot_start(self) -> int:
        return START_SECTOR

    @property
    def boot_sectors(self) -> int:
        return self.boot_mib * MIB // SECTOR

    @property
    def data_start(self) -> int:
        return self.boot_start + self.boot_sectors

    @property
    def data_sectors(self) -> int:
        return self.data_mib * MIB // SECTOR

    @property
    def total_bytes(self) -> int:
        return (self.data_start + self.data_sectors) * SECTOR


def _fixed_env() -> dict[str, str]:
    return {
        "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH),
        "E2FSPROGS_FAKE_TIME": str(SOURCE_DATE_EPOCH),
        "MTOOLS_SKIP_CHECK": "1",
        "TZ": "UTC",
    }


def syslinux_mbr() -> Path:
    for path in SYSLINUX_MBR_CANDIDATES:
        if path.is_file():
            return path
    raise ToolError("syslinux's mbr.bin is missing; install the syslinux-common package")


def make_boot_partition(
    out: Path, *, layout: Layout, label: str, files: dict[str, Path], syslinux: bool = True
) -> None:
    """FAT16 file system in a file, syslinux installed (if asked), ``files`` copied to its root."""
    env = _fixed_env()
    # --invariant fixes every generated value; the -i after it then sets our volume id
    run(
        [
            "mkfs.fat", "-F", "16", "-n", label, "--invariant", "-i", FAT_VOLUME_ID,
            "-h", str(layout.boot_start), "-C", str(out), str(layout.boot_sectors * SECTOR // 1024),
        ],
        what="create the FAT16 boot file system",
        env=env,
    )  # fmt: skip
    if syslinux:
        run(["syslinux", "--install", str(out)], what="install syslinux into the boot file system", env=env)
    for name, src in sorted(files.items()):
        os.utime(src, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH))
        run(
            ["mcopy", "-o", "-m", "-i", str(out), str(src), f"::/{name}"],
            what=f"copy {name} into the boot file system",
            env=env,
        )
    fix_fat_root_timestamps(out, SOURCE_DATE_EPOCH)


def _fat_datetime(epoch: int) -> tuple[int, int]:
    t = time.gmtime(epoch)
    fat_time = (t.tm_hour << 11) | (t.tm_min << 5) | (t.tm_sec // 2)
    fat_date = ((t.tm_year - 1980) << 9) | (t.tm_mon << 5) | t.tm_mday
    return fat_time, fat_date


def fix_fat_root_timestamps(image: Path, epoch: int) -> None:
    """Stamp every root-directory entry of a FAT12/16 image with ``epoch`` (tools use 'now')."""
    fat_time, fat_date = _fat_datetime(epoch)
    with image.open("r+b") as f:
        bs = f.read(512)
        bytes_per_sector, _spc, reserved, nfats, root_entries = struct.unpack_from("<HBHBH", bs, 11)
        sectors_per_fat = struct.unpack_from("<H", bs, 22)[0]
        if sectors_per_fat == 0 or root_entries == 0:
            raise BuildError(f"{image} is not a FAT12/16 file system; cannot fix its timestamps")
        root_off = (reserved + nfats * sectors_per_fat) * bytes_per_sector
        f.seek(root_off)
        root = bytearray(f.read(root_entries * 32))
        for i in range(0, len(root), 32):
            first = root[i]
            if first == 0x00:
                break
            if first == 0xE5 or root[i + 11] == 0x0F:  # deleted / long-name entry
                continue
            root[i + 13] = 0  # creation time, 10 ms units
            struct.pack_into("<HHH", root, i + 14, fat_time, fat_date, fat_date)  # ctime, cdate, adate
            struct.pack_into("<HH", root, i + 22, fat_time, fat_date)  # mtime, mdate
        f.seek(root_off)
        f.write(root)


def tree_paths(content: Path) -> list[str]:
    """Every path below ``content`` as ``/rel/path`` (symlinks listed, never followed), sorted."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(content):  # os.walk does not descend into dir symlinks
        base = Path(dirpath)
        paths += ["/" + (base / n).relative_to(content).as_posix() for n in (*dirnames, *filenames)]
    return sorted(paths)


def make_data_partition(
    out: Path,
    *,
    layout: Layout,
    label: str,
    content: Path,
    mke2fs_conf: Path,
    uuid: str = EXT4_UUID,
    hash_seed: str = EXT4_HASH_SEED,
    inode_fixes: list[str] | None = None,
) -> None:
    """ext4 in a file, populated from ``content`` with ``mkfs.ext4 -d`` (no root, no mount).

    Every timestamp becomes ``SOURCE_DATE_EPOCH``. ``inode_fixes`` are extra ``debugfs`` commands
    run afterwards, e.g. owners and modes an unprivileged build could not give the source files.
    """
    paths = tree_paths(content)
    for rel in [*reversed(paths), "/"]:  # children before their directory (utime of a child is no change)
        os.utime(content / rel.lstrip("/"), (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH), follow_symlinks=False)
    run(
        [
            "mkfs.ext4", "-q", "-F", "-L", label, "-U", uuid,
            "-E", f"root_owner=0:0,hash_seed={hash_seed},nodiscard,lazy_itable_init=0",
            "-d", str(content), str(out), f"{layout.data_mib}M",
        ],
        what="create the ext4 file system",
        env={**_fixed_env(), "MKE2FS_CONFIG": str(mke2fs_conf)},
    )  # fmt: skip
    # mkfs -d copies each source file's ctime, which utime cannot set: stamp them afterwards
    stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime(SOURCE_DATE_EPOCH))
    for rel in ["/", *paths]:
        if '"' in rel or "\n" in rel:
            raise BuildError(f"{rel!r}: debugfs cannot address a path with a double quote or a newline")
    commands = "".join(f'set_inode_field "{p}" ctime {stamp}\n' for p in ["/", *paths])
    commands += "".join(f"{c}\n" for c in inode_fixes or [])
    run(
        ["debugfs", "-w", "-f", "-", str(out)],
        what="fix the ext4 inode times",
        env=_fixed_env(),
        input=commands,
    )


def _copy_sparse(src: Path, dst_fd: int, offset: int) -> None:
    """``dd if=src of=dst seek=offset conv=notrunc,sparse`` (zero blocks stay holes)."""
    block = 1 << 16
    with src.open("rb") as f:
        pos = offset
        while chunk := f.read(block):
            if chunk.count(0) != len(chunk):
                os.pwrite(dst_fd, chunk, pos)
            pos += len(chunk)


def assemble(out: Path, *, layout: Layout, boot: Path, data: Path, bootable: bool = True) -> None:
    """Partition table with sfdisk, syslinux's MBR code, then both partitions at their offsets."""
    with out.open("wb") as f:
        f.truncate(layout.total_bytes)
    script = (
        "label: dos\n"
        f"label-id: 0x{DISK_ID:08x}\n"
        "unit: sectors\n\n"
        f"start={layout.boot_start}, size={layout.boot_sectors}, type={TYPE_FAT16_LBA:x}"
        f"{', bootable' if bootable else ''}\n"
        f"start={layout.data_start}, size={layout.data_sectors}, type={TYPE_LINUX:x}\n"
    )
    run(
        ["sfdisk", "--no-reread", "--no-tell-kernel", "-q", str(out)],
        what="write the partition table",
        input=script,
    )
    fd = os.open(out, os.O_WRONLY)
    try:
        if bootable:
            os.pwrite(fd, syslinux_mbr().read_bytes()[:440], 0)  # boot code only, keeps the table
        _copy_sparse(boot, fd, layout.boot_start * SECTOR)
        _copy_sparse(data, fd, layout.data_start * SECTOR)
    finally:
        os.close(fd)


def to_qcow2(raw: Path, out: Path, *, compress: bool = False) -> None:
    argv = ["qemu-img", "convert", "-f", "raw", "-O", "qcow2"]
    if compress:
        argv.append("-c")
    run([*argv, str(raw), str(out)], what="convert the disk to qcow2")


def read_partitions(raw: bytes) -> list[dict[str, int | bool]]:
    """Parse the 4 primary MBR entries (for tests and inspection)."""
    if raw[510:512] != b"\x55\xaa":
        raise BuildError("no MBR boot signature (55 AA) at byte 510")
    parts = []
    for i in range(4):
        entry = raw[446 + 16 * i : 446 + 16 * (i + 1)]
        status, ptype, start, size = entry[0], entry[4], *struct.unpack_from("<II", entry, 8)
        if ptype:
            parts.append({"bootable": status == 0x80, "type": ptype, "start": start, "sectors": size})
    return parts
