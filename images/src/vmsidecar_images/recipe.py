"""Recipes: where they live, what they pin, and the cache key of a build."""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from vmsidecar_contract.arch import normalize_arch

from .errors import BuildError

#: Bump when the builder changes in a way the source hash would not show (it hashes itself too).
BUILDER_FORMAT = 1
#: Every timestamp inside the image (cpio, FAT, ext4) is this instant (2024-01-01T00:00:00Z).
SOURCE_DATE_EPOCH = 1704067200

_PACKAGE_DIR = Path(__file__).resolve().parent
#: modules whose source is part of the cache key, per builder (the CLI is not: it cannot change the output)
_BUILDER_MODULES = {
    "initramfs": ("build.py", "cpio.py", "debs.py", "disk.py", "initramfs.py", "recipe.py", "extras.py",
                  "kernel_repack.py"),
    "debian": ("build.py", "debs.py", "disk.py", "recipe.py", "rootfs.py", "debian.py"),
    "uefi": ("build.py", "debs.py", "disk.py", "recipe.py", "uefi.py"),
}


def recipes_root() -> Path:
    """The recipes directory: ``images/recipes`` in the source tree, else the copy in the wheel."""
    for candidate in (_PACKAGE_DIR.parents[1] / "recipes", _PACKAGE_DIR / "recipes"):
        if any(candidate.glob("*/recipe.toml")):
            return candidate
    raise BuildError(
        f"no recipes directory next to {_PACKAGE_DIR}; reinstall vmsidecar-images (the wheel ships "
        "vmsidecar_images/recipes) or run from the source tree"
    )


def available_recipes() -> list[str]:
    """Names of the recipes (directories holding a ``recipe.toml``)."""
    return sorted(p.parent.name for p in recipes_root().glob("*/recipe.toml"))


@dataclass(frozen=True)
class Pin:
    """One Debian package pinned to an exact version."""

    package: str
    version: str

    @property
    def spec(self) -> str:
        return f"{self.package}={self.version}"


@dataclass
class ArchPins:
    """The pins of one architecture."""

    deb_arch: str
    kernel: Pin
    #: the initramfs builder's busybox-static; None for a bootstrapped root file system
    busybox: Pin | None = None
    #: packages the guest tools (and their libraries) are copied from; empty: no tools
    tools: list[Pin] = field(default_factory=list)
    #: source/headers/headers_common/kbuild for out-of-tree modules; empty: none built
    module_build: dict[str, Pin] = field(default_factory=dict)
    #: every package of a bootstrapped root file system, as resolved (the "debian" builder's snapshot)
    packages: dict[str, str] = field(default_factory=dict)

    @property
    def kernel_release(self) -> str:
        """``linux-image-6.1.0-56-amd64`` -> ``6.1.0-56-amd64`` (the /lib/modules directory)."""
        prefix = "linux-image-"
        if not self.kernel.package.startswith(prefix):
            raise BuildError(
                f"kernel pin {self.kernel.package!r} is not a linux-image-<release> package; "
                "pin the ABI package, e.g. linux-image-6.1.0-56-amd64"
            )
        return self.kernel.package[len(prefix) :]

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "deb_arch": self.deb_arch,
            "kernel": {"package": self.kernel.package, "version": self.kernel.version},
        }
        if self.busybox:
            out["busybox"] = {"package": self.busybox.package, "version": self.busybox.version}
        if self.tools:
            out["tools"] = [{"package": p.package, "version": p.version} for p in self.tools]
        if self.module_build:
            out["module_build"] = {k: {"package": p.package, "version": p.version} for k, p in self.module_build.items()}
        if self.packages:
            out["packages"] = dict(sorted(self.packages.items()))
        return out


