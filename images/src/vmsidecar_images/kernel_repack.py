"""Re-pack a Debian x86 bzImage with an LZ4 payload: the same kernel, decompressed 10x faster.

Why: Debian compresses its kernel with xz, and under TCG (no KVM) the boot stub spends 2.7 s of the
tiny guest's 5.6 s boot decompressing it; with an lz4 payload the same guest is up in 2.8 s. The
kernel itself is Debian's, byte for byte: its payload (``vmlinux.bin`` + relocations) is unpacked
from Debian's bzImage and only the boot stub around it is rebuilt, from the pinned linux-source with
Debian's config (``KERNEL_LZ4`` instead of ``KERNEL_XZ``; no EFI stub, as the disk boots through
syslinux). ``patches/bzimage-from-payload.patch`` lets kbuild take the payload and the four ``VO_``
symbols from files instead of an unstripped ``vmlinux``, which Debian does not ship.

The result is cached by its inputs (the kernel, the source pin, the patch, this module), so the
tiny and tiny-b builds compile the stub once.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from . import debs, extras
from .errors import BuildError
from .recipe import Pin

_XZ_MAGIC = b"\xfd7zXZ\x00"
_ELF64 = b"\x7fELF\x02"
_SUPPORTED = ("lz4",)


@dataclass(frozen=True)
class Bzimage:
    """What the rebuild needs from the distribution's bzImage."""

    payload: bytes           # vmlinux.bin + relocations, as the boot stub decompresses it
    version: str             # "6.1.0-56-amd64 (debian-kernel@lists.debian.org) #1 SMP ..."


def unpack(vmlinuz: Path) -> Bzimage:
    """The xz payload and version string of a bzImage (boot protocol 2.08+: payload fields)."""
    data = vmlinuz.read_bytes()
    if len(data) < 0x270 or data[0x202:0x206] != b"HdrS":
        raise BuildError(f"{vmlinuz.name} is not an x86 bzImage (no HdrS setup header)")
    protocol = struct.unpack_from("<H", data, 0x206)[0]
    if protocol < 0x208:
        raise BuildError(f"{vmlinuz.name} uses boot protocol {protocol:#x}; 2.08+ names its payload")
    setup_sects = data[0x1F1] or 4
    offset, length = struct.unpack_from("<II", data, 0x248)
    start = (setup_sects + 1) * 512 + offset
    compressed = data[start:start + length]
    if not compressed.startswith(_XZ_MAGIC):
        raise BuildError(f"{vmlinuz.name}'s payload is not xz (starts {compressed[:6].hex()}); "
                         "only Debian's xz kernels are re-packed: drop kernel_repack from the recipe")
    dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    payload = dec.decompress(compressed)
    # kbuild appends the decompressed size (le32) after the xz stream
    if not dec.eof or len(dec.unused_data) != 4 or struct.unpack("<I", dec.unused_data)[0] != len(payload):
        raise BuildError(f"{vmlinuz.name}'s xz payload is truncated or its size trailer does not match")
    if not payload.startswith(_ELF64):
        raise BuildError(f"{vmlinuz.name}'s payload is not a 64-bit ELF kernel")
    return Bzimage(payload=payload, version=_version(data))


def vo_symbols(payload: bytes) -> str:
    """``_text``, ``__start_rodata``, ``__bss_start``, ``_end`` in ``nm`` form, from section headers.

    The payload is stripped (no symbol table), but x86_64's vmlinux.lds.S pins each of these to a
    section edge: ``_text`` starts ``.text``, ``__start_rodata`` ``.rodata``, ``__bss_start``
    ``.bss``, and ``_end`` is the end of ``.brk`` rounded up to a page.
    """
    shoff = struct.unpack_from("<Q", payload, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", payload, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", payload, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]

    def name(h: tuple[int, ...]) -> str:
        end = payload.index(b"\0", strtab_off + h[0])
        return payload[strtab_off + h[0]:end].decode()

    sections = {name(h): (h[3], h[5]) for h in headers}  # name -> (address, size)
    missing = {".text", ".rodata", ".bss", ".brk"} - set(sections)
    if missing:
        raise BuildError(f"the kernel payload has no {sorted(missing)} section: not an x86_64 vmlinux")
    brk_addr, brk_size = sections[".brk"]
    end = (brk_addr + brk_size + 0xFFF) & ~0xFFF
    if not sections[".text"][0] < sections[".rodata"][0] < sections[".bss"][0] < end:
        raise BuildError("the kernel payload's sections are not in vmlinux.lds.S order")
    return (f"{sections['.text'][0]:016x} T _text\n{sections['.rodata'][0]:016x} D __start_rodata\n"
            f"{sections['.bss'][0]:016x} B __bss_start\n{end:016x} B _end\n")


