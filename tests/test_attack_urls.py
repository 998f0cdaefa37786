"""Attack (issue 19): a lease holder names a URL for ``j vm storage flash``, and the exporter —
inside the pod — fetches it with headers the lease holder chooses. Pointed at the pod's loopback
or at the cloud metadata service (``http://169.254.169.254/…``, ``Metadata-Flavor: Google``),
that is a request from inside the pod on the lease holder's word.

Through real ``jmp`` processes: a listener on this machine's loopback stands for a pod-local
service; the flash must be refused before any request reaches it, naming the exporter config's
switch, while the same exporter with ``allow_local_urls: true`` (a laptop) does fetch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import exporter_config, run_shell

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def pod_local_service() -> Iterator[tuple[int, list[str]]]:
    """A plain HTTP server on 127.0.0.1 that records every request it gets: (port, requests)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.requestline)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


async def test_a_flash_url_naming_the_pod_or_the_metadata_service_is_never_fetched(
    start_runtime: Any, standalone_exporter: Any, tmp_path: Path
) -> None:
    rt = await start_runtime(None)
    with pod_local_service() as (port, seen):
        cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket)})
        exp = await asyncio.to_thread(standalone_exporter, cfg)
        for url in (f"http://127.0.0.1:{port}/disk.qcow2", f"http://localhost:{port}/disk.qcow2",
                    "http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token"):
            result = await asyncio.to_thread(run_shell, exp.shell_args, f"j vm storage flash {url}", cwd=tmp_path)
            assert result.returncode != 0, result.stdout
            message = " ".join(result.stderr.split())
            assert "which a lease may not reach" in message and "allow_local_urls" in message, message[-2000:]
        assert seen == [], f"the exporter fetched a pod-local URL for the lease holder: {seen}"
        assert exp.proc.poll() is None  # the exporter keeps serving

        # the control: a laptop's exporter that allows it does fetch the same URL (so the test can fail)
        laptop = exporter_config(tmp_path / "laptop.yaml", {"socket": str(rt.socket), "allow_local_urls": True})
        exp = await asyncio.to_thread(standalone_exporter, laptop)
        await asyncio.to_thread(run_shell, exp.shell_args, f"j vm storage flash http://127.0.0.1:{port}/disk.qcow2",
                                cwd=tmp_path)
        assert seen == ["GET /disk.qcow2 HTTP/1.1"], seen
