"""The busybox initramfs: busybox + applet links, kernel modules (+deps, depmod), recipe files."""

from __future__ import annotations

import gzip
import io
import lzma
import os
import shutil
import subprocess
from pathlib import Path

from .cpio import Entry, char_device, entries_from_tree, write_cpio
from .debs import run
from .errors import BuildError
from .recipe import SOURCE_DATE_EPOCH, Recipe, guest_file_mode

#: where the lists end up inside the guest (read by /etc/rcS)
GUEST_MODULES_BOOT = "etc/vmsidecar/modules.boot"
GUEST_MODULES_EXTRA = "etc/vmsidecar/modules.extra"
GUEST_LABEL_FILE = "etc/vmsidecar-image"

_EMPTY_DIRS = ("dev", "proc", "sys", "run", "tmp", "mnt", "root", "data", "var/log", "var/run", "etc/acpi")
#: kept from the kernel package next to the modules (depmod writes the rest)
_MODULE_META = ("modules.order", "modules.builtin", "modules.builtin.modinfo")


def busybox_applets(busybox_root: Path, fallback_busybox: Path | None = None) -> list[str]:
    """Applet paths (``bin/sh``, ``sbin/modprobe``, ...) from ``busybox --list-full``.

    A foreign-architecture busybox cannot run here; then ``fallback_busybox`` (the host build of the
    same pinned version) answers, which has the same applet set on Debian.
    """
    for binary in (busybox_root / "bin" / "busybox", fallback_busybox):
        if binary is None:
            continue
        try:
            out = subprocess.run([str(binary), "--list-full"], capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            continue
        return sorted(line.strip() for line in out.stdout.splitlines() if line.strip())
    raise BuildError(
        f"cannot list the applets of {busybox_root / 'bin' / 'busybox'} (foreign architecture and no "
        "host busybox-static of the same version); install qemu-user-static or build x86_64 first"
    )


def resolve_modules(kernel_root: Path, release: str, names: list[str]) -> list[Path]:
    """The .ko files (relative to the modules dir) for ``names`` and all their (soft)dependencies."""
    moddir = kernel_root / "lib" / "modules" / release
    if not moddir.is_dir():
        raise BuildError(f"the kernel package has no lib/modules/{release}; check the kernel pin")
    run(["depmod", "-b", str(kernel_root), release], what="index the kernel package's modules")
    wanted: list[Path] = []
    for name in names:
        out = run(
            ["modprobe", "-d", str(kernel_root), "-S", release, "--show-depends", name],
            what=f"resolve the dependencies of module {name}",
        )
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod":
                rel = Path(parts[1]).resolve().relative_to(moddir.resolve())
                if rel not in wanted:
                    wanted.append(rel)
            # "builtin NAME" lines: compiled into the kernel, nothing to ship
    return wanted


def _copy_module(src: Path, dst: Path) -> Path:
    """Copy one module, decompressing .ko.xz / .ko.gz / .ko.zst (busybox modprobe wants plain .ko)."""
    name = src.name
    data = src.read_bytes()
    if name.endswith(".ko.xz"):
        data, name = lzma.decompress(data), name[:-3]
    elif name.endswith(".ko.gz"):
        data, name = gzip.decompress(data), name[:-3]
    elif name.endswith(".ko.zst"):
        data = subprocess.run(["zstd", "-dc", str(src)], capture_output=True, check=True).stdout
        name = name[:-4]
    out = dst.parent / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


def stage(
    *,
    recipe: Recipe,
    arch: str,
    label: str,
    kernel_root: Path,
    busybox_root: Path,
    release: str,
    stage_dir: Path,
    fallback_busybox: Path | None = None,
    oot_modules: list[Path] | None = None,
) -> dict[str, object]:
    """Fill ``stage_dir`` with the guest's root file system; returns facts for the manifest.

    ``oot_modules`` (built out of tree) go to ``lib/modules/<release>/extra/`` before depmod.
    """
    for d in _EMPTY_DIRS:
        (stage_dir / d).mkdir(parents=True, exist_ok=True)

    # busybox + applet symlinks; never the applet named "busybox" (it would replace the binary)
    (stage_dir / "bin").mkdir(exist_ok=True)
    shutil.copyfile(busybox_root / "bin" / "busybox", stage_dir / "bin" / "busybox")
    os.chmod(stage_dir / "bin" / "busybox", 0o755)
    applets = busybox_applets(busybox_root, fallback_busybox)
    for applet in applets:
        if Path(applet).name == "busybox":
            continue
        link = stage_dir / applet
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(stage_dir / "bin" / "busybox", link.parent)
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target)
    if not (stage_dir / "sbin" / "modprobe").is_symlink():
        (stage_dir / "sbin").mkdir(exist_ok=True)
        (stage_dir / "sbin" / "modprobe").symlink_to("../bin/busybox")
    (stage_dir / "init").symlink_to("bin/busybox")

    # kernel modules + their dependencies, then a depmod of just those
    boot = recipe.module_list("modules_boot") + list(recipe.arch_config(arch).get("modules_boot_extra", []))
    extra = recipe.module_list("modules_extra")
    src_moddir = kernel_root / "lib" / "modules" / release
    dst_moddir = stage_dir / "lib" / "modules" / release
    compressed = False
    shipped: list[str] = []
    for rel in resolve_modules(kernel_root, release, boot + extra):
        compressed |= rel.suffix != ".ko"
        out = _copy_module(src_moddir / rel, dst_moddir / rel)
        shipped.append(out.relative_to(dst_moddir).as_posix())
    for meta in _MODULE_META:
        if (src_moddir / meta).is_file():
            shutil.copyfile(src_moddir / meta, dst_moddir / meta)
    order = dst_moddir / "modules.order"
    if order.is_file():  # keep only what is shipped, so depmod does not index missing files
        keep = set(shipped)
        lines = [ln for ln in order.read_text().splitlines() if ln in keep]
        order.write_text("".join(f"{ln}\n" for ln in lines))
    for ko in oot_modules or []:
        (dst_moddir / "extra").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ko, dst_moddir / "extra" / ko.name)
        shipped.append(f"extra/{ko.name}")
    run(["depmod", "-b", str(stage_dir), release], what="index the initramfs modules")

    # recipe files (rootfs/), then generated ones
    shutil.copytree(recipe.dir / "rootfs", stage_dir, symlinks=True, dirs_exist_ok=True)
    (stage_dir / GUEST_MODULES_BOOT).write_text("".join(f"{m}\n" for m in boot))
    (stage_dir / GUEST_MODULES_EXTRA).write_text("".join(f"{m}\n" for m in extra))
    (stage_dir / GUEST_LABEL_FILE).write_text(label + "\n")
    (stage_dir / "etc" / "hostname").write_text(label + "\n")
    (stage_dir / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (stage_dir / "etc" / "group").write_text("root:x:0:\ntty:x:5:\n")
    for path in stage_dir.rglob("*"):  # deterministic permissions whatever the checkout's umask
        if path.is_file() and not path.is_symlink():
            os.chmod(path, guest_file_mode(path.read_bytes()[:4], path.name))
    return {
        "kernel_release": release,
        "modules_boot": boot,
        "modules_extra": extra,
        "modules_shipped": sorted(shipped),
        "modules_compressed_in_package": compressed,
        "busybox_applets": len(applets),
    }


def pack(stage_dir: Path, out: Path) -> None:
    """Write ``stage_dir`` as a gzip'd newc cpio (+ /dev/console and /dev/null nodes)."""
    entries: list[Entry] = entries_from_tree(stage_dir)
    entries += [char_device("dev/console", 5, 1, 0o600), char_device("dev/null", 1, 3, 0o666)]
    buf = io.BytesIO()
    write_cpio(buf, entries, mtime=SOURCE_DATE_EPOCH)
    # gzip header: no file name, mtime 0 -> identical bytes for identical input
    out.write_bytes(gzip.compress(buf.getvalue(), compresslevel=9, mtime=0))
