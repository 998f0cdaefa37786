"""Architecture names: the spec uses uname names; OCI uses GOARCH names."""

from __future__ import annotations

import platform
from typing import Literal

Arch = Literal["x86_64", "aarch64"]

#: uname machine name -> OCI platform architecture
OCI_ARCH: dict[str, str] = {"x86_64": "amd64", "aarch64": "arm64"}
#: every spelling we accept -> uname machine name
_ALIASES: dict[str, str] = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def normalize_arch(name: str) -> str:
    """Map ``amd64``/``arm64``/``x86_64``/``aarch64`` to the uname name.

    :raise ValueError: for an architecture vmsidecar does not support.
    """
    try:
        return _ALIASES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {name!r}; use one of x86_64 (amd64) or aarch64 (arm64)"
        ) from None


def host_arch() -> str:
    """The host's architecture as a uname name."""
    return normalize_arch(platform.machine())


def oci_arch(arch: str) -> str:
    """The OCI platform architecture for a uname or OCI name."""
    return OCI_ARCH[normalize_arch(arch)]
