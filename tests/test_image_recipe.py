"""The tiny guest recipe: build, cache, disk layout, initramfs content, pin errors.

Booting the image is tested through the runtime (which owns the QEMU command line).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import re
import stat
import struct
import subprocess
import time
from pathlib import Path

import pytest

from vmsidecar_images import build as build_mod
from vmsidecar_images import debs, disk, kernel_repack
from vmsidecar_images.build import BuiltImage, build_image, list_images
from vmsidecar_images.cli import main as cli_main
from vmsidecar_images.cpio import Entry, read_cpio, write_cpio
from vmsidecar_images.errors import BuildError, PinError
from vmsidecar_images.recipe import ArchPins, Pin, load_recipe


def _raw(image: BuiltImage, tmp_path: Path) -> Path:
    raw = tmp_path / "disk.img"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(image.disk), str(raw)], check=True)
    return raw


def _initramfs(image: BuiltImage) -> dict[str, Entry]:
    return read_cpio(gzip.decompress(image.initrd.read_bytes()))


def test_recipe_builds(tiny_image: BuiltImage) -> None:
    m = tiny_image.manifest
    for path in (tiny_image.disk, tiny_image.kernel, tiny_image.initrd, tiny_image.dir / "manifest.json"):
        assert path.is_file()
    assert (m["name"], m["arch"], m["label"]) == ("tiny", "x86_64", "tiny")
    assert tiny_image.dir.name == f"tiny-x86_64-{m['input_hash'][:12]}"
    assert m["ready_marker"] == "VMSIDECAR-READY"
    assert m["prompt"] == "vm# "
    assert m["pins"]["kernel"]["package"].startswith("linux-image-6.1.0-")
    assert m["pins"]["busybox"]["package"] == "busybox-static"
    for name, info in m["files"].items():
        data = (tiny_image.dir / name).read_bytes()
        assert info["size"] == len(data)
        assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert m["cmdline"] == "console=ttyS0,115200 console=hvc0 panic=-1 quiet no_timer_check"
    assert not tiny_image.disk.stat().st_mode & 0o222, "cached disk must be read-only"


def test_cache_hit_is_fast_and_downloads_nothing(
    tiny_image: BuiltImage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_download(*args: object, **kwargs: object) -> Path:
        raise AssertionError("a cache hit must not fetch packages")

    monkeypatch.setattr(debs, "fetch", no_download)
    t0 = time.monotonic()
    again = build_image("tiny")
    elapsed = time.monotonic() - t0
    assert again.dir == tiny_image.dir
    assert again.manifest["input_hash"] == tiny_image.manifest["input_hash"]
    assert elapsed < 5, f"cache hit took {elapsed:.2f} s"
    assert tiny_image.dir in [i.dir for i in list_images()]


def test_second_label_is_a_distinct_image(tiny_image: BuiltImage, tiny_b_image: BuiltImage) -> None:
    assert tiny_b_image.dir != tiny_image.dir
    assert tiny_b_image.manifest["label"] == "tiny-b"
    files = _initramfs(tiny_b_image)
    assert files["etc/vmsidecar-image"].data == b"tiny-b\n"
    assert (
        tiny_b_image.manifest["files"]["disk.qcow2"]["sha256"]
        != tiny_image.manifest["files"]["disk.qcow2"]["sha256"]
    )


def test_disk_layout(tiny_image: BuiltImage, tmp_path: Path) -> None:
    raw = _raw(tiny_image, tmp_path)
    data = raw.read_bytes()
    assert data[510:512] == b"\x55\xaa", "MBR boot signature"
    assert data[:440] == disk.syslinux_mbr().read_bytes()[:440], "syslinux MBR boot code"
    parts = disk.read_partitions(data)
    assert [(p["type"], p["bootable"]) for p in parts] == [(0x0E, True), (0x83, False)]
    p1, p2 = parts
    assert p1["start"] == 2048
    assert p2["start"] == p1["start"] + p1["sectors"]
    assert (p2["start"] + p2["sectors"]) * 512 == len(data)
    assert p2["sectors"] * 512 == 64 << 20

    # p1: FAT16 with syslinux, its config, the kernel and the initrd (read with mtools, no mount)
    at = f"{raw}@@{p1['start'] * 512}"
    listing = subprocess.run(["mdir", "-a", "-b", "-i", at, "::/"], capture_output=True, text=True, check=True,
                             env={"MTOOLS_SKIP_CHECK": "1", "PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
    names = {line.strip().lstrip(":/").lower() for line in listing.splitlines() if line.strip()}
    assert {"ldlinux.sys", "ldlinux.c32", "syslinux.cfg", "vmlinuz", "initrd.gz"} <= names
    cfg = subprocess.run(["mtype", "-i", at, "::/syslinux.cfg"], capture_output=True, text=True, check=True,
                         env={"MTOOLS_SKIP_CHECK": "1", "PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
    assert "LINUX /vmlinuz" in cfg
    assert "INITRD /initrd.gz" in cfg
    assert tiny_image.manifest["cmdline"] in cfg
    boot_sector = data[p1["start"] * 512 : p1["start"] * 512 + 512]
    assert boot_sector[54:62] == b"FAT16   "
    assert boot_sector[39:43] == int(disk.FAT_VOLUME_ID, 16).to_bytes(4, "little"), "fixed volume id"

    # p2: ext4 labelled vmdata (checked on an extracted copy, no mount)
    p2_img = tmp_path / "p2.img"
    p2_img.write_bytes(data[p2["start"] * 512 : (p2["start"] + p2["sectors"]) * 512])
    probe = subprocess.run(["blkid", "-p", "-o", "export", str(p2_img)], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    fields = dict(line.split("=", 1) for line in probe.splitlines() if "=" in line)
    assert fields["TYPE"] == "ext4"
    assert fields["LABEL"] == "vmdata"


def test_kernel_is_debians_own_in_an_lz4_payload(tiny_image: BuiltImage, tmp_path: Path) -> None:
    """The re-packed bzImage boots Debian's kernel byte for byte; only the payload's compression moved."""
    pins = load_recipe("tiny").arch_pins("x86_64")
    kernel_deb = debs.extract(debs.fetch(pins.kernel, pins.deb_arch, versions_file=load_recipe("tiny").versions_file),
                              tmp_path / "deb")  # fmt: skip
    debian = kernel_deb / "boot" / f"vmlinuz-{pins.kernel_release}"
    ours = tiny_image.kernel.read_bytes()
    assert tiny_image.manifest["guest"]["kernel_repack"] == "lz4"
    assert kernel_repack._version(ours) == kernel_repack.unpack(debian).version, "Debian's version string"
    setup_sects = ours[0x1F1] or 4
    offset, length = struct.unpack_from("<II", ours, 0x248)
    start = (setup_sects + 1) * 512 + offset
    compressed = ours[start : start + length]
    assert compressed[:4] == bytes.fromhex("02214c18"), "lz4 legacy frame magic"
    out = subprocess.run(["lz4", "-dc"], input=compressed[:-4], capture_output=True, check=True).stdout
    assert struct.unpack("<I", compressed[-4:])[0] == len(out), "kbuild's size trailer"
    assert hashlib.sha256(out).digest() == hashlib.sha256(kernel_repack.unpack(debian).payload).digest()
    assert len(ours) < 2 * debian.stat().st_size


def test_kernel_repack_refuses_what_it_cannot_rebuild(tmp_path: Path) -> None:
    not_bz = tmp_path / "vmlinuz"
    not_bz.write_bytes(b"\0" * 4096)
    with pytest.raises(BuildError, match="not an x86 bzImage"):
        kernel_repack.unpack(not_bz)
    with pytest.raises(BuildError, match=r"'zstd' is not supported"):
        kernel_repack.repack(not_bz, not_bz, compression="zstd", source=Pin("linux-source-6.1", "1"),
                             patch=not_bz, versions_file=not_bz, work=tmp_path)  # fmt: skip


def test_initramfs_contents(tiny_image: BuiltImage) -> None:
    files = _initramfs(tiny_image)
    recipe = load_recipe("tiny")
    release = tiny_image.manifest["guest"]["kernel_release"]

    init = files["init"]
    assert stat.S_ISLNK(init.mode) and init.data == b"bin/busybox"
    assert stat.S_ISREG(files["bin/busybox"].mode), "the busybox applet link must not replace the binary"
    assert stat.S_ISLNK(files["sbin/modprobe"].mode)
    assert stat.S_ISCHR(files["dev/console"].mode) and files["dev/console"].rdev == (5, 1)
    for d in ("var/log", "data", "proc", "sys", "dev"):
        assert stat.S_ISDIR(files[d].mode), d

    inittab = files["etc/inittab"].data.decode()
    assert "::sysinit:/etc/rcS" in inittab
    assert "/etc/vmsidecar/getty ttyS0" in inittab and "/etc/vmsidecar/getty hvc0" in inittab
    assert "::shutdown:/bin/umount /data" in inittab
    getty = files["etc/vmsidecar/getty"].data.decode()
    assert "getty -n -l /bin/sh 115200" in getty
    assert files["etc/vmsidecar/getty"].mode & 0o111

    rcs = files["etc/rcS"].data.decode()
    assert files["etc/rcS"].mode & 0o111
    assert 'msg="VMSIDECAR-READY image=$label uptime=' in rcs
    assert "/dev/$tty" in rcs and "hvc0" in rcs
    assert rcs.index("ip link set eth0 up") < rcs.index("udhcpc")
    assert "PS1='vm# '" in files["etc/profile"].data.decode()
    assert b"poweroff" in files["etc/acpi/PWRF/00000080"].data
    assert files["etc/vmsidecar-image"].data == b"tiny\n"

    boot = files["etc/vmsidecar/modules.boot"].data.decode().split()
    assert boot == recipe.module_list("modules_boot")
    assert {"virtio_pci", "virtio_console", "virtio_blk", "virtio_net", "ext4", "vfat", "evdev"} <= set(boot)
    moddir = f"lib/modules/{release}"
    dep = files[f"{moddir}/modules.dep"].data.decode()
    shipped = {Path(p).name for p in tiny_image.manifest["guest"]["modules_shipped"]}
    for mod in ("slcan.ko", "vcan.ko", "kvaser_pci.ko", "sja1000.ko", "can-dev.ko", "can-raw.ko", "ext4.ko"):
        assert mod in shipped
        assert any(path.endswith(f"/{mod}") for path in files), mod
    assert "kvaser_pci.ko: kernel/drivers/net/can/sja1000/sja1000.ko" in dep


def test_cpio_writer_roundtrip() -> None:
    entries = [
        Entry("bin", stat.S_IFDIR | 0o755),
        Entry("bin/sh", stat.S_IFLNK | 0o777, b"busybox"),
        Entry("bin/busybox", stat.S_IFREG | 0o755, b"\x7fELF..."),
    ]
    a, b = io.BytesIO(), io.BytesIO()
    write_cpio(a, entries, mtime=1)
    write_cpio(b, list(reversed(entries)), mtime=1)
    assert a.getvalue() == b.getvalue(), "order of input must not matter"
    assert len(a.getvalue()) % 4 == 0
    back = read_cpio(a.getvalue())
    assert back["bin/busybox"].data == b"\x7fELF..."
    assert back["bin/sh"].data == b"busybox"
    # GNU cpio agrees with our reading
    listing = subprocess.run(["cpio", "-it", "--quiet"], input=a.getvalue(), capture_output=True, check=True)
    assert listing.stdout.decode().split() == ["bin", "bin/busybox", "bin/sh"]


def test_stale_pin_names_package_versions_and_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The fault is real: apt itself answers that the version does not exist."""
    monkeypatch.setenv("VMSIDECAR_IMAGE_CACHE", str(tmp_path / "images"))
    real_load = build_mod.load_recipe
    bogus = "0.0.0-vmsidecar-nonexistent"

    def load_with_bad_pin(name: str = "tiny"):
        recipe = real_load(name)
        pins = recipe.pins["x86_64"]
        recipe.pins["x86_64"] = dataclasses.replace(
            pins, kernel=dataclasses.replace(pins.kernel, version=bogus)
        )
        return recipe

    monkeypatch.setattr(build_mod, "load_recipe", load_with_bad_pin)
    with pytest.raises(PinError) as err:
        build_image("tiny")
    msg = str(err.value)
    recipe = real_load("tiny")
    package = recipe.pins["x86_64"].kernel.package
    assert package in msg
    assert bogus in msg
    assert str(recipe.versions_file) in msg
    offered = debs.apt_versions(package)
    assert offered, f"apt should still offer {package}"
    assert all(v in msg for v in offered)
    assert not list((tmp_path / "images").glob("tiny-*")), "a failed build must leave no image behind"


