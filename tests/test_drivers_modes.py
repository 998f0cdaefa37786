"""The drivers under real jumpstarter 0.9.0 processes, on a real guest, in the two modes that need
no controller: ``jmp shell --exporter-config`` and ``jmp run --tls-grpc-listener`` + ``jmp shell --tls-grpc``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import PIPE_UNTIL, exporter_config, run_shell
from vmsidecar_runtime.oci import push_artifact

pytestmark = pytest.mark.timeout(900)

CONSOLE_CHECK = PIPE_UNTIL + r"""
j vm power on
pipe_until vmsidecar-42 console.txt '\necho vmsidecar-$((6*7))\n'
j vm power read
"""


async def test_local_shell_mode(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    await rt.client().wait_ready(180)
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket)})
    result = await asyncio.to_thread(run_shell, ["--exporter-config", str(cfg)],
                                     CONSOLE_CHECK + "j vm power off\nj vm power read\n", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    console = (tmp_path / "console.txt").read_text(errors="replace")
    assert "VMSIDECAR-READY image=tiny" in console  # the boot log, although nobody watched the boot
    assert "vmsidecar-42" in console  # a command ran on the guest console
    assert "voltage=5.0" in result.stdout and "voltage=0.0" in result.stdout
    # ExitAndReplace (default): the session that used the VM ends with the runtime stopped, exit 0
    rc = await asyncio.to_thread(rt.proc.wait, 60)
    assert rc == 0


async def test_standalone_mode_flash_from_file_and_registry(
    start_runtime: Any, tiny_image: Any, tiny_b_image: Any, registry: Any, standalone_exporter: Any, tmp_path: Path
) -> None:
    ref = f"{registry.host}/vm/tiny-b:standalone"
    push_artifact(tiny_b_image.disk, ref)
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    # Ready first: on a cache without this key's capture the guest boots cold, and the console check's
    # input, sent at once, would reach a kernel still booting instead of its shell (as in local mode)
    await rt.client().wait_ready(180)
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket), "recycle": "InPlaceReuse"})
    exp = await asyncio.to_thread(standalone_exporter, cfg)

    result = await asyncio.to_thread(run_shell, exp.shell_args, CONSOLE_CHECK, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + exp.log_text()[-3000:]
    console = (tmp_path / "console.txt").read_text(errors="replace")
    assert "VMSIDECAR-READY image=tiny" in console and "vmsidecar-42" in console

    flash = PIPE_UNTIL + f"""
j vm storage flash oci://{ref}
j vm power on
pipe_until "VMSIDECAR-READY image=tiny-b" flashed.txt
j vm power off
j vm storage dump dumped.qcow2
j vm storage dump {tmp_path} && exit 12 || true
j vm storage dump {tmp_path}/no/dir/d.qcow2 && exit 13 || true
j vm storage flash {tiny_image.disk}
j vm storage flash /nonexistent.qcow2 && exit 10 || true
j vm storage flash oci://127.0.0.1:1/none:1 && exit 11 || true
"""
    result = await asyncio.to_thread(run_shell, exp.shell_args, flash, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + exp.log_text()[-3000:]
    assert "VMSIDECAR-READY image=tiny-b" in (tmp_path / "flashed.txt").read_text(errors="replace")
    assert (tmp_path / "dumped.qcow2").read_bytes()[:4] == b"QFI\xfb"
    assert "/nonexistent.qcow2 does not exist or is not a file" in result.stderr
    # a dump into a directory hung the client until it was killed (upstream's local writer fails, the
    # driver's stream waits on it); one into a missing directory said so only as an OSError
    assert f"cannot dump the disk into {tmp_path}: it is a directory; name a file" in result.stderr
    assert f"cannot dump the disk into {tmp_path}/no/dir/d.qcow2: {tmp_path}/no/dir does not exist" in result.stderr
    assert "registry 127.0.0.1:1 is unreachable" in result.stderr  # the runtime's sentence, verbatim
