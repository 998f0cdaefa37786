"""The blocking API client, for short-lived processes (the ``vmsidecar-runtime`` client commands).

Same API, same error classes and messages as :class:`vmsidecar_contract.client.RuntimeClient`,
over :mod:`http.client` (stdlib): a CLI command pays ~0.02 s of imports here against ~0.35 s for
aiohttp, asyncio and the pydantic models (docs/decisions.md, "Issue 21 — fast CLI"). Answers are
the runtime's JSON as dicts. What both clients must agree on (the unavailable error, error bodies,
the wait-ready verdict) is defined here, and ``client`` imports it. Methods and paths come from
the endpoint table (``endpoints``, plain data: no pydantic).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from . import (
    DEFAULT_SHARED_DIR,  # noqa: F401  (where the client commands have always found it)
    errors,
)
from . import endpoints as api
from .endpoints import Endpoint

#: how long a Stopped VM is given to start booting before ``wait_ready`` gives up
STOPPED_GRACE_S = 5.0
#: seconds to connect to the API socket (as the async client's ``sock_connect``)
CONNECT_TIMEOUT_S = 5.0


class RuntimeUnavailableError(errors.VmsidecarError):
    """The runtime's API socket is missing or does not answer."""

    code = "runtime_unavailable"
    http_status = 503


def error_from_body(body: dict[str, Any], status: int) -> errors.VmsidecarError:
    """Rebuild the runtime's exception (its class and fields) from an error body."""
    return errors.from_wire(body, status)


def stream_error(line: dict[str, Any]) -> errors.VmsidecarError:
    """The exception of an ``error`` line in a streamed answer (after the 200: the status its class answers with)."""
    cls = errors.registry().get(str(line.get("error")), errors.VmsidecarError)
    return error_from_body(line, cls.http_status)


def unavailable(socket_path: Path, e: BaseException) -> RuntimeUnavailableError:
    """The error for a socket that is missing or does not answer."""
    if not socket_path.exists():
        why = f"{socket_path} does not exist"
    else:
        why = f"{socket_path} does not answer ({type(e).__name__})"
    return RuntimeUnavailableError(
        f"the vmsidecar runtime is not reachable: {why}; start it (vmsidecar-runtime serve) or fix the socket path"
    )


class ReadyWait:
    """The verdict of ``wait_ready``, one observed state at a time (both clients poll with it)."""

    def __init__(self, timeout: float, stopped_grace: float, now: float) -> None:
        self.timeout = timeout
        self.deadline = now + timeout
        self.stopped_grace = stopped_grace
        self.stopped_since: float | None = None

    def ready(self, phase: str, last_error: Mapping[str, Any] | None, now: float) -> bool:
        """True when Ready; False to poll again.

        :raise GuestError: (or the runtime's error) when it is in Error/Crashed, or stays Stopped.
        :raise TimeoutError: when the deadline has passed.
        """
        if phase == "Ready":
            return True
        if phase in ("Error", "Crashed") and last_error:
            raise error_from_body(dict(last_error), 500)
        # Stopped is also the moment between a start (or a recycle) and its boot: only a
        # Stopped that lasts means no boot is coming.
        self.stopped_since = (self.stopped_since or now) if phase == "Stopped" else None
        if self.stopped_since is not None and now - self.stopped_since > self.stopped_grace:
            raise errors.GuestError(f"the VM is {phase} and nothing is booting it; power it on "
                                    "(j vm power on, or POST /v1/vm/power {\"action\": \"on\"})")
        if now > self.deadline:
            raise TimeoutError(f"VM not Ready after {self.timeout:.0f} s (phase {phase})")
        return False


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("vmsidecar", timeout=timeout, blocksize=1 << 20)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(str(self._path))
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self.timeout)
        self.sock = sock


