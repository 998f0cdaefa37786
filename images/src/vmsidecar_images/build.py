"""Build a recipe into a cached, content-addressed output directory.

Layout of one build (``<cache>/<name>-<arch>-<hash12>/``)::

    disk.qcow2     bootable BIOS disk (x86_64): MBR, p1 FAT16 syslinux+kernel+initrd, p2 ext4
                   (tiny: the vmdata partition; debian: the root file system)
    vmlinuz        the kernel, for direct kernel boot
    initrd.gz      the initramfs (tiny: the whole busybox guest; debian: Debian's initramfs-tools)
    manifest.json  inputs, pins, file hashes, timings, readiness marker and prompt

The recipe's ``builder`` decides the steps: ``initramfs`` (here) or ``debian`` (:mod:`.debian`).

A directory only exists under its final name once complete (built next to it, then renamed).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vmsidecar_contract.arch import normalize_arch

from . import debian, debs, disk, extras, initramfs, kernel_repack, uefi
from .errors import BuildError
from .recipe import BUILDER_FORMAT, SOURCE_DATE_EPOCH, Recipe, load_recipe

MANIFEST = "manifest.json"
DISK = "disk.qcow2"
KERNEL = "vmlinuz"
INITRD = "initrd.gz"


def cache_root() -> Path:
    """``$VMSIDECAR_IMAGE_CACHE`` or ``~/.cache/vmsidecar/images`` (``$XDG_CACHE_HOME`` honoured)."""
    env = os.environ.get("VMSIDECAR_IMAGE_CACHE")
    return Path(env) if env else debs.cache_home() / "images"


@dataclass
class BuiltImage:
    """One finished build in the cache."""

    dir: Path
    disk: Path
    kernel: Path
    initrd: Path
    manifest: dict = field(repr=False)

    @property
    def label(self) -> str:
        return self.manifest["label"]

    @property
    def cmdline(self) -> str:
        return self.manifest["cmdline"]

    @classmethod
    def load(cls, directory: Path) -> BuiltImage:
        manifest = json.loads((directory / MANIFEST).read_text())
        return cls(
            dir=directory,
            disk=directory / DISK,
            kernel=directory / KERNEL,
            initrd=directory / INITRD,
            manifest=manifest,
        )


def image_dir(name: str, arch: str, input_hash: str) -> Path:
    return cache_root() / f"{name}-{arch}-{input_hash[:12]}"


def _complete(directory: Path, input_hash: str) -> BuiltImage | None:
    try:
        image = BuiltImage.load(directory)
    except (OSError, ValueError):
        return None
    if image.manifest.get("input_hash") != input_hash:
        return None
    if not all(p.is_file() for p in (image.disk, image.kernel, image.initrd)):
        return None
    return image


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_image(
    name: str = "tiny",
    arch: str = "x86_64",
    label: str | None = None,
    force: bool = False,
) -> BuiltImage:
    """Build recipe ``name`` for ``arch`` (or return the cached build with the same inputs)."""
    arch = normalize_arch(arch)
    recipe = load_recipe(name)
    label = label or recipe.default_label
    _check_label(label)
    input_hash = recipe.input_hash(arch=arch, label=label)
    final = image_dir(name, arch, input_hash)
    if not force and (hit := _complete(final, input_hash)):
        return hit
    root = final.parent
    with _lock(root / f".lock-{final.name}"):
        if not force and (hit := _complete(final, input_hash)):
            return hit  # another process finished it while we waited
        for stale in root.glob(f".tmp-{final.name}-*"):  # leftovers of killed builds
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            _build_into(tmp, recipe=recipe, arch=arch, label=label, input_hash=input_hash)
            if final.exists():
                trash = root / f".tmp-{final.name}-old-{os.getpid()}"
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return BuiltImage.load(final)


def lock_recipe(name: str, arch: str = "x86_64") -> dict[str, tuple[str | None, str | None]]:
    """Re-resolve a bootstrapped recipe's packages and rewrite its snapshot in ``versions.toml``.

    Returns what changed, ``package -> (old, new)``; the next build is a new cache entry.

    :raise BuildError: for a recipe without a snapshot (tiny pins each package by hand).
    """
    arch = normalize_arch(arch)
    recipe = load_recipe(name)
    if recipe.base:
        raise BuildError(
            f"recipe {name!r} takes its packages from the {recipe.base!r} build; run "
            f"`vmsidecar-image lock {recipe.base}` (its next build follows)"
        )
    if recipe.builder != "debian":
        raise BuildError(
            f"recipe {name!r} pins each package by hand in {recipe.versions_file}; only bootstrapped "
            "recipes (builder = \"debian\") have a package snapshot to lock"
        )
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".relock-{name}-") as tmp:
        return debian.lock(name, arch, Path(tmp))


def _check_label(label: str) -> None:
    ok = label and len(label) <= 63 and all(c.isalnum() or c in "-_." for c in label)
    if not ok:
        raise BuildError(
            f"label {label!r} is not a valid guest label; use 1-63 characters from letters, digits, '-', '_', '.'"
        )


def _build_into(out: Path, *, recipe: Recipe, arch: str, label: str, input_hash: str) -> None:
    """Run the recipe's builder in ``out`` and write the manifest (fields shared by every builder)."""
    t0 = last = time.monotonic()
    steps: dict[str, float] = {}

    def step(name: str) -> None:
        nonlocal last
        now = time.monotonic()
        steps[name] = round(now - last, 3)
        last = now

    work = out / "work"
    work.mkdir()
    if recipe.builder == "debian":
        specific = debian.build(work, recipe=recipe, arch=arch, label=label, disk_out=out / DISK,
                                kernel_out=out / KERNEL, initrd_out=out / INITRD, step=step)
    elif recipe.builder == "uefi":
        specific = _build_from_base(out, work, recipe=recipe, arch=arch, label=label, step=step)
    else:
        specific = _build_initramfs_guest(out, work, recipe=recipe, arch=arch, label=label, step=step)
    shutil.rmtree(work)
    hashes = {}
    for fname in (DISK, KERNEL, INITRD):
        path = out / fname
        hashes[fname] = {"sha256": debs.sha256_file(path), "size": path.stat().st_size}
    manifest = {
        "name": recipe.name,
        "arch": arch,
        "label": label,
        "input_hash": input_hash,
        "builder_format": BUILDER_FORMAT,
        "source_date_epoch": SOURCE_DATE_EPOCH,
        **specific,
        "files": hashes,
        "ready_marker": recipe.ready_marker,
        "ready_regex": rf"{recipe.ready_marker} image=(?P<label>\S+) uptime=(?P<uptime>[0-9.]+)",
        "prompt": recipe.prompt,
        "build_seconds": round(time.monotonic() - t0, 3),
        "build_steps": steps,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for fname in (DISK, KERNEL, INITRD, MANIFEST):
        os.chmod(out / fname, 0o444)  # the cache is read-only: boots use overlays


def _build_from_base(
    out: Path, work: Path, *, recipe: Recipe, arch: str, label: str, step: Callable[[str], None]
) -> dict[str, object]:
    """A recipe built from another's build (``base``): the base comes from the cache (or is built
    first), its kernel and initramfs are copied, the builder makes the disk."""
    assert recipe.base is not None
    base = build_image(recipe.base, arch=arch, label=label)
    step("base_build")
    shutil.copyfile(base.kernel, out / KERNEL)
    shutil.copyfile(base.initrd, out / INITRD)
    specific = uefi.build(work, recipe=recipe, arch=arch, base_disk=base.disk, kernel=base.kernel,
                          initrd=base.initrd, cmdline=base.cmdline, disk_out=out / DISK, step=step)
    return {
        "pins": recipe.arch_pins(arch).as_dict(),
        "base": {"name": base.manifest["name"], "input_hash": base.manifest["input_hash"], "dir": base.dir.name,
                 "disk_sha256": base.manifest["files"][DISK]["sha256"]},
        "cmdline": base.cmdline,
        **specific,
        "guest": base.manifest.get("guest", {}),
    }


def _build_initramfs_guest(
    out: Path, work: Path, *, recipe: Recipe, arch: str, label: str, step: Callable[[str], None]
) -> dict[str, object]:
    """The tiny guest: busybox initramfs (+ tools, out-of-tree modules) on the BIOS disk."""
    # what is built: after a kernel ABI bump, the kernel apt offers now (the manifest records it)
    pins = debs.follow_kernel_abi(recipe.arch_pins(arch), versions_file=recipe.versions_file)
    arch_cfg = recipe.arch_config(arch)
    release = pins.kernel_release
    if pins.busybox is None:
        raise BuildError(f"{recipe.versions_file} pins no busybox for {arch}")

    # 1. pinned packages (cached .debs) -> extracted trees
    kernel_deb = debs.fetch(pins.kernel, pins.deb_arch, versions_file=recipe.versions_file)
    busybox_deb = debs.fetch(pins.busybox, pins.deb_arch, versions_file=recipe.versions_file)
    fallback_busybox = None
    if pins.deb_arch != debs._host_deb_arch():
        host_pins = next((p for p in recipe.pins.values() if p.deb_arch == debs._host_deb_arch()), None)
        if host_pins is not None and host_pins.busybox is not None:
            host_bb = debs.fetch(host_pins.busybox, host_pins.deb_arch, versions_file=recipe.versions_file)
            fallback_busybox = debs.extract(host_bb, work / "busybox-host") / "bin" / "busybox"
    step("download")
    kernel_root = debs.extract(kernel_deb, work / "kernel")
    busybox_root = debs.extract(busybox_deb, work / "busybox")
    step("extract")
    # 2. out-of-tree modules (gpio-virtio), then the initramfs with the guest tools
    oot: list[Path] = []
    oot_sources = list(recipe.config.get("module_build", {}).get("sources", []))
    if pins.module_build and oot_sources:
        patches = [recipe.dir / p for p in recipe.config["module_build"].get("patches", [])]
        names = extras.build_modules(pins.module_build, pins.deb_arch, oot_sources, release,
                                     versions_file=recipe.versions_file, work=work, dest=work / "oot",
                                     patches=patches)
        oot = [work / "oot" / f"{n}.ko" for n in names]
        step("modules")
    stage_dir = work / "initramfs"
    facts = initramfs.stage(
        recipe=recipe,
        arch=arch,
        label=label,
        kernel_root=kernel_root,
        busybox_root=busybox_root,
        release=release,
        stage_dir=stage_dir,
        fallback_busybox=fallback_busybox,
        oot_modules=oot,
    )
    binaries = list(recipe.config.get("tools", {}).get("binaries", []))
    if pins.tools and binaries:
        facts.update(extras.stage_tools(pins.tools, pins.deb_arch, binaries, versions_file=recipe.versions_file,
                                        work=work, stage_dir=stage_dir))
    initramfs.pack(stage_dir, out / INITRD)
    vmlinuz = kernel_root / "boot" / f"vmlinuz-{release}"
    if not vmlinuz.is_file():
        raise BuildError(f"{pins.kernel.package} has no boot/vmlinuz-{release}; check the kernel pin")
    step("initramfs")
    if compression := arch_cfg.get("kernel_repack"):
        if "source" not in pins.module_build:
            raise BuildError(f"kernel_repack needs the linux-source pin (module_build.source) in {recipe.versions_file}")
        vmlinuz = kernel_repack.repack(
            vmlinuz, kernel_root / "boot" / f"config-{release}", compression=str(compression),
            source=pins.module_build["source"], patch=recipe.dir / str(recipe.config["kernel_repack"]["patch"]),
            versions_file=recipe.versions_file, work=work / "kernel-repack")
        facts["kernel_repack"] = str(compression)
        step("kernel")
    shutil.copyfile(vmlinuz, out / KERNEL)

    # 3. disk: p1 FAT16 (syslinux, kernel, initrd), p2 ext4 (vmdata), MBR, qcow2
    dcfg = recipe.config["disk"]
    layout = disk.Layout(
        boot_mib=int(arch_cfg.get("boot_mib", dcfg["boot_mib"])),
        data_mib=int(arch_cfg.get("data_mib", dcfg["data_mib"])),
    )
    cmdline = str(arch_cfg["cmdline"])
    bootable = bool(arch_cfg.get("bootable_disk", True))
    boot_img, data_img, raw = work / "p1.img", work / "p2.img", work / "disk.img"
    files = {KERNEL: out / KERNEL, INITRD: out / INITRD}
    if bootable:
        cfg = work / "syslinux.cfg"
        cfg.write_text((recipe.dir / "syslinux.cfg.in").read_text().replace("@CMDLINE@", cmdline))
        files["syslinux.cfg"] = cfg
    # without a BIOS (aarch64 -M virt) p1 still carries kernel + initrd, as plain files
    disk.make_boot_partition(
        boot_img,
        layout=layout,
        label=str(dcfg.get("boot_label", "VMSBOOT")),
        files=files,
        syslinux=bootable,
    )
    content = work / "data"
    content.mkdir()
    (content / "README").write_text(
        f"vmsidecar data partition of image {label!r} (ext4, LABEL={dcfg['data_label']}), "
        "mounted read-write at /data.\n"
    )
    disk.make_data_partition(
        data_img,
        layout=layout,
        label=str(dcfg["data_label"]),
        content=content,
        mke2fs_conf=recipe.dir / "mke2fs.conf",
    )
    disk.assemble(raw, layout=layout, boot=boot_img, data=data_img, bootable=bootable)
    disk.to_qcow2(raw, out / DISK, compress=bool(arch_cfg.get("qcow2_compress", False)))
    step("disk")

    return {
        "pins": pins.as_dict(),
        "debs": {
            "kernel": {"file": kernel_deb.name, "sha256": debs.sha256_file(kernel_deb)},
            "busybox": {"file": busybox_deb.name, "sha256": debs.sha256_file(busybox_deb)},
        },
        "cmdline": cmdline,
        "boot": "bios-disk" if bootable else "direct-kernel",
        "disk": {
            "format": "qcow2",
            "virtual_size": layout.total_bytes,
            "partitions": _partitions(layout, bootable=bootable, data_label=str(dcfg["data_label"])),
        },
        "guest": facts,
    }


def _partitions(layout: disk.Layout, *, bootable: bool, data_label: str) -> list[dict]:
    boot_content = ["ldlinux.sys", "ldlinux.c32", "syslinux.cfg"] if bootable else []
    return [
        {
            "number": 1,
            "fs": "vfat",
            "type": f"0x{disk.TYPE_FAT16_LBA:02x}",
            "bootable": bootable,
            "start_sector": layout.boot_start,
            "sectors": layout.boot_sectors,
            "content": [*boot_content, KERNEL, INITRD],
        },
        {
            "number": 2,
            "fs": "ext4",
            "type": f"0x{disk.TYPE_LINUX:02x}",
            "label": data_label,
            "start_sector": layout.data_start,
            "sectors": layout.data_sectors,
            "mount": "/data",
        },
    ]


def list_images() -> list[BuiltImage]:
    """Every complete build in the cache, newest first."""
    root = cache_root()
    if not root.is_dir():
        return []
    images = []
    for d in root.iterdir():
        if d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        with contextlib.suppress(OSError, ValueError):
            images.append(BuiltImage.load(d))
    return sorted(images, key=lambda i: (i.dir / MANIFEST).stat().st_mtime, reverse=True)
