"""Extras of the tiny guest: dynamically linked Debian tools, and out-of-tree kernel modules.

Tools (can-utils, iproute2's ``ip``, libgpiod's ``gpio*``) are copied from their pinned .debs with
the closure of their ``DT_NEEDED`` libraries, resolved inside the pinned library packages only
(never from the build host), plus the program interpreter. Out-of-tree modules (``gpio-virtio``,
which Debian 6.1 does not build) are compiled from the pinned ``linux-source`` file against the
kernel's own pinned headers; the result is stripped of debug info so it does not depend on the
build directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from . import debs
from .errors import BuildError
from .recipe import Pin

_LIB_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu",
             "usr/lib/aarch64-linux-gnu", "lib", "usr/lib")
_NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]")
_INTERP = re.compile(r"Requesting program interpreter: ([^\]]+)\]")


def _resolve(root: Path, rel: str) -> Path:
    """Follow symlinks inside ``root`` (absolute targets are relative to ``root``)."""
    path = root / rel.lstrip("/")
    for _ in range(20):
        if not path.is_symlink():
            return path
        target = os.readlink(path)
        path = root / target.lstrip("/") if target.startswith("/") else path.parent / target
    raise BuildError(f"symlink loop at {rel} in the tools sysroot")


def _find_lib(root: Path, soname: str) -> str | None:
    for d in _LIB_DIRS:
        if (root / d / soname).exists() or (root / d / soname).is_symlink():
            return f"{d}/{soname}"
    return None


def stage_tools(pins: list[Pin], deb_arch: str, binaries: list[str], *, versions_file: Path, work: Path,
                stage_dir: Path) -> dict[str, object]:
    """Copy ``binaries`` (paths inside the packages) to ``usr/bin`` of the guest, with their libraries.

    A busybox applet link of the same name is removed, so the real tool wins whatever PATH says.
    """
    root = work / "tools-sysroot"
    for pin in pins:
        debs.extract(debs.fetch(pin, deb_arch, versions_file=versions_file), root)
    libs: dict[str, str] = {}  # soname -> path in sysroot
    interps: set[str] = set()
    todo: list[Path] = []
    for rel in binaries:
        src = _resolve(root, rel)
        if not src.is_file():
            raise BuildError(f"tool {rel} is not in the pinned tools packages; fix [tools] in recipe.toml")
        name = Path(rel).name
        dst = stage_dir / "usr" / "bin" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o755)
        for d in ("bin", "sbin", "usr/bin", "usr/sbin"):
            link = stage_dir / d / name
            if d != "usr/bin" and link.is_symlink():
                link.unlink()
        todo.append(src)
    seen: set[Path] = set()
    while todo:
        elf = todo.pop()
        if elf in seen:
            continue
        seen.add(elf)
        out = debs.run(["readelf", "-d", "-l", "-W", str(elf)], what=f"read the ELF headers of {elf.name}")
        interps.update(_INTERP.findall(out))
        for soname in _NEEDED.findall(out):
            if soname in libs:
                continue
            found = _find_lib(root, soname)
            if found is None:
                raise BuildError(
                    f"{elf.name} needs {soname}, which no pinned tools package provides; add the Debian "
                    f"package that ships it (`dpkg -S {soname}`) to the tools in versions.toml"
                )
            libs[soname] = found
            todo.append(_resolve(root, found))
    for soname, rel in sorted(libs.items()):
        dst = stage_dir / Path(rel).parent / soname
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_resolve(root, rel), dst)
        os.chmod(dst, 0o755)
    for interp in sorted(interps):
        dst = stage_dir / interp.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_resolve(root, interp), dst)
        os.chmod(dst, 0o755)
    return {"tools": sorted(Path(b).name for b in binaries), "tool_libraries": sorted(libs), "interpreters": sorted(interps)}


def linux_source_tarball(pin: Pin, *, versions_file: Path, dest: Path) -> Path:
    """The ``linux-source-*.tar.*`` of the pinned ``linux-source`` package, extracted under ``dest``."""
    deb = debs.fetch(pin, "all", versions_file=versions_file)
    debs.extract(deb, dest)
    tarballs = sorted((dest / "usr" / "src").glob("linux-source-*.tar.*"))
    if not tarballs:
        raise BuildError(f"{deb.name} holds no usr/src/linux-source-*.tar.*; check the module_build source pin")
    return tarballs[0]


def _kernel_source_file(pin: Pin, member: str, *, versions_file: Path, work: Path) -> Path:
    """One file of the linux-source tarball, cached next to the .debs (the tarball is ~140 MB of xz)."""
    cache = debs.cache_home() / "src" / f"{pin.package}_{pin.version.replace(':', '%3a')}" / member
    if cache.is_file():
        return cache
    tree = work / "linux-source"
    tarball = linux_source_tarball(pin, versions_file=versions_file, dest=tree)
    with tarfile.open(tarball) as tar:
        for info in tar:
            if info.isfile() and info.name.split("/", 1)[-1] == member:
                fh = tar.extractfile(info)
                assert fh is not None
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(".tmp")
                tmp.write_bytes(fh.read())
                os.replace(tmp, cache)
                break
        else:
            raise BuildError(f"{tarball.name} has no {member}; check module_build sources in recipe.toml")
    shutil.rmtree(tree, ignore_errors=True)
    return cache


def build_modules(pins: dict[str, Pin], deb_arch: str, sources: list[str], release: str, *, versions_file: Path,
                  work: Path, dest: Path, patches: list[Path] | None = None) -> list[str]:
    """Build each ``drivers/…/x.c`` of ``sources`` into ``dest/x.ko``; returns the module names.

    ``patches`` (``-p1``, paths like ``drivers/gpio/x.c``) are applied to the sources first.
    """
    missing = {"source", "headers", "headers_common", "kbuild"} - set(pins)
    if missing:
        raise BuildError(f"module_build in versions.toml lacks {sorted(missing)}; pin all four packages")
    hdr_root = work / "headers"
    for key in ("headers", "headers_common", "kbuild"):
        debs.extract(debs.fetch(pins[key], deb_arch, versions_file=versions_file), hdr_root)
    build_dir = hdr_root / "usr" / "src" / f"linux-headers-{release}"
    if not (build_dir / "Makefile").is_file():
        raise BuildError(f"the headers package has no usr/src/linux-headers-{release}; check the headers pin")
    # the packaged Makefile includes the -common tree by absolute path: point it into our extraction
    makefile = build_dir / "Makefile"
    makefile.write_text(makefile.read_text().replace("/usr/src/", f"{hdr_root}/usr/src/"))
    mod_dir = work / "modsrc"
    mod_dir.mkdir(parents=True, exist_ok=True)
    tree = work / "modtree"
    names = []
    for member in sources:
        src = _kernel_source_file(pins["source"], member, versions_file=versions_file, work=work)
        (tree / member).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tree / member)
        names.append(Path(member).stem)
    for patch in patches or []:
        debs.run(["patch", "-p1", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(patch)],
                 what=f"apply {patch.name}")
    for member in sources:
        shutil.copyfile(tree / member, mod_dir / Path(member).name)
    (mod_dir / "Kbuild").write_text(
        "".join(f"obj-m += {n}.o\n" for n in names) + "ccflags-y += -fmacro-prefix-map=$(src)/=\n"
    )
    proc = subprocess.run(
        ["make", "-s", "-C", str(build_dir), f"M={mod_dir}", "modules", f"-j{os.cpu_count() or 1}"],
        capture_output=True, text=True, check=False,
        env={**os.environ, "KBUILD_BUILD_TIMESTAMP": "", "LC_ALL": "C"},
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise BuildError(
            f"building {', '.join(names)} against {pins['headers'].package} failed: {' | '.join(tail)}; "
            "install gcc and make (the compiler must match the kernel's, gcc-12 on bookworm)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copyfile(mod_dir / f"{n}.ko", dest / f"{n}.ko")
        # debug info and the build-id carry the build directory: drop both (reproducible output)
        debs.run(["strip", "--strip-debug", "--remove-section=.note.gnu.build-id", str(dest / f"{n}.ko")],
                 what=f"strip {n}.ko")
    return names