class BlockingRuntimeClient:
    """Blocking client of one runtime's ``api.sock``: one connection per request."""

    def __init__(self, socket_path: str | Path, *, timeout: float = 600.0) -> None:
        self.socket_path = Path(socket_path)
        self._timeout = timeout

    def _open(self, endpoint: Endpoint, *, body: Any = None, params: Mapping[str, str] | None = None,
              headers: Mapping[str, str] | None = None) -> http.client.HTTPResponse:
        """Send a request and return the answer's head."""
        method, path = endpoint.method, endpoint.path
        conn = _UnixConnection(self.socket_path, self._timeout)
        hdrs = dict(headers or {})
        if body is not None and not hasattr(body, "read"):
            body, hdrs["Content-Type"] = json.dumps(body).encode(), "application/json"
        try:
            conn.request(method, path + (f"?{urlencode(params)}" if params else ""), body=body, headers=hdrs)
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise unavailable(self.socket_path, e) from e

    def _request(self, endpoint: Endpoint, **kwargs: Any) -> Any:
        """The answer's JSON; a status other than the row's success is raised as its error."""
        resp = self._open(endpoint, **kwargs)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise unavailable(self.socket_path, e) from e
        finally:
            resp.close()
        body = json.loads(raw) if raw.strip() else {}
        if resp.status != endpoint.status:
            raise error_from_body(body if isinstance(body, dict) else {}, resp.status)
        return body

    def _stream(self, endpoint: Endpoint, **kwargs: Any) -> http.client.HTTPResponse:
        """The head of a streamed answer; an error answer is read whole and raised."""
        resp = self._open(endpoint, **kwargs)
        if resp.status != endpoint.status:
            raw = resp.read()
            resp.close()
            raise error_from_body(json.loads(raw) if raw.strip() else {}, resp.status)
        return resp

    def state(self) -> dict[str, Any]:
        """``GET /v1/vm``."""
        return dict(self._request(api.GET_VM))

    def power(self, action: str, *, graceful: bool | None = None, timeout: float = 60.0) -> dict[str, Any]:
        """``POST /v1/vm/power``."""
        body: dict[str, Any] = {"action": action, "timeout": timeout}
        if graceful is not None:
            body["graceful"] = graceful
        return dict(self._request(api.POST_POWER, body=body))

    def recycle(self, *, boot: bool = True) -> dict[str, Any]:
        """``POST /v1/vm/recycle``."""
        return dict(self._request(api.POST_RECYCLE, body={"boot": boot}))

    def shutdown(self) -> None:
        """``POST /v1/shutdown``: the guest stops and the runtime exits 0."""
        self._request(api.POST_SHUTDOWN)

    def flash(self, path: Path, *, power_off: bool = False) -> dict[str, Any]:
        """``PUT /v1/vm/disk`` with a local file.

        :raise VmsidecarError: ``path`` is no file this user can read (before any request).
        """
        if path.is_dir():
            raise errors.VmsidecarError(f"cannot read {path}: it is a directory; name a disk image file")
        try:
            fh = open(path, "rb")  # noqa: SIM115 (the with below closes it; opened apart to say why it cannot be)
        except OSError as e:
            raise errors.VmsidecarError(f"cannot read {path}: {e.strerror}; name a disk image file you can read") from e
        with fh:
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(os.fstat(fh.fileno()).st_size)}
            return dict(self._request(api.PUT_DISK, body=fh, headers=headers,
                                      params={"power_off": "true" if power_off else "false"}))

    def flash_reference(self, reference: str, *, power_off: bool = False,
                        progress: Callable[[int, int | None], None] | None = None) -> dict[str, Any]:
        """``POST /v1/vm/disk/pull``: the runtime pulls and flashes; progress lines feed ``progress``."""
        resp = self._stream(api.POST_PULL, body={"reference": reference, "power_off": power_off})
        try:
            for raw in resp:
                line = json.loads(raw)
                if line["type"] == "progress" and progress:
                    progress(int(line["done"]), line.get("total"))
                elif line["type"] == "result":
                    return dict(line["state"])
                elif line["type"] == "error":
                    raise stream_error(line)
        except (OSError, http.client.HTTPException) as e:
            raise unavailable(self.socket_path, e) from e
        finally:
            resp.close()
        raise errors.VmsidecarError("the runtime ended the pull stream without a result; check the runtime log")

    def dump(self, dest: Path, *, fmt: str = "qcow2") -> int:
        """``GET /v1/vm/disk`` into ``dest``; returns the byte count.

        :raise VmsidecarError: ``dest`` cannot be written (:func:`dump_target_problem`, before any request).
        """
        if (problem := dump_target_problem(dest)) is not None:
            raise errors.VmsidecarError(f"cannot write the disk to {dest}: {problem}")
        resp = self._stream(api.GET_DISK, params={"format": fmt})
        total = 0
        tmp = dest.with_name(dest.name + ".part")
        try:
            with open(tmp, "wb") as fh:
                while chunk := resp.read(1 << 20):
                    fh.write(chunk)
                    total += len(chunk)
            tmp.replace(dest)
        except (OSError, http.client.HTTPException) as e:
            tmp.unlink(missing_ok=True)  # a half-written disk is no dump, and a whole one is not where asked
            if isinstance(e, OSError) and not isinstance(e, ConnectionError | TimeoutError):
                raise  # the local file, not the runtime
            raise unavailable(self.socket_path, e) from e
        finally:
            resp.close()
        return total

    def healthy(self) -> bool:
        """Whether ``/healthz`` answers."""
        try:
            self._request(api.GET_HEALTHZ)
            return True
        except RuntimeUnavailableError:
            return False

    def wait_ready(self, timeout: float = 300.0, *, poll: float = 0.25,
                   stopped_grace: float = STOPPED_GRACE_S) -> dict[str, Any]:
        """Poll until the VM is Ready (the verdicts of :class:`ReadyWait`)."""
        wait = ReadyWait(timeout, stopped_grace, time.monotonic())
        while True:
            state = self.state()
            if wait.ready(str(state.get("phase")), state.get("last_error"), time.monotonic()):
                return state
            time.sleep(poll)

    def wait_stored(self, timeout: float = 60.0, *, poll: float = 0.05) -> dict[str, Any]:
        """Poll until no capture is being written into the cache (``snapshot.storing`` false), as
        :meth:`.client.RuntimeClient.wait_stored`.

        :raise TimeoutError: when it is still being stored after ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while (state := self.state()).get("snapshot", {}).get("storing"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the captured snapshot was still being stored after {timeout:.0f} s")
            time.sleep(poll)
        return state


def dump_target_problem(dest: Path) -> str | None:
    """Why a dump cannot be written at ``dest``, checked before a whole disk streams to it (the
    runtime's CLI and the driver's ``j vm storage dump``); None when it can be tried."""
    if dest.is_dir():
        return f"it is a directory; name a file (as {dest / 'disk.qcow2'})"
    if not dest.resolve().parent.is_dir():
        return f"{dest.parent} does not exist; create it first"
    return None
