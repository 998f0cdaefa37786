"""OCI disk images: references, pull into a digest-keyed cache, push, OCI layouts.

See ``docs/oci.md`` for the formats and the cache. The names below load on first use, so that
``vmsidecar-oci --help`` and modules that need one small part (``oci.auth``, ``oci.cache``) do not
import the whole stack (docs/decisions.md, "Issue 21 — fast CLI").
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .layout import write_layout
    from .pull import PulledDisk, inspect, pull
    from .push import push, push_artifact, push_containerdisk
    from .reference import Reference, parse_reference

#: each public name, and the submodule that defines it
_EXPORTS = {"PulledDisk": "pull", "inspect": "pull", "pull": "pull", "push": "push", "push_artifact": "push",
            "push_containerdisk": "push", "Reference": "reference", "parse_reference": "reference",
            "write_layout": "layout"}

__all__ = [
    "PulledDisk",
    "Reference",
    "inspect",
    "parse_reference",
    "pull",
    "push",
    "push_artifact",
    "push_containerdisk",
    "write_layout",
]


class _Package(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name not in _EXPORTS:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{_EXPORTS[name]}"), name)
        setattr(self, name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # importing the submodule pull (or push) binds it here by its name; the package's ``pull``
        # stays the function, as when this file imported the names eagerly
        if isinstance(value, ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
