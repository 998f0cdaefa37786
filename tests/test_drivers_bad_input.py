"""Bad input on the exporter side, through real `jmp` processes: each gives a clear sentence and the
exporter keeps serving."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import exporter_config, jmp_env, run_shell

pytestmark = pytest.mark.timeout(900)


async def test_runtime_down_then_back_and_restarted_mid_session(
    start_runtime: Any, tiny_image: Any, standalone_exporter: Any, tmp_path: Path
) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M"}
    socket = tmp_path / "rt" / "shared" / "api.sock"
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(socket), "spec": spec,
                                                        "recycle": "InPlaceReuse"})
    exp = await asyncio.to_thread(standalone_exporter, cfg)  # the runtime does not exist yet

    result = await asyncio.to_thread(run_shell, exp.shell_args, "j vm power on", cwd=tmp_path)
    assert result.returncode != 0
    assert "the vmsidecar runtime is not reachable" in result.stderr and "does not exist" in result.stderr
    assert exp.proc.poll() is None  # the exporter keeps running

    # no spec of its own: the driver hands over its spec, whose file: image the admin allowed
    allow = ["--allow-host-paths", str(tiny_image.disk.parent)]
    rt = await start_runtime(None, name="rt", extra_args=allow)
    result = await asyncio.to_thread(run_shell, exp.shell_args, "j vm power on", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + exp.log_text()[-3000:]
    await rt.client().wait_ready(180)

    await asyncio.to_thread(rt.stop, signal.SIGTERM, 60)  # the runtime restarts mid-session
    rt = await start_runtime(None, name="rt", extra_args=allow)
    # and in the same session, a flash from a URL that answers nothing is refused, the exporter serves on
    script = "j vm power on\nj vm power read\nj vm storage flash http://127.0.0.1:1/disk.qcow2 && exit 10 || true"
    result = await asyncio.to_thread(run_shell, exp.shell_args, script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + exp.log_text()[-3000:]
    assert "voltage=5.0" in result.stdout
    assert (await rt.client().wait_ready(180)).phase.value == "Ready"
    assert "127.0.0.1:1" in result.stderr
    assert exp.proc.poll() is None


async def test_runtime_rejects_the_spec_and_j_user_reads_why(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    rt = await start_runtime(None)
    spec = {"image": f"file:{tiny_image.disk}", "extra_args": ["-device", "virtio-balloon-pci"]}
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket), "spec": spec})
    result = await asyncio.to_thread(run_shell, ["--exporter-config", str(cfg)], "j vm power on", cwd=tmp_path)
    # (0.9.0's `jmp shell --exporter-config` always exits 0, so the error text is what counts here)
    assert ("Error: DriverCall 'on' failed with gRPC INVALID_ARGUMENT: extra_args may only be set by an "
            "administrator; start the runtime with --allow-extra-args" in " ".join(result.stderr.split()))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"recycle": "InPlaceReuze"}, "recycle: 'InPlaceReuze' is not a recycle strategy; use ExitAndReplace or InPlaceReuse"),
        ({"spec": {"memory": "12Q"}}, "memory: '12Q' is not a size"),
    ],
)
def test_bad_exporter_config_fails_at_start(config: dict[str, Any], message: str, tmp_path: Path) -> None:
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(tmp_path / "api.sock"), **config})
    result = subprocess.run(["jmp", "shell", "--exporter-config", str(cfg), "--", "true"], env=jmp_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert message in " ".join((result.stdout + result.stderr).split())


async def test_a_lease_holders_arguments_of_the_wrong_type_are_refused_naming_them(
        start_runtime: Any) -> None:
    """Any JSON reaches an exported call, whatever the stock client sends: ``wait_ready("nan")``
    polled the runtime for ever, ``flash_oci(5)`` was "'float' object has no attribute
    'removeprefix'" (gRPC UNKNOWN)."""
    from jumpstarter.client.core import DriverInvalidArgument
    from jumpstarter.common.utils import serve

    from jumpstarter_driver_vmsidecar.driver import VirtualMachine

    rt = await start_runtime(None)

    def calls() -> None:
        with serve(VirtualMachine(socket=str(rt.socket))) as client:
            for timeout in ("nan", float("inf"), [1], True, -1, 1e9):
                with pytest.raises(DriverInvalidArgument, match="timeout must be a number of seconds"):
                    client.call("wait_ready", timeout)
            for reference in (5.0, None, ["oci://x/y:1"], {"ref": "x"}):
                with pytest.raises(DriverInvalidArgument, match="reference must be a string"):
                    list(client.storage.streamingcall("flash_oci", reference, None))

    await asyncio.wait_for(asyncio.to_thread(calls), 120)


def test_a_synchronous_runtime_call_gives_up_at_its_timeout(tmp_path: Path) -> None:
    """``reset()`` claims with a 120 s bound and ``close()`` shuts the runtime down with 60 s, from
    synchronous code: the bound raised on time, but leaving the call's thread pool waited for the
    call itself (up to the client's 600 s), so the exporter's reset or close hung that long."""
    import time

    from jumpstarter_driver_vmsidecar.link import RuntimeLink

    async def slow(_client: Any) -> int:
        await asyncio.sleep(30)
        return 0

    link = RuntimeLink(tmp_path / "api.sock")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        link.run_sync(slow, timeout=1)
    assert time.monotonic() - started < 5, f"run_sync returned after {time.monotonic() - started:.1f} s"