def test_a_pin_the_archive_replaced_by_a_rebuild_of_the_same_release_is_taken_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The archive keeps one revision of a package: a security rebuild (``-2`` -> ``-3``) removes the
    pinned one and every fresh build stopped (it happened to ``linux-kbuild-6.1``). The fault is
    real: apt is asked for a revision it has never had, of a release it offers."""
    busybox = load_recipe("tiny").pins["x86_64"].busybox
    assert busybox is not None
    offered = debs.apt_versions(busybox.package)
    assert busybox.version in offered
    gone = Pin(busybox.package, f"{debs.upstream_release(busybox.version)}-0vmsidecar.gone1")
    versions_file = tmp_path / "versions.toml"
    with caplog.at_level("WARNING", logger="vmsidecar_images.debs"):
        deb = debs.fetch(gone, "amd64", versions_file=versions_file, cache_dir=tmp_path / "debs")
    assert deb.parent == tmp_path / "debs"
    used = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True)
    assert used.stdout.strip() in offered
    assert debs.upstream_release(used.stdout.strip()) == debs.upstream_release(busybox.version)
    said = caplog.text
    assert gone.version in said and used.stdout.strip() in said and str(versions_file) in said
    # another upstream release is not a rebuild: the build stops and names the file to edit
    other = Pin(busybox.package, "1:0.1-1")
    with pytest.raises(PinError, match="cannot be downloaded"):
        debs.fetch(other, "amd64", versions_file=versions_file, cache_dir=tmp_path / "debs")


def test_the_exact_pins_switch_stops_at_a_rebuild(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    busybox = load_recipe("tiny").pins["x86_64"].busybox
    assert busybox is not None
    gone = Pin(busybox.package, f"{debs.upstream_release(busybox.version)}-0vmsidecar.gone1")
    monkeypatch.setenv(debs.EXACT_PINS_ENV, "1")
    with pytest.raises(PinError, match="cannot be downloaded"):
        debs.fetch(gone, "amd64", versions_file=tmp_path / "versions.toml", cache_dir=tmp_path / "debs")
    assert debs.offered(gone, versions_file=tmp_path / "versions.toml") == gone


def test_the_debian_kernel_pin_follows_a_rebuild_of_its_release(caplog: pytest.LogCaptureFixture) -> None:
    """mmdebstrap installs the kernel by ``PKG=VERSION``: a replaced revision is asked for as apt's."""
    recipe = load_recipe("debian")
    kernel = recipe.pins["x86_64"].kernel
    if kernel.version in debs.apt_versions(kernel.package):  # the pin itself while apt has it
        assert debs.offered(kernel, versions_file=recipe.versions_file) == kernel
    gone = Pin(kernel.package, f"{debs.upstream_release(kernel.version)}-0vmsidecar.gone1")
    with caplog.at_level("WARNING", logger="vmsidecar_images.debs"):
        took = debs.offered(gone, versions_file=recipe.versions_file)
    assert took.package == kernel.package
    assert took.version in debs.apt_versions(kernel.package)
    assert debs.upstream_release(took.version) == debs.upstream_release(kernel.version)
    assert gone.version in caplog.text and took.version in caplog.text
    other = Pin(kernel.package, "0.1-1")
    assert debs.offered(other, versions_file=recipe.versions_file) == other  # mmdebstrap says "not found"


