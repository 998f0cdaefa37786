"""Every ``VMSIDECAR_*`` variable is in ``vmsidecar_contract.envvars.KNOWN``, and ``serve`` names
one that is not (a typo was ignored without a word)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from vmsidecar_contract.envvars import KNOWN, unknown

ROOT = Path(__file__).resolve().parent.parent
#: where the project's programs, scripts and pod templates name their variables
SOURCES = ("contract/src", "runtime/src", "drivers/src", "images/src", "scripts", "container", "e2e", "tests",
           "bench", "Containerfile", ".ci")
#: a name, not a prefix an f-string completes (``VMSIDECAR_READY_{field}``)
NAME = re.compile(r"\bVMSIDECAR_[A-Z0-9_]*[A-Z0-9]\b(?!_?\{)")
#: names in the sources that are no variable of a program: this test's own examples of unknown ones,
#: and a test's check that no name starting so leaks into an environment
NOT_VARIABLES = {"VMSIDECAR_MEMROY", "VMSIDECAR_NOTHING_READS_THIS", "VMSIDECAR_REGISTRY"}


def _names_in_sources() -> set[str]:
    found: set[str] = set()
    for part in SOURCES:
        root = ROOT / part
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                found |= set(NAME.findall(path.read_text(errors="replace")))
    return found - NOT_VARIABLES


def test_every_variable_the_sources_name_is_known() -> None:
    names = _names_in_sources()
    assert "VMSIDECAR_MEMORY" in names and "VMSIDECAR_API_SOCKET" in names  # the scan sees them
    assert sorted(names - KNOWN.keys()) == []


def test_an_unknown_variable_is_matched_with_the_nearest_known_one() -> None:
    environ = {"VMSIDECAR_MEMROY": "4G", "VMSIDECAR_NOTHING_READS_THIS": "1", "VMSIDECAR_MEMORY": "1G", "HOME": "/"}
    assert unknown(environ) == [("VMSIDECAR_MEMROY", "VMSIDECAR_MEMORY"), ("VMSIDECAR_NOTHING_READS_THIS", None)]


def test_serve_names_a_variable_nothing_reads_and_the_one_meant(tmp_path: Path) -> None:
    argv = [shutil.which("vmsidecar-runtime") or "vmsidecar-runtime", "serve", "--cache-dir", str(tmp_path / "c"),
            "--state-dir", str(tmp_path / "s"), "--shared-dir", str(tmp_path / "sh"),
            "--cache-budget", "lots"]  # checked right after: the runtime stops there
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "VMSIDECAR_MEMROY": "4G"})
    assert result.returncode == 2 and "'lots' is not a size" in result.stderr, result.stderr[-2000:]
    assert ("VMSIDECAR_MEMROY is set, but no vmsidecar program reads it; did you mean VMSIDECAR_MEMORY?"
            in result.stderr), result.stderr