@dataclass
class Recipe:
    """A parsed recipe directory (``recipe.toml`` + ``versions.toml`` + guest files)."""

    name: str
    dir: Path
    config: dict
    pins: dict[str, ArchPins] = field(default_factory=dict)

    @property
    def versions_file(self) -> Path:
        return self.dir / "versions.toml"

    @property
    def builder(self) -> str:
        """How the recipe is built: ``initramfs`` (busybox, the default) or ``debian`` (mmdebstrap rootfs)."""
        return str(self.config["recipe"].get("builder", "initramfs"))

    @property
    def base(self) -> str | None:
        """The recipe whose build this one starts from (``uefi`` builder: repartitions its disk)."""
        base = self.config["recipe"].get("base")
        return str(base) if base else None

    @property
    def default_label(self) -> str:
        return str(self.config["recipe"].get("default_label", self.name))

    @property
    def ready_marker(self) -> str:
        return str(self.config["recipe"].get("ready_marker", "VMSIDECAR-READY"))

    @property
    def prompt(self) -> str:
        return str(self.config["recipe"].get("prompt", "vm# "))

    def arch_config(self, arch: str) -> dict:
        try:
            return self.config["arch"][arch]
        except KeyError:
            raise BuildError(
                f"recipe {self.name!r} has no [arch.{arch}] section in {self.dir / 'recipe.toml'}; "
                f"build one of: {', '.join(sorted(self.config.get('arch', {})))}"
            ) from None

    def arch_pins(self, arch: str) -> ArchPins:
        try:
            return self.pins[arch]
        except KeyError:
            raise BuildError(
                f"recipe {self.name!r} pins no packages for {arch} in {self.versions_file}; "
                f"add an [{arch}] table or build one of: {', '.join(sorted(self.pins))}"
            ) from None

    def module_list(self, key: str) -> list[str]:
        """Module names from the list file named by ``recipe.<key>`` (comments stripped)."""
        path = self.dir / self.config["recipe"][key]
        names = []
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(line)
        return names

    def files(self) -> list[Path]:
        """Every file of the recipe, sorted (these feed the cache key)."""
        return sorted(p for p in self.dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)

    def input_hash(self, *, arch: str, label: str) -> str:
        """sha256 over recipe files, the parsed pins, label, arch and the builder's own code."""
        h = hashlib.sha256()

        def feed(tag: str, data: bytes) -> None:
            h.update(f"{tag}\0{len(data)}\0".encode())
            h.update(data)

        feed("format", str(BUILDER_FORMAT).encode())
        feed("epoch", str(SOURCE_DATE_EPOCH).encode())
        for path in self.files():
            # no mode bits: guest modes derive from content (#!), and wheels may drop exec bits
            feed(f"file:{path.relative_to(self.dir).as_posix()}", path.read_bytes())
        feed("pins", json.dumps(self.arch_pins(arch).as_dict(), sort_keys=True).encode())
        feed("arch", arch.encode())
        feed("label", label.encode())
        if self.base:  # the base build is an input: a change to its recipe is a new build of this one
            feed("base", load_recipe(self.base).input_hash(arch=arch, label=label).encode())
        for module in _BUILDER_MODULES[self.builder]:
            feed(f"builder:{module}", (_PACKAGE_DIR / module).read_bytes())
        return h.hexdigest()


def load_recipe(name: str = "tiny") -> Recipe:
    """Parse ``recipes/<name>/recipe.toml`` and its ``versions.toml``."""
    root = recipes_root()
    rdir = root / name
    if not (rdir / "recipe.toml").is_file():
        raise BuildError(
            f"no recipe named {name!r} under {root}; available: {', '.join(available_recipes()) or 'none'}"
        )
    config = tomllib.loads((rdir / "recipe.toml").read_text())
    versions = tomllib.loads((rdir / "versions.toml").read_text())
    builder = str(config["recipe"].get("builder", "initramfs"))
    if builder not in _BUILDER_MODULES:
        raise BuildError(
            f"recipe {name!r} names builder {builder!r} in {rdir / 'recipe.toml'}; known: {', '.join(_BUILDER_MODULES)}"
        )
    base = config["recipe"].get("base")
    pins = {}
    for arch, table in versions.items():
        try:
            kernel = Pin(**table["kernel"]) if "kernel" in table or not base else _base_kernel(str(base), arch)
            pins[normalize_arch(arch)] = ArchPins(
                deb_arch=table["deb_arch"],
                kernel=kernel,
                busybox=Pin(**table["busybox"]) if builder == "initramfs" else None,
                tools=[Pin(**t) for t in table.get("tools", [])],
                module_build={k: Pin(**v) for k, v in table.get("module_build", {}).items()},
                packages={str(k): str(v) for k, v in table.get("packages", {}).items()},
            )
        except (KeyError, TypeError) as exc:
            needs = "kernel/busybox" if builder == "initramfs" else "kernel"
            raise BuildError(
                f"[{arch}] in {rdir / 'versions.toml'} is incomplete ({exc}); it needs deb_arch and "
                f"{needs} = {{ package = ..., version = ... }}"
            ) from None
    return Recipe(name=name, dir=rdir, config=config, pins=pins)


def _base_kernel(base: str, arch: str) -> Pin:
    """The kernel pin of ``base`` for ``arch``: a derived recipe boots its base's kernel, pinned once."""
    return load_recipe(base).arch_pins(normalize_arch(arch)).kernel


def guest_file_mode(head: bytes, name: str) -> int:
    """Mode of a file put into a guest: scripts (``#!``) and ELF programs 0755, anything else 0644.

    Content decides, not the checkout's bits (wheels and umasks differ). Kernel modules are ELF but
    not programs.
    """
    executable = head[:2] == b"#!" or (head[:4] == b"\x7fELF" and not name.endswith(".ko"))
    return 0o755 if executable else 0o644
