"""Fresh bytecode for the project's own modules before a bench times a process start.

The pod image compiles every module (Containerfile, ``UV_COMPILE_BYTECODE``) and so does
``scripts/setup``; a module edited since then has a stale ``.pyc`` that, where
``PYTHONDONTWRITEBYTECODE`` is set (CI machines, the image), is compiled again at every import
and never written. Nine edited modules put 10-20 ms on each runtime's start here (0.32 vs 0.30 s to
its QEMU's spawn, median of 10): what the deployed runtime does not pay.
"""

from __future__ import annotations

import compileall
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("contract", "runtime", "drivers", "images")


def _stale(source: Path) -> bool:
    cached = Path(importlib.util.cache_from_source(str(source)))
    try:
        header = cached.read_bytes()[:12]
    except OSError:
        return True
    # a timestamp-based pyc: flags 0, then the source's mtime (PEP 552)
    return int.from_bytes(header[8:12], "little") != int(source.stat().st_mtime) & 0xFFFFFFFF


def compile_sources(tree: Path = ROOT) -> None:
    """Compile what is stale in ``tree`` (this checkout, or another one a bench compares with), and
    say how many modules were."""
    sources = [tree / part / "src" for part in PARTS if (tree / part / "src").is_dir()]
    stale = [p for src in sources for p in src.rglob("*.py") if _stale(p)]
    if stale:
        for src in sources:
            compileall.compile_dir(src, quiet=2, workers=0)
        print(f"note: compiled {len(stale)} modules of {tree} that had no bytecode or stale bytecode "
              "(as scripts/setup and the image do)")
