"""The tiny guest boots to its marker on both consoles from every source form (design §5):
a plain file, an OCI layout, a registry artifact and a containerDisk image, and what was
pushed comes back byte for byte."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from vmsidecar_images.console import Console
from vmsidecar_runtime.oci import pull, push_artifact, push_containerdisk, write_layout

pytestmark = pytest.mark.timeout(600)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


@pytest.fixture(scope="module")
def sources(tiny_image: Any, registry: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    layout = tmp_path_factory.mktemp("layout") / "tiny"
    write_layout(tiny_image.disk, layout, tag="v1", form="artifact")
    push_artifact(tiny_image.disk, f"{registry.host}/vm/tiny:artifact")
    push_containerdisk(tiny_image.disk, f"{registry.host}/vm/tiny-cd:v1")
    return {
        "file": f"file:{tiny_image.disk}",
        "layout": f"oci-layout:{layout}:v1",
        "artifact": f"{registry.host}/vm/tiny:artifact",
        "containerdisk": f"{registry.host}/vm/tiny-cd:v1",
    }


@pytest.mark.parametrize("form", ["file", "layout", "artifact", "containerdisk"])
async def test_boots_to_marker_on_both_consoles(form: str, sources: dict[str, str], start_runtime: Any,
                                                tiny_image: Any) -> None:
    rt = await start_runtime({"image": sources[form], "memory": "256M"}, name=form)
    state = await rt.client().wait_ready(180)
    assert state.image_digest == _sha256(tiny_image.disk)  # the very bytes the recipe built
    for sock in ("console.sock", "hvc0.sock"):
        con = await Console.open(rt.shared / sock)
        await con.expect("VMSIDECAR-READY image=tiny uptime=")
        await con.close()


@pytest.mark.parametrize("form", ["layout", "artifact", "containerdisk"])
def test_push_then_pull_is_byte_identical(form: str, sources: dict[str, str], tiny_image: Any, tmp_path: Path) -> None:
    first = pull(sources[form], tmp_path / "cache")
    assert _sha256(first.path) == _sha256(tiny_image.disk) == first.digest
    again = pull(sources[form], tmp_path / "cache")
    assert again.cached and again.bytes_downloaded == 0 and again.path == first.path


async def test_aarch64_guest_boots_by_direct_kernel(start_runtime: Any) -> None:
    """A foreign-arch guest (TCG): the aarch64 tiny guest with its kernel and initrd from the recipe."""
    from vmsidecar_images.build import build_image

    image = build_image("tiny", arch="aarch64")
    spec = {"image": f"file:{image.disk}", "arch": "aarch64", "kernel": str(image.kernel),
            "initrd": str(image.initrd), "cmdline": image.cmdline, "memory": "256M"}
    rt = await start_runtime(spec, name="aarch64")
    state = await rt.client().wait_ready(180)
    assert state.accel == "tcg" and "differs from host arch" in (state.accel_reason or "")
    con = await Console.open(rt.shared / "hvc0.sock")
    await con.expect("VMSIDECAR-READY image=tiny uptime=")
    await con.wake()
    assert "aarch64" in await con.run("uname -m")
    await con.close()