def repack(vmlinuz: Path, config: Path, *, compression: str, source: Pin, patch: Path,
           versions_file: Path, work: Path) -> Path:
    """Debian's kernel in a bzImage with a ``compression`` payload (cached); returns its path."""
    if compression not in _SUPPORTED:
        raise BuildError(f"kernel_repack = {compression!r} is not supported; use one of {list(_SUPPORTED)}")
    key = hashlib.sha256()
    for part in (vmlinuz.read_bytes(), config.read_bytes(), patch.read_bytes(), Path(__file__).read_bytes(),
                 f"{source.package}={source.version}:{compression}".encode()):
        key.update(hashlib.sha256(part).digest())
    cached = debs.cache_home() / "kernels" / f"{vmlinuz.name}-{compression}-{key.hexdigest()[:16]}"
    if cached.is_file():
        return cached

    original = unpack(vmlinuz)
    m = re.fullmatch(r"(\S+) \(([^@)]+)@([^)]+)\) (.+)", original.version)
    if not m:
        raise BuildError(f"{vmlinuz.name}'s version string {original.version!r} is not kbuild's form")
    release, user, host, uts_version = m.groups()
    tree = _source_tree(source, versions_file=versions_file, work=work)
    debs.run(["patch", "-p1", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(patch)],
             what=f"apply {patch.name}")
    (work / "payload.bin").write_bytes(original.payload)
    (work / "vo.map").write_text(vo_symbols(original.payload))
    shutil.copyfile(config, tree / ".config")
    debs.run(["bash", "scripts/config", "--disable", "KERNEL_XZ", "--enable", f"KERNEL_{compression.upper()}",
              "--disable", "EFI_STUB", "--disable", "EFI_MIXED", "--disable", "DEBUG_INFO_BTF"],
             what="edit the kernel config", cwd=tree)
    make = ["make", "-s", f"-j{os.cpu_count() or 1}", f"KERNELRELEASE={release}",
            f"VMSIDECAR_PAYLOAD={work / 'payload.bin'}", f"VMSIDECAR_VO_SYMBOLS={work / 'vo.map'}"]
    env = {"KBUILD_BUILD_USER": user, "KBUILD_BUILD_HOST": host, "LC_ALL": "C"}
    hint = "install flex, bison, bc, libelf-dev, libssl-dev and lz4 (scripts/setup does)"
    debs.run([*make, "olddefconfig"], what=f"configure the boot stub ({hint})", cwd=tree, env=env)
    debs.run([*make, "prepare"], what=f"prepare the kernel tree ({hint})", cwd=tree, env=env)
    # the stub's version string is Debian's (the full build would generate it with the kernel)
    (tree / "include" / "generated" / "utsversion.h").write_text(f'#define UTS_VERSION "{uts_version}"\n')
    # generated sources the stub includes (cpu feature names, instruction tables)
    debs.run([*make, "arch/x86/kernel/cpu/capflags.o", "arch/x86/lib/inat.o"],
             what=f"generate the stub's tables ({hint})", cwd=tree, env=env)
    debs.run([*make, "bzImage"], what=f"build the {compression} bzImage ({hint})", cwd=tree, env=env)
    built = tree / "arch" / "x86" / "boot" / "bzImage"
    again = _version(built.read_bytes())
    if again != original.version:
        raise BuildError(f"the rebuilt bzImage says {again!r}, Debian's {original.version!r}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    shutil.copyfile(built, tmp)
    os.replace(tmp, cached)
    shutil.rmtree(tree, ignore_errors=True)
    return cached


def _version(data: bytes) -> str:
    """The setup header's kernel_version string."""
    vo = struct.unpack_from("<H", data, 0x20E)[0] + 0x200
    return data[vo:vo + 256].split(b"\0", 1)[0].decode("ascii", "replace")


def _source_tree(pin: Pin, *, versions_file: Path, work: Path) -> Path:
    """The whole linux-source tree of ``pin`` under ``work`` (~1.5 GB, removed after the build)."""
    deb_root = work / "linux-source-deb"
    tarball = extras.linux_source_tarball(pin, versions_file=versions_file, dest=deb_root)
    debs.run(["tar", "-xaf", str(tarball), "-C", str(work)], what=f"extract {tarball.name}")
    shutil.rmtree(deb_root, ignore_errors=True)
    trees = [p for p in work.iterdir() if (p / "arch" / "x86" / "boot").is_dir()]
    if len(trees) != 1:
        raise BuildError(f"{tarball.name} holds no single kernel tree with arch/x86/boot")
    return trees[0]
