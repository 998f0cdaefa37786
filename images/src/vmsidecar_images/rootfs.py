"""A Debian root file system from ``mmdebstrap``: bootstrap into a tarball, unpack it unprivileged.

``mmdebstrap`` runs in its ``auto`` mode: ``root`` when the builder is root, ``unshare`` otherwise
(an unprivileged user namespace; needs ``/etc/subuid`` and ``newuidmap``, package ``uidmap``). Either
way the tarball carries the true owners and modes. :func:`unpack` writes it into a plain directory
for ``mkfs.ext4 -d`` without privileges and returns the ``debugfs`` commands that give the ext4 inodes
whatever that directory could not hold (owners, set-id bits, unreadable modes). Device nodes are left
out of the tarball (``--skip=output/dev``): ``/dev`` is a devtmpfs in the booted guest.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from .debs import apt_versions
from .errors import BuildError, PinError, ToolError
from .recipe import SOURCE_DATE_EPOCH, Pin, guest_file_mode

#: mmdebstrap's own hook directories (``merged-usr``: /bin -> usr/bin without the usrmerge package)
MMDEBSTRAP_HOOKS = Path("/usr/share/mmdebstrap/hooks")
#: where the apt pins live inside the root file system while it is bootstrapped (removed afterwards)
PREFERENCES_NAME = "vmsidecar-snapshot"


@dataclass
class Bootstrap:
    """What ``mmdebstrap`` is asked for (``[bootstrap]`` of a recipe)."""

    suite: str
    variant: str
    mirrors: list[str]
    include: list[str]
    dpkg_options: list[str] = field(default_factory=list)
    apt_options: list[str] = field(default_factory=list)
    hook_dirs: list[str] = field(default_factory=list)


def files_tar(files: dict[str, bytes], out: Path) -> None:
    """A tarball of ``files`` (guest path -> bytes) owned by root, mtime ``SOURCE_DATE_EPOCH``.

    File modes follow from content (:func:`guest_file_mode`). There are no directory entries, so
    unpacking leaves existing directories as the packages made them (missing ones are created 0755).
    """
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"./{name}")
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = SOURCE_DATE_EPOCH
            info.size = len(data)
            info.mode = guest_file_mode(data[:4], name)
            tar.addfile(info, io.BytesIO(data))


def tree_files(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root`` as guest path -> bytes (a recipe's ``rootfs/``)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def apt_preferences(packages: dict[str, str]) -> str:
    """apt pins (priority 1001: downgrades allowed) holding every package at its snapshot version."""
    return "".join(
        f"Package: {name}\nPin: version {version}\nPin-Priority: 1001\n\n" for name, version in sorted(packages.items())
    )


def mmdebstrap(
    spec: Bootstrap,
    out: Path,
    *,
    setup_tars: list[Path],
    customize_tars: list[Path],
    customize_script: Path,
    preferences: Path | None,
    kernel: Pin,
    versions_file: Path,
) -> None:
    """Run ``mmdebstrap`` into the tarball ``out``.

    ``setup_tars`` are unpacked before any package is installed (configuration the packages'
    scripts must see, e.g. initramfs-tools'), ``customize_tars`` after all are (they win over
    package files), then ``sh customize_script <root>`` runs.

    :raise PinError: when apt cannot find the pinned kernel version.
    :raise ToolError: when mmdebstrap is missing or fails otherwise.
    """
    if shutil.which("mmdebstrap") is None:
        raise ToolError("mmdebstrap is not installed (needed to bootstrap the Debian guest); apt-get install mmdebstrap")
    argv = [
        "mmdebstrap", "--mode=auto", "--format=tar", f"--variant={spec.variant}", "--skip=output/dev",
        f"--include={kernel.spec}", *(f"--include={p}" for p in spec.include),
    ]  # fmt: skip
    argv += [f"--hook-dir={MMDEBSTRAP_HOOKS / d}" for d in spec.hook_dirs]
    argv += [f"--dpkgopt={o}" for o in spec.dpkg_options] + [f"--aptopt={o}" for o in spec.apt_options]
    argv += [f"--setup-hook=tar-in {shlex.quote(str(t))} /" for t in setup_tars]
    if preferences is not None:
        argv.append(f"--setup-hook=copy-in {shlex.quote(str(preferences))} /etc/apt/preferences.d")
    argv += [f"--customize-hook=tar-in {shlex.quote(str(t))} /" for t in customize_tars]
    argv.append(f'--customize-hook=sh {shlex.quote(str(customize_script))} "$1"')
    argv += [spec.suite, str(out), *spec.mirrors]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH), "TZ": "UTC", "LC_ALL": "C.UTF-8"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    (out.parent / "mmdebstrap.log").write_text(proc.stderr)
    if proc.returncode == 0:
        return
    if re.search(rf"Version '{re.escape(kernel.version)}' for '{re.escape(kernel.package)}' was not found", proc.stderr):
        offered = apt_versions(kernel.package)
        raise PinError(
            f"pinned {kernel.spec} cannot be installed: apt offers "
            f"{', '.join(offered) if offered else 'no version (package unknown; a kernel ABI bump renames it)'}; "
            f"edit the kernel pin in {versions_file}, then run `vmsidecar-image lock` for the recipe"
        )
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("E:")] or proc.stderr.strip().splitlines()[-3:]
    raise ToolError(f"mmdebstrap failed (rc {proc.returncode}): {' | '.join(errors[-3:]) or 'no output'}")


def read_member(tar_path: Path, name: str) -> bytes:
    """One regular file of the tarball (``etc/x`` or ``./etc/x``).

    :raise BuildError: when the tarball has no such file.
    """
    wanted = name.removeprefix("./")
    with tarfile.open(tar_path) as tar:
        for info in tar:
            if info.isfile() and info.name.removeprefix("./") == wanted:
                fh = tar.extractfile(info)
                assert fh is not None
                return fh.read()
    raise BuildError(f"the bootstrapped root file system has no {wanted}")


def installed_packages(status: bytes) -> dict[str, str]:
    """``package -> version`` of every installed package in a ``var/lib/dpkg/status``."""
    packages = {}
    for block in status.decode().split("\n\n"):
        fields = dict(re.findall(r"^([\w-]+): (.*)$", block, re.M))
        if fields.get("Status") == "install ok installed":
            packages[fields["Package"]] = fields["Version"]
    return dict(sorted(packages.items()))


def unpack(tar_path: Path, dest: Path) -> list[str]:
    """Write the tarball into ``dest`` as the build user; returns the debugfs fixes for what differs.

    Files get their exact modes where the owner may set them; directories stay writable while
    unpacking and get theirs at the end. Whatever still differs from the tarball afterwards (owner,
    group, a mode the build user may not set or could not read back) becomes a
    ``set_inode_field`` command for the finished ext4 file system.
    """
    dest.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, tarfile.TarInfo] = {}
    privileged = os.geteuid() == 0
    with tarfile.open(tar_path) as tar:
        for info in tar:
            rel = os.path.normpath(info.name.removeprefix("./"))
            if rel == "." or rel.startswith(".."):
                continue
            path = dest / rel
            if info.isdir():
                path.mkdir(exist_ok=True)
                os.chmod(path, 0o755)
            elif info.isreg():
                fh = tar.extractfile(info)
                assert fh is not None
                with path.open("wb") as out:
                    shutil.copyfileobj(fh, out)
                os.chmod(path, (info.mode & 0o7777) | 0o400)
            elif info.issym():
                path.symlink_to(info.linkname)
            elif info.islnk():
                os.link(dest / os.path.normpath(info.linkname.removeprefix("./")), path)
                continue  # same inode as its target: the target's entry describes it
            else:
                continue  # device nodes and fifos (none with --skip=output/dev)
            wanted[rel] = info
            if privileged:
                os.lchown(path, info.uid, info.gid)
    for rel in sorted(wanted, reverse=True):  # directories last: their modes may forbid writing
        info = wanted[rel]
        if info.isdir():
            os.chmod(dest / rel, (info.mode & 0o7777) | 0o700)
    return _inode_fixes(dest, wanted)


def _inode_fixes(dest: Path, wanted: dict[str, tarfile.TarInfo]) -> list[str]:
    """``debugfs`` commands for every owner and mode the unpacked tree does not have."""
    fixes = []
    for rel, info in sorted(wanted.items()):
        st = os.lstat(dest / rel)
        quoted = f'"/{rel}"'
        if st.st_uid != info.uid:
            fixes.append(f"set_inode_field {quoted} uid {info.uid}")
        if st.st_gid != info.gid:
            fixes.append(f"set_inode_field {quoted} gid {info.gid}")
        if not info.issym() and (st.st_mode & 0o7777) != (info.mode & 0o7777):
            fixes.append(f"set_inode_field {quoted} mode 0{(st.st_mode & 0o170000) | (info.mode & 0o7777):o}")
    return fixes