def test_a_moved_archive_builds_the_debian_guest_with_a_warning_and_a_record(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The archive keeps one version of each package, so the snapshot of 139 goes stale with the next
    security update: the build goes on with what apt installed, says so and records it; the exact
    pins switch stops it, naming what moved."""
    from vmsidecar_images import debian

    recipe = load_recipe("debian")
    pins = recipe.pins["x86_64"]
    assert debian.check_snapshot(dict(pins.packages), pins, recipe) == {}
    installed = dict(pins.packages)
    installed["libc6"] = installed["libc6"] + "+vmsidecar1"
    dropped = sorted(installed)[0]
    del installed[dropped]
    installed["vmsidecar-new-dependency"] = "1.0-1"
    with caplog.at_level("WARNING", logger="vmsidecar_images.debian"):
        moved = debian.check_snapshot(installed, pins, recipe)
    assert moved == {
        "libc6": [pins.packages["libc6"], installed["libc6"]],
        dropped: [pins.packages[dropped], None],
        "vmsidecar-new-dependency": [None, "1.0-1"],
    }
    assert "libc6" in caplog.text and str(recipe.versions_file) in caplog.text and "lock debian" in caplog.text
    monkeypatch.setenv(debs.EXACT_PINS_ENV, "1")
    with pytest.raises(PinError, match="libc6") as err:
        debian.check_snapshot(installed, pins, recipe)
    assert "vmsidecar-image lock debian" in str(err.value)


def test_upstream_release_drops_only_the_debian_revision() -> None:
    assert debs.upstream_release("6.1.192-2") == "6.1.192"
    assert debs.upstream_release("1:1.35.0-4+deb12u1+b1") == "1:1.35.0"
    assert debs.upstream_release("1:2.66-4+deb12u3+b1") == "1:2.66"
    assert debs.upstream_release("1.0") == "1.0"  # a native package has no revision
    assert debs.upstream_release("2.1-rc1-3") == "2.1-rc1"


def test_failed_build_leaves_nothing_that_looks_complete(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Builds happen in a dot-temp dir renamed at the end; leftovers of killed builds are swept."""
    root = tmp_path / "images"
    monkeypatch.setenv("VMSIDECAR_IMAGE_CACHE", str(root))
    recipe = load_recipe("tiny")
    final = build_mod.image_dir("tiny", "x86_64", recipe.input_hash(arch="x86_64", label="tiny"))
    stale = root / f".tmp-{final.name}-99999"  # as if a build had been SIGKILLed
    stale.mkdir(parents=True)
    (stale / "manifest.json").write_text("{}")

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(disk, "to_qcow2", boom)
    with pytest.raises(OSError, match="simulated"):
        build_image("tiny")
    assert not final.exists()
    assert [p.name for p in root.iterdir() if not p.name.startswith(".lock-")] == []
    assert list_images() == []


def test_cli_build_and_list(tiny_image: BuiltImage, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["build", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_image.dir)
    assert cli_main(["build", "tiny", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["input_hash"] == tiny_image.manifest["input_hash"]
    assert cli_main(["list"]) == 0
    assert str(tiny_image.dir) in capsys.readouterr().out


@pytest.mark.parametrize("command", ["build", "lock"])
def test_cli_names_an_architecture_it_cannot_build(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--arch riscv64`` ended ``build`` in a ValueError traceback; it is a usage error now."""
    with pytest.raises(SystemExit) as ended:
        cli_main([command, "tiny", "--arch", "riscv64"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "unsupported architecture 'riscv64'; use one of x86_64 (amd64) or aarch64 (arm64)" in err, err
    assert "Traceback" not in err


def test_build_is_reproducible(
    tiny_image: BuiltImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh build elsewhere (other time, other directory) gives the same bytes."""
    monkeypatch.setenv("VMSIDECAR_IMAGE_CACHE", str(tmp_path))
    again = build_image("tiny")
    assert again.dir != tiny_image.dir
    assert again.manifest["input_hash"] == tiny_image.manifest["input_hash"]
    for name in ("disk.qcow2", "initrd.gz", "vmlinuz"):
        assert again.manifest["files"][name]["sha256"] == tiny_image.manifest["files"][name]["sha256"], name


def _has_arm64_packages() -> bool:
    out = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True, text=True)
    return "arm64" in out.stdout.split()


@pytest.mark.skipif(
    not _has_arm64_packages(), reason="needs `dpkg --add-architecture arm64 && apt-get update`"
)
def test_aarch64_builds_for_direct_kernel_boot(tmp_path: Path) -> None:
    image = build_image("tiny", arch="aarch64")
    m = image.manifest
    assert (m["arch"], m["boot"]) == ("aarch64", "direct-kernel")
    assert m["cmdline"].startswith("console=ttyAMA0 ")
    assert image.kernel.read_bytes()[56:60] == b"ARM\x64", "arm64 Image magic"
    files = _initramfs(image)
    assert stat.S_ISREG(files["bin/busybox"].mode)
    assert files["bin/busybox"].data[18:20] == (183).to_bytes(2, "little"), "EM_AARCH64 busybox"
    boot = files["etc/vmsidecar/modules.boot"].data.decode().split()
    assert {"virtio_mmio", "gpio_keys"} <= set(boot)
    parts = disk.read_partitions(_raw(image, tmp_path).read_bytes())
    assert [(p["type"], p["bootable"]) for p in parts] == [(0x0E, False), (0x83, False)]


def _with_abi(pins: ArchPins, abi: str, version: str) -> ArchPins:
    """``pins`` as written before a kernel ABI bump: every ABI-named package at ``abi``, every kernel
    package (image, headers, kbuild, source) at ``version``."""
    old = re.search(r"\d+\.\d+\.\d+-\d+", pins.kernel.package)
    assert old is not None

    def aged(pin: Pin) -> Pin:
        return Pin(pin.package.replace(old[0], abi), version)

    return dataclasses.replace(pins, kernel=aged(pins.kernel),
                               module_build={k: aged(p) for k, p in pins.module_build.items()})


def _kernel_apt_installs(metapackage: str) -> str:
    """The ABI package ``metapackage`` depends on today, as apt says it."""
    out = subprocess.run(["apt-cache", "depends", metapackage], capture_output=True, text=True, check=True)
    lines = (ln.strip() for ln in out.stdout.splitlines())
    return next(ln.split()[-1] for ln in lines if ln.startswith("Depends: linux-image-"))


def _ge(version: str, other: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", version, "ge", other], check=False).returncode == 0


def test_a_kernel_abi_bump_is_followed_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An ABI bump renames the kernel packages (``linux-image-6.1.0-56-amd64`` -> ``-57-``) and the
    archive drops the old ones: the build takes the ABI ``linux-image-amd64`` depends on now, with
    headers of the same ABI, and says so. The fault is real: apt is asked for an ABI it does not have."""
    real = load_recipe("tiny").pins["x86_64"]
    stale = _with_abi(real, "6.1.0-1", "6.1.4-1")
    assert debs.apt_versions(stale.kernel.package) == []
    versions_file = tmp_path / "versions.toml"
    with caplog.at_level("WARNING", logger="vmsidecar_images.debs"):
        followed = debs.follow_kernel_abi(stale, versions_file=versions_file)
    current = _kernel_apt_installs("linux-image-amd64")
    assert followed.kernel.package == current
    assert followed.kernel.version in debs.apt_versions(current)
    abi = followed.kernel_release.removesuffix("-amd64")
    assert followed.module_build["headers"].package == f"linux-headers-{abi}-amd64"
    assert followed.module_build["headers_common"].package == f"linux-headers-{abi}-common"
    assert followed.module_build["kbuild"].package == real.module_build["kbuild"].package
    assert followed.module_build["source"].package == real.module_build["source"].package
    for key, pin in followed.module_build.items():
        offered = debs.apt_versions(pin.package)
        assert pin.version in offered, key
        if followed.kernel.version in offered:  # the kernel's version, else apt's newest
            assert pin.version == followed.kernel.version, key
        else:
            assert all(_ge(pin.version, v) for v in offered), key
    assert (followed.deb_arch, followed.busybox, followed.tools) == (real.deb_arch, real.busybox, real.tools)
    said = caplog.text
    assert stale.kernel.package in said and followed.kernel.spec in said
    assert str(versions_file) in said and debs.EXACT_PINS_ENV in said
    assert stale.module_build["headers"].package in said and followed.module_build["headers"].package in said


def test_the_debian_kernel_follows_an_abi_bump_and_keeps_its_snapshot() -> None:
    """The cloud flavour (``linux-image-<abi>-cloud-amd64``): no module build, the snapshot untouched
    (the bootstrap installs the followed kernel, check_snapshot reports the difference)."""
    real = load_recipe("debian").pins["x86_64"]
    stale = _with_abi(real, "6.1.0-1", "6.1.4-1")
    followed = debs.follow_kernel_abi(stale, versions_file=Path("versions.toml"))
    assert followed.kernel.package == _kernel_apt_installs("linux-image-cloud-amd64")
    assert followed.kernel.version in debs.apt_versions(followed.kernel.package)
    assert (followed.packages, followed.module_build) == (real.packages, {})


def test_a_kernel_apt_offers_is_not_an_abi_bump(caplog: pytest.LogCaptureFixture) -> None:
    """Pins of the kernel apt offers come back as they are, at any version (a replaced revision is
    fetch's rebuild fallback). The kernel is today's (the metapackage's), so this holds after an ABI
    bump too, when the recipes' own pins are the stale ones."""
    for recipe, flavour in (("tiny", "amd64"), ("debian", "cloud-amd64")):
        pins = load_recipe(recipe).pins["x86_64"]
        current = _kernel_apt_installs(f"linux-image-{flavour}")
        for version in (debs.apt_versions(current)[0], "0.0.1-0vmsidecar.gone1"):
            today = dataclasses.replace(pins, kernel=Pin(current, version))
            with caplog.at_level("WARNING", logger="vmsidecar_images.debs"):
                assert debs.follow_kernel_abi(today, versions_file=Path("versions.toml")) == today
    assert caplog.text == ""


def test_the_exact_pins_switch_stops_at_an_abi_bump(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stale = _with_abi(load_recipe("tiny").pins["x86_64"], "6.1.0-1", "6.1.4-1")
    monkeypatch.setenv(debs.EXACT_PINS_ENV, "1")
    with caplog.at_level("WARNING", logger="vmsidecar_images.debs"):
        assert debs.follow_kernel_abi(stale, versions_file=Path("versions.toml")) == stale
    assert caplog.text == ""
