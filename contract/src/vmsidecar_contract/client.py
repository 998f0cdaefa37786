"""The API client: one implementation, used by the CLI and by the Jumpstarter drivers.

Each method calls one row of the endpoint table (``endpoints``); tests/test_endpoint_table.py
checks that the methods reach every row. Errors come back as the same exception classes the
runtime raised, with the runtime's message verbatim, so a ``j`` user reads exactly what the
runtime said.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from . import endpoints as api
from . import errors
from .blocking import (
    STOPPED_GRACE_S,
    ReadyWait,
    RuntimeUnavailableError,
    error_from_body,
    stream_error,
    unavailable,
)
from .endpoints import Endpoint
from .models import Health
from .spec import VmSpec
from .state import VmState

__all__ = ["STOPPED_GRACE_S", "Observer", "RuntimeClient", "RuntimeUnavailableError", "error_from_body", "observe"]


class Observer(Protocol):
    """Test mode: sees every request and answer of every ``RuntimeClient`` (the tests install one
    that checks them against docs/api/openapi.json; see ``observe``)."""

    def request(self, method: str, path: str, body: Any) -> None:
        """Before sending: the JSON body (None without one, or for a byte stream)."""

    def response(self, method: str, path: str, status: int, headers: Mapping[str, str], body: bytes | None) -> None:
        """The answer: the whole body, or None for a stream (its NDJSON lines follow as ``line``)."""

    def line(self, method: str, path: str, status: int, line: bytes) -> None:
        """One line of an NDJSON stream."""


_observer: Observer | None = None


def observe(observer: Observer | None) -> Observer | None:
    """Install (or with None remove) the test-mode observer; returns the one it replaces."""
    global _observer
    previous, _observer = _observer, observer
    return previous


class RuntimeClient:
    """Async client of one runtime's ``api.sock``."""

    def __init__(self, socket_path: str | Path, *, timeout: float = 600.0) -> None:
        self.socket_path = Path(socket_path)
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None
        #: the generation the caller's lease claimed: every call but the claim names it
        #: (``api.GENERATION_HEADER``) and fails with GenerationChangedError once the VM moved on
        self.generation: int | None = None

    def _bound(self, endpoint: Endpoint, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with the lease's generation among the headers, for a lease-bound row (not for a
        call made with ``bound=False``)."""
        if not kwargs.pop("bound", True) or self.generation is None or not endpoint.lease_bound:
            return kwargs
        return {**kwargs,
                "headers": {**kwargs.get("headers", {}), api.GENERATION_HEADER: str(self.generation)}}

    async def __aenter__(self) -> RuntimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(self.socket_path)),
                timeout=self._timeout,
                base_url="http://vmsidecar",
            )
        return self._session

    def _unavailable(self, e: Exception) -> RuntimeUnavailableError:
        return unavailable(self.socket_path, e)

    async def _request(self, endpoint: Endpoint, *, ok: tuple[int, ...] = (), **kwargs: Any) -> Any:
        """The answer's JSON; a status other than the row's success (or ``ok``) is raised as its error."""
        method, path = endpoint.method, endpoint.path
        if _observer:
            _observer.request(method, path, kwargs.get("json"))
        try:
            async with self._http().request(method, path, **self._bound(endpoint, kwargs)) as resp:
                raw = await resp.read()
                if _observer:
                    _observer.response(method, path, resp.status, resp.headers, raw)
                body = json.loads(raw) if raw.strip() else {}
                if resp.status != endpoint.status and resp.status not in ok:
                    raise error_from_body(body if isinstance(body, dict) else {}, resp.status)
                return body
        except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError) as e:
            raise self._unavailable(e) from e

    @contextlib.asynccontextmanager
    async def _stream(self, endpoint: Endpoint, **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """A streamed answer, from its head on; an error answer is read whole and raised."""
        method, path = endpoint.method, endpoint.path
        if _observer:
            _observer.request(method, path, kwargs.get("json"))
        async with self._http().request(method, path, **self._bound(endpoint, kwargs)) as resp:
            if resp.status != endpoint.status:
                raw = await resp.read()
                if _observer:
                    _observer.response(method, path, resp.status, resp.headers, raw)
                raise error_from_body(json.loads(raw) if raw.strip() else {}, resp.status)
            if _observer:
                _observer.response(method, path, resp.status, resp.headers, None)
            yield resp

    @staticmethod
    async def _lines(endpoint: Endpoint, resp: aiohttp.ClientResponse) -> AsyncIterator[Any]:
        """The JSON objects of an NDJSON answer."""
        async for raw in resp.content:
            if _observer:
                _observer.line(endpoint.method, endpoint.path, resp.status, raw)
            yield json.loads(raw)

    # ---- state and spec ------------------------------------------------------------------
    async def state(self, *, bound: bool = True) -> VmState:
        """``GET /v1/vm``; ``bound=False``: whatever the generation (the caller's lease may have ended)."""
        return VmState.model_validate(await self._request(api.GET_VM, bound=bound))

    async def get_spec(self) -> VmSpec | None:
        """``GET /v1/vm/spec``; None when the runtime has none yet."""
        try:
            return VmSpec.model_validate(await self._request(api.GET_SPEC))
        except errors.VmsidecarError as e:
            if e.code == "not_found":
                return None
            raise

    async def put_spec(self, spec: VmSpec | dict[str, Any]) -> VmState:
        """``PUT /v1/vm/spec`` (idempotent)."""
        data = spec.to_json() if isinstance(spec, VmSpec) else spec  # keeps what readiness leaves unset
        return VmState.model_validate(await self._request(api.PUT_SPEC, json=data))

    # ---- power ---------------------------------------------------------------------------
    async def power(self, action: str, *, graceful: bool | None = None, timeout: float = 60.0) -> VmState:
        """``POST /v1/vm/power``."""
        body: dict[str, Any] = {"action": action, "timeout": timeout}
        if graceful is not None:
            body["graceful"] = graceful
        return VmState.model_validate(await self._request(api.POST_POWER, json=body))

    async def recycle(self, *, boot: bool = True, if_generation: int | None = None) -> VmState:
        """``POST /v1/vm/recycle``."""
        body: dict[str, Any] = {"boot": boot}
        if if_generation is not None:
            body["if_generation"] = if_generation
        return VmState.model_validate(await self._request(api.POST_RECYCLE, json=body))

    async def claim(self, token: str | None = None, spec: VmSpec | None = None) -> VmState:
        """``POST /v1/vm/lease``: a generation no earlier lease has used (``token``: the claimer's, so
        that asking again after a lost answer claims nothing twice), running ``spec`` when given."""
        body: dict[str, Any] = {} if token is None else {"token": token}
        if spec is not None:
            body["spec"] = spec.to_json()
        return VmState.model_validate(await self._request(api.POST_LEASE, json=body or None))

    async def shutdown(self) -> None:
        """``POST /v1/shutdown``: the guest stops and the runtime exits 0."""
        await self._request(api.POST_SHUTDOWN)

    # ---- disk ----------------------------------------------------------------------------
    async def flash(
        self,
        data: AsyncIterable[bytes] | Path,
        *,
        power_off: bool = False,
        digest: str | None = None,
        size: int | None = None,
    ) -> VmState:
        """``PUT /v1/vm/disk`` with a file or an async byte stream."""
        params = {"power_off": "true" if power_off else "false"}
        if digest:
            params["digest"] = digest
        headers = {"Content-Type": "application/octet-stream"}
        if isinstance(data, Path):
            headers["Content-Length"] = str(data.stat().st_size)
            body: Any = _file_chunks(data)
        else:
            body = data
            if size is not None:
                headers["Content-Length"] = str(size)
        result = await self._request(api.PUT_DISK, params=params, data=body, headers=headers)
        return VmState.model_validate(result)

    async def flash_reference(
        self, reference: str, *, power_off: bool = False, progress: Callable[[int, int | None], None] | None = None
    ) -> VmState:
        """``POST /v1/vm/disk/pull``: the runtime pulls and flashes; progress lines feed ``progress``."""
        body = {"reference": reference, "power_off": power_off}
        try:
            async with self._stream(api.POST_PULL, json=body) as resp:
                async for line in self._lines(api.POST_PULL, resp):
                    if line["type"] == "progress" and progress:
                        progress(int(line["done"]), line.get("total"))
                    elif line["type"] == "result":
                        return VmState.model_validate(line["state"])
                    elif line["type"] == "error":
                        raise stream_error(line)
        except (aiohttp.ClientConnectionError, FileNotFoundError) as e:
            raise self._unavailable(e) from e
        raise errors.VmsidecarError("the runtime ended the pull stream without a result; check the runtime log")

    async def dump(self, dest: Path, *, fmt: str = "qcow2") -> int:
        """``GET /v1/vm/disk`` into ``dest``; returns the byte count."""
        try:
            async with self._stream(api.GET_DISK, params={"format": fmt}) as resp:
                return await _save(resp.content.iter_chunked(1 << 20), dest)
        except (aiohttp.ClientConnectionError, FileNotFoundError) as e:
            raise self._unavailable(e) from e

    async def dump_chunks(self, *, fmt: str = "qcow2") -> AsyncIterator[bytes]:
        """``GET /v1/vm/disk`` as a byte stream."""
        async with self._stream(api.GET_DISK, params={"format": fmt}) as resp:
            async for chunk in resp.content.iter_chunked(1 << 20):
                yield chunk

    # ---- events and health ---------------------------------------------------------------
    async def events(self, types: list[str] | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """``GET /v1/events`` as dicts, until the caller stops iterating."""
        params = {"types": ",".join(types)} if types else None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        try:
            async with self._stream(api.GET_EVENTS, params=params, timeout=timeout) as resp:
                async for event in self._lines(api.GET_EVENTS, resp):
                    yield event
        except (aiohttp.ClientConnectionError, FileNotFoundError) as e:
            raise self._unavailable(e) from e

    async def healthy(self) -> bool:
        """Whether ``/healthz`` answers."""
        try:
            await self._request(api.GET_HEALTHZ)
            return True
        except RuntimeUnavailableError:
            return False

    async def readiness(self) -> Health:
        """``GET /readyz``: ready or not (the 503 of not-ready is an answer here, not an error)."""
        return Health.model_validate(await self._request(api.GET_READYZ, ok=(503,)))

    async def wait_ready(self, timeout: float = 300.0, *, poll: float = 0.25,
                         stopped_grace: float = STOPPED_GRACE_S) -> VmState:
        """Poll until the VM is Ready.

        :raise GuestError: when it ends in Error/Crashed instead (with the runtime's message), or
            stays Stopped for ``stopped_grace`` seconds (nothing will boot it).
        :raise TimeoutError: when it is not Ready in time.
        """
        loop = asyncio.get_running_loop()
        wait = ReadyWait(timeout, stopped_grace, loop.time())
        while True:
            state = await self.state()
            if wait.ready(state.phase.value, state.last_error, loop.time()):
                return state
            await asyncio.sleep(poll)

    async def wait_spare(self, timeout: float = 60.0, *, poll: float = 0.05) -> VmState:
        """Poll until the spare restore or parked QEMU for the next recycle (the spec's ``standby``)
        is made, or no longer on its way: ``snapshot.standby`` then says which ("ready" or
        "parked", else "none" with its reason, or "off").

        :raise TimeoutError: when it is still being made after ``timeout``.
        """
        async with asyncio.timeout(timeout):
            while (state := await self.state()).snapshot.standby == "preparing" or (
                    state.snapshot.standby == "none" and state.snapshot.standby_reason is None):
                await asyncio.sleep(poll)
        return state

    async def wait_stored(self, timeout: float = 60.0, *, poll: float = 0.05) -> VmState:
        """Poll until no capture is being written into the cache (``snapshot.storing`` false; a
        capture whose guest went on is stored just after Ready): ``snapshot.available`` then says
        whether the snapshot is there.

        :raise TimeoutError: when it is still being stored after ``timeout``.
        """
        async with asyncio.timeout(timeout):
            while (state := await self.state()).snapshot.storing:
                await asyncio.sleep(poll)
        return state


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := await asyncio.to_thread(fh.read, 1 << 20):
            yield chunk


async def _save(chunks: AsyncIterable[bytes], dest: Path) -> int:
    total = 0
    tmp = dest.with_name(dest.name + ".part")
    with open(tmp, "wb") as fh:
        async for chunk in chunks:
            await asyncio.to_thread(fh.write, chunk)
            total += len(chunk)
    tmp.replace(dest)
    return total
