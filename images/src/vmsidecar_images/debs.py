"""Pinned Debian packages: download once into a cache with ``apt-get download``, extract."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import BuildError, PinError, ToolError
from .recipe import ArchPins, Pin

_log = logging.getLogger(__name__)


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/vmsidecar`` or ``~/.cache/vmsidecar``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vmsidecar"


def deb_cache_dir() -> Path:
    """Where downloaded .deb files are kept (shared by every build)."""
    return cache_home() / "debs"


def deb_filename(pin: Pin, deb_arch: str) -> str:
    """The file name ``apt-get download`` gives (``:`` of the epoch becomes ``%3a``)."""
    return f"{pin.package}_{pin.version.replace(':', '%3a')}_{deb_arch}.deb"


def run(
    argv: list[str],
    *,
    what: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    input: str | None = None,
) -> str:
    """Run a host tool; a missing tool or a failure becomes one clear sentence."""
    if shutil.which(argv[0]) is None:
        raise ToolError(
            f"{argv[0]} is not installed (needed to {what}); install it with apt-get "
            "(see images/README.md for the package list)"
        )
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        input=input,
        check=False,
    )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise ToolError(
            f"{' '.join(argv[:2])} failed (rc {proc.returncode}) while trying to {what}: "
            f"{detail[-1] if detail else 'no output'}"
        )
    return proc.stdout


@functools.cache
def _apt_cache(*args: str) -> str:
    """What ``apt-cache ARGS`` prints. Each call reads apt's whole package lists (~0.5-1 s of CPU);
    the lists change only with ``apt-get update``, which nothing in a build runs, so one process asks
    each question once (a build with a followed kernel ABI asked up to eight)."""
    return subprocess.run(["apt-cache", *args], capture_output=True, text=True, check=False).stdout


def apt_versions(package: str) -> list[str]:
    """Versions of ``package`` that apt can download now (``apt-cache madison``), newest first."""
    versions: list[str] = []
    for line in _apt_cache("madison", package).splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 2 and parts[1] not in versions:
            versions.append(parts[1])
    return versions


def fetch(pin: Pin, deb_arch: str, *, versions_file: Path, cache_dir: Path | None = None) -> Path:
    """Return the cached .deb of ``pin``, downloading it with ``apt-get download`` if needed.

    :raise PinError: when apt no longer offers the pinned version (names the versions it offers
        and the file to edit).
    """
    cache_dir = cache_dir or deb_cache_dir()
    target = cache_dir / deb_filename(pin, deb_arch)
    if target.is_file():
        return target
    arch_all = cache_dir / deb_filename(pin, "all")  # architecture-independent packages
    if arch_all.is_file():
        return arch_all
    cache_dir.mkdir(parents=True, exist_ok=True)
    if shutil.which("apt-get") is None:
        raise ToolError(
            f"{target.name} is not in {cache_dir} and apt-get is missing; build on Debian/Ubuntu or "
            "copy the .deb there"
        )
    qualified = _qualified(pin.package, deb_arch)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".dl-") as tmp:
        os.chmod(tmp, 0o755)  # apt's _apt sandbox user must be able to write here
        proc = subprocess.run(
            ["apt-get", "download", "-q", f"{qualified}={pin.version}"],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
        )
        got = Path(tmp) / target.name
        if not got.is_file() and (Path(tmp) / arch_all.name).is_file():
            got, target = Path(tmp) / arch_all.name, arch_all
        if proc.returncode != 0 or not got.is_file():
            offered_now = apt_versions(qualified)
            rebuild = None if exact_pins_required() else _same_release_rebuild(pin, offered_now)
            if rebuild is None:
                raise _pin_error(pin, deb_arch, qualified, proc.stderr, versions_file, offered_now)
            _warn_rebuild(qualified, pin, rebuild, versions_file)
            return fetch(Pin(pin.package, rebuild), deb_arch, versions_file=versions_file, cache_dir=cache_dir)
        os.replace(got, target)
    return target


#: set (not "0"): a pin the archive no longer offers stops the build, a rebuild of its release too
EXACT_PINS_ENV = "VMSIDECAR_IMAGE_EXACT_PINS"


def exact_pins_required() -> bool:
    """Whether the build must use exactly the pinned versions (``$VMSIDECAR_IMAGE_EXACT_PINS``)."""
    return os.environ.get(EXACT_PINS_ENV, "") not in ("", "0")


def offered(pin: Pin, *, versions_file: Path) -> Pin:
    """``pin`` if apt offers it, else apt's newest rebuild of the same upstream release (warned),
    else ``pin`` itself (the tool that installs it then says it is not found)."""
    if exact_pins_required():
        return pin
    versions = apt_versions(pin.package)
    if pin.version in versions:
        return pin
    rebuild = _same_release_rebuild(pin, versions)
    if rebuild is None:
        return pin
    _warn_rebuild(pin.package, pin, rebuild, versions_file)
    return Pin(pin.package, rebuild)


def _warn_rebuild(qualified: str, pin: Pin, rebuild: str, versions_file: Path) -> None:
    _log.warning(
        "pinned %s=%s is no longer offered by apt; using %s, a Debian rebuild of the same upstream release "
        "(put it in %s to build exactly what was tested; %s=1 stops instead)",
        qualified, pin.version, rebuild, versions_file, EXACT_PINS_ENV,
    )


def upstream_release(version: str) -> str:
    """``[epoch:]upstream`` of a Debian version: what is left without the Debian revision (``-2``,
    ``-4+deb12u1+b1``), which security updates, rebuilds and binNMUs change."""
    return version.rsplit("-", 1)[0] if "-" in version else version


def _same_release_rebuild(pin: Pin, offered: list[str]) -> str | None:
    """The newest of ``offered`` (apt's versions of ``pin``'s package) with the pin's upstream
    release, if any.

    The archive keeps only its newest revision of a package (a security update of the same kernel
    release removes the last one within hours), so an exact pin breaks every fresh build until it
    is edited; a rebuild of the same release is taken instead, loudly. Another upstream release
    still stops the build (a kernel ABI bump, which renames the package, is :func:`follow_kernel_abi`'s).
    """
    wanted = upstream_release(pin.version)
    candidates = [v for v in offered if upstream_release(v) == wanted and v != pin.version]
    return _newest(candidates) if candidates else None


def _newest(versions: list[str]) -> str:
    """The highest of ``versions`` as dpkg orders them (``dpkg --compare-versions``)."""
    newest = versions[0]
    for version in versions[1:]:
        newer = subprocess.run(["dpkg", "--compare-versions", version, "gt", newest], check=False)
        if newer.returncode == 0:
            newest = version
    return newest


#: ``linux-image-<abi>-<flavour>``: ``linux-image-6.1.0-56-cloud-amd64`` -> ``6.1.0-56``, ``cloud-amd64``
_KERNEL_ABI = re.compile(r"linux-image-(\d+\.\d+\.\d+-\d+)-(.+)")


def follow_kernel_abi(pins: ArchPins, *, versions_file: Path) -> ArchPins:
    """``pins`` with the kernel moved to the ABI apt's ``linux-image-<flavour>`` depends on now, when apt
    no longer offers the pinned kernel package at all (warned); else ``pins`` itself.

    A kernel ABI bump renames the package (``linux-image-6.1.0-56-amd64`` -> ``-57-``) and the archive
    drops the old one, so every fresh build stopped until versions.toml was edited. The module build
    pins follow the kernel: ABI-named packages are renamed, each takes the kernel's version if apt offers
    it, else the newest apt offers. Not with ``$VMSIDECAR_IMAGE_EXACT_PINS``, nor when the metapackage
    names nothing usable (the download then stops with a :class:`PinError` naming the file to edit).
    """
    kernel = pins.kernel
    if exact_pins_required() or apt_versions(_qualified(kernel.package, pins.deb_arch)):
        return pins  # a replaced version of an offered package is fetch's (and offered's) business
    old = _KERNEL_ABI.fullmatch(kernel.package)
    current = _metapackage_kernel(f"linux-image-{old[2]}", pins.deb_arch) if old else None
    new = _KERNEL_ABI.fullmatch(current) if current else None
    if old is None or new is None or new[2] != old[2] or new[1] == old[1]:
        return pins  # not an ABI package, or apt names no other ABI of the same flavour
    versions = apt_versions(_qualified(new[0], pins.deb_arch))
    if not versions:
        return pins
    followed = Pin(new[0], _newest(versions))
    module_build = {key: _follow_module_pin(pin, old[1], new[1], followed.version)
                    for key, pin in pins.module_build.items()}
    moved = [f"{pin.spec} -> {module_build[key].spec}" for key, pin in pins.module_build.items()
             if module_build[key] != pin]
    _log.warning(
        "pinned kernel %s is no longer offered by apt (a kernel ABI bump renames the package); using %s, "
        "which linux-image-%s depends on now%s (put them in %s to build exactly what was tested; %s=1 stops "
        "instead)",
        kernel.spec, followed.spec, old[2], f", with {', '.join(moved)}" if moved else "", versions_file,
        EXACT_PINS_ENV,
    )
    return dataclasses.replace(pins, kernel=followed, module_build=module_build)


def _qualified(package: str, deb_arch: str) -> str:
    """``package`` as apt names it for ``deb_arch`` (``:<arch>`` for a foreign architecture)."""
    return package if deb_arch == _host_deb_arch() else f"{package}:{deb_arch}"


def _metapackage_kernel(metapackage: str, deb_arch: str) -> str | None:
    """The ``linux-image-*`` package ``metapackage`` depends on (``apt-cache depends``), if any."""
    for line in _apt_cache("depends", _qualified(metapackage, deb_arch)).splitlines():
        found = re.match(r"\s*\|?Depends:\s+(linux-image-[^\s:<>]+)", line)
        if found:
            return found[1]
    return None


def _follow_module_pin(pin: Pin, old_abi: str, new_abi: str, kernel_version: str) -> Pin:
    """``pin`` renamed to ``new_abi`` (if its name carries ``old_abi``) at a version apt offers: the
    kernel's if it has that, else its newest (``linux-kbuild`` and ``linux-source`` may be ahead)."""
    package = re.sub(rf"(?<![\d.]){re.escape(old_abi)}(?!\d)", new_abi, pin.package)
    versions = apt_versions(package)
    if kernel_version in versions:
        return Pin(package, kernel_version)
    return Pin(package, _newest(versions) if versions else pin.version)


def _pin_error(pin: Pin, deb_arch: str, qualified: str, stderr: str, versions_file: Path,
               offered: list[str]) -> BuildError:
    apt_said = next((ln for ln in stderr.splitlines() if ln.startswith("E:")), stderr.strip()[-200:])
    if pin.version in offered:
        return BuildError(
            f"apt knows {qualified}={pin.version} but downloading it failed ({apt_said}); "
            "run `apt-get update` and check the network, then rebuild"
        )
    if offered:
        offer = f"apt offers {', '.join(offered)}"
    else:
        offer = f"apt offers no version of {qualified} (package unknown{_arch_hint(deb_arch)})"
    return PinError(
        f"pinned {qualified}={pin.version} cannot be downloaded: {offer}; "
        f"edit the pin in {versions_file} (run `apt-get update` first if the lists are old)"
    )


def _arch_hint(deb_arch: str) -> str:
    if deb_arch == _host_deb_arch():
        return "; a kernel ABI bump renames it, see `apt-cache depends linux-image-" + deb_arch + "`"
    return f"; `dpkg --add-architecture {deb_arch} && apt-get update` enables {deb_arch} packages"


_HOST_DEB_ARCH: str | None = None


def _host_deb_arch() -> str:
    global _HOST_DEB_ARCH
    if _HOST_DEB_ARCH is None:
        try:
            out = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True)
            _HOST_DEB_ARCH = out.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            _HOST_DEB_ARCH = "amd64"
    return _HOST_DEB_ARCH


def extract(deb: Path, dest: Path) -> Path:
    """``dpkg-deb -x deb dest``; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    run(["dpkg-deb", "-x", str(deb), str(dest)], what=f"extract {deb.name}")
    return dest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
