"""Fresh bytecode for the project's own modules before a bench times a process start.

The pod image compiles every module (Containerfile, ``slim-venv``) and so does
``scripts/setup``; a module edited since then has a stale ``.pyc`` that, where
``PYTHONDONTWRITEBYTECODE`` is set (CI machines, the image), is compiled again at every import
and never written. Nine edited modules put 10-20 ms on each runtime's start here (0.32 vs 0.30 s to
its QEMU's spawn, median of 10): what the deployed runtime does not pay.
"""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("contract", "runtime", "drivers", "images")


def compile_sources(tree: Path = ROOT) -> None:
    """Compile the stale modules of ``tree`` (this checkout, or another one a bench compares with);
    ``compileall`` skips those whose bytecode matches their source, and says only what fails."""
    for part in PARTS:
        if (tree / part / "src").is_dir():
            compileall.compile_dir(tree / part / "src", quiet=1, workers=0)
