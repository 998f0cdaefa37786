"""Flash and pull through a real runtime (API and CLI) refuse images that would make QEMU open
host files or claim a huge disk, and keep the previous disk. No guest is booted: the runtime has
a spec without an image, and a good flash gives it a disk to keep."""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zstandard

from fixtures.registry import Crafter, RunningRegistry
from vmsidecar_contract.errors import VmsidecarError

pytestmark = pytest.mark.timeout(180)

FLATTEN = "flatten it with `qemu-img convert -O qcow2 IN OUT` and flash the result"


def _qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True)


@pytest.fixture
def evil(tmp_path: Path) -> dict[str, Path]:
    """The issue's reproducers, made by qemu-img."""
    d = tmp_path / "evil"
    d.mkdir()
    made = {"backing": d / "backing.qcow2", "data_file": d / "data-file.qcow2", "huge": d / "huge.qcow2"}
    _qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/hostname", str(made["backing"]))
    _qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={d / 'x.data'}", str(made["data_file"]), "1M")
    _qemu_img("create", "-q", "-f", "qcow2", str(made["huge"]), "2T")  # sparse: ~300 KiB on disk
    zst = d / "backing.qcow2.zst"
    zst.write_bytes(zstandard.ZstdCompressor(level=3).compress(made["backing"].read_bytes()))
    made["backing_zst"] = zst
    return made


async def _runtime_with_a_flashed_disk(start_runtime: Any, tiny_image: Any) -> tuple[Any, Any, str]:
    rt = await start_runtime({})
    client = rt.client()
    state = await client.flash(tiny_image.disk, power_off=True)
    assert state.image_digest and state.phase.value == "Stopped"
    return rt, client, state.image_digest


def _flashed_files(rt: Any) -> list[str]:
    return sorted(p.name for p in (rt.state / "flashed").iterdir())


async def test_api_flash_refuses_backing_and_data_files_and_huge_disks(
    start_runtime: Any, tiny_image: Any, evil: dict[str, Path]
) -> None:
    rt, client, digest = await _runtime_with_a_flashed_disk(start_runtime, tiny_image)
    kept = _flashed_files(rt)
    cases = [
        ("backing", "unsafe_disk", ["names a backing file (/etc/hostname)", FLATTEN]),
        ("backing_zst", "unsafe_disk", ["names a backing file (/etc/hostname)", FLATTEN]),
        ("data_file", "unsafe_disk", ["with an external data file (", "x.data)", "qemu-img convert -O qcow2"]),
        ("huge", "disk_too_large", ["has a virtual size of 2 TiB, more than the 64 GiB limit"]),
    ]
    for kind, code, needles in cases:
        with pytest.raises(VmsidecarError) as exc:
            await client.flash(evil[kind], power_off=True)
        err = exc.value
        # an image that cannot be used is the API's 422 (every ImageError; docs/api/openapi.json)
        assert (err.code, err.http_status) == (code, 422), (kind, err.code, err.message)
        assert err.message.startswith("the flashed image "), err.message
        for needle in needles:
            assert needle in err.message, (kind, err.message)
        state = await client.state()
        assert state.image_digest == digest and state.phase.value == "Stopped"
        assert _flashed_files(rt) == kept  # no temp file, the previous disk untouched


async def test_cli_flash_refuses_a_backing_file(start_runtime: Any, tiny_image: Any, evil: dict[str, Path]) -> None:
    rt, client, digest = await _runtime_with_a_flashed_disk(start_runtime, tiny_image)
    script = Path(sys.executable).with_name("vmsidecar-runtime")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "vmsidecar_runtime.cli"]
    result = await asyncio.to_thread(
        subprocess.run,
        [*argv, "flash", str(evil["backing"]), "--power-off", "--socket", str(rt.socket)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "error: the flashed image is a qcow2 overlay that names a backing file (/etc/hostname)" in result.stderr
    assert FLATTEN in result.stderr and "Traceback" not in result.stderr
    assert (await client.state()).image_digest == digest


async def test_api_pull_of_a_registry_artifact_with_a_backing_file_is_refused(
    start_runtime: Any, tiny_image: Any, evil: dict[str, Path], registry: RunningRegistry, image_cache: Path
) -> None:
    _, client, digest = await _runtime_with_a_flashed_disk(start_runtime, tiny_image)
    c = Crafter(registry=registry, repo="evil/backing")
    data = evil["backing"].read_bytes()
    layer = c.blob(gzip.compress(data, mtime=0), "application/vnd.diskimage.qcow2+gzip",
                   {"org.opencontainers.image.title": "evil.qcow2.gz"})
    ref = c.tag(c.manifest([layer]), "1")
    with pytest.raises(VmsidecarError) as exc:
        await client.flash_reference(ref, power_off=True)
    assert exc.value.code == "unsafe_disk", exc.value.message
    assert "names a backing file (/etc/hostname)" in exc.value.message
    assert "qemu-img convert -O qcow2 IN OUT` and push the result" in exc.value.message
    assert (await client.state()).image_digest == digest
    # no cache entry: neither the disk nor an index key for its layer
    hex_ = Crafter.digest(data)[7:]
    assert not (image_cache / "disks" / f"sha256-{hex_}.qcow2").exists()
    index = (image_cache / "index.json").read_text() if (image_cache / "index.json").exists() else ""
    assert layer["digest"] not in index
