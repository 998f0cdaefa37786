"""The Python example in docs/ works as a CI user would run it: pytest inside `jmp shell`."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import exporter_config, jmp_env

EXAMPLE = Path(__file__).parents[1] / "docs" / "examples" / "test_vm_example.py"


@pytest.mark.timeout(600)
async def test_example_passes_inside_jmp_shell(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket), "recycle": "InPlaceReuse"})
    shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    result = await asyncio.to_thread(
        subprocess.run,
        ["jmp", "shell", "--exporter-config", str(cfg), "--", "pytest", "-q", "-p", "no:cacheprovider", EXAMPLE.name],
        cwd=tmp_path, env=jmp_env(), capture_output=True, text=True, timeout=500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout
