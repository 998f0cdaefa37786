"""Run a benchmark against another source tree: its runtime and contract first on PYTHONPATH."""

from __future__ import annotations

import os
from pathlib import Path

from bytecode import compile_sources


def tree_pythonpath(tree: Path) -> str:
    """The PYTHONPATH entries that make ``tree``'s runtime and contract the ones imported (their
    bytecode compiled first, as this checkout's is)."""
    compile_sources(tree)
    return os.pathsep.join(str(tree / d / "src") for d in ("runtime", "contract"))


def with_pythonpath(env: dict[str, str], pythonpath: str | None) -> dict[str, str]:
    """``env`` with ``pythonpath`` before any PYTHONPATH it has (None: ``env`` as it is)."""
    if not pythonpath:
        return env
    return env | {"PYTHONPATH": pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")}
