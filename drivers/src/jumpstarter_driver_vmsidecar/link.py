"""The link from a driver tree to its runtime: one API client, the lease claim, error translation.

Every child driver of one ``VirtualMachine`` shares one ``RuntimeLink``. A lease's tree claims the
VM (``POST /v1/vm/lease``) when the exporter hands the lease out (``claim_now`` from ``reset()``),
so a lease never sees a guest an earlier lease used, and is recycled even when it only used
children that never call the runtime (CAN, network forwards). Should that claim fail (the runtime
not up yet), the first call of the lease claims instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import GenerationChangedError, VmsidecarError
from vmsidecar_contract.spec import VmSpec

T = TypeVar("T")
#: how long a tree's reset() waits for its claim: a capture under way (seconds under TCG), or the
#: recycle of a lease whose end the runtime has not seen yet (stop + restore or cold launch)
CLAIM_TIMEOUT_S = 120.0
_closing: set[asyncio.Task[None]] = set()
log = logging.getLogger(__name__)


def translate(e: VmsidecarError) -> Exception:
    """Map a runtime error onto what Jumpstarter turns into the right gRPC status.

    The runtime's sentence is kept verbatim: the ``j`` user reads exactly what the runtime said.
    """
    if 400 <= e.http_status < 500:
        return ValueError(e.message)  # INVALID_ARGUMENT on the client side
    return RuntimeError(e.message)


@dataclass
class RuntimeLink:
    """Shared by the children of one driver tree (one tree per lease in controller mode)."""

    socket: Path
    spec: VmSpec | None = None
    claim_leases: bool = True
    claimed_generation: int | None = None
    #: set when the tree's lease ends (its ``close``): the link claims nothing from then on
    ended: bool = False
    #: called once, right after this tree claimed the VM (ExitAndReplace hooks in here)
    on_claim: Callable[[], None] | None = None
    #: what this tree's claims name: the runtime answers a claim it already carried out for it again
    claim_token: str = field(default_factory=lambda: secrets.token_hex(16))
    _client: RuntimeClient | None = field(default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _claim_lock: asyncio.Lock | None = field(default=None, repr=False)
    _claim_mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def client(self) -> RuntimeClient:
        """The API client bound to the running event loop, and to the generation this tree claimed:
        once the VM has moved on (the next lease claimed it) a call of this tree is refused."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = RuntimeClient(self.socket)
            self._loop = loop
            self._claim_lock = asyncio.Lock()
        self._client.generation = self.claimed_generation
        return self._client

    async def call(self, fn: Callable[[RuntimeClient], Awaitable[T]], *, claim: bool = True) -> T:
        """Run one API call (claiming the VM first in a new lease); runtime errors become driver errors.

        Every call of a lease claims, reads included: a lease that touched the VM in any way counts
        as used (ExitAndReplace ends the pod after it; InPlaceReuse recycles after it).
        """
        try:
            if claim:
                await self.claim()
            try:
                return await fn(self.client())
            except GenerationChangedError:
                if not await self._claim_again():
                    raise
                return await fn(self.client())
            except VmsidecarError as e:
                if e.code != "no_spec" or self.spec is None:
                    raise
                # the runtime restarted without a spec of its own: give it ours again, then retry
                await self.client().put_spec(self.spec)
                return await fn(self.client())
        except VmsidecarError as e:
            raise translate(e) from e

    async def check(self) -> None:
        """One API call bound to this tree's lease (its claim, at a lease's first call), for what
        reaches the guest past the API (console, forward and GPIO sockets): it fails, as every call of
        the tree does, once the VM moved on to the next lease. Streams call it before they open their
        socket and again once connected: a claim landing in between would hand them the next lease's."""
        await self.call(lambda c: c.state())

    async def _claim_again(self) -> bool:
        """The VM is no longer at this tree's generation, or it is unclaimed: claim it again when no
        lease has it and this tree's lease has not ended (the runtime restarted: its generations
        begin anew), never when another lease has it (the call must act on nothing of the next).
        True when claimed again."""
        if self.claimed_generation is None or not self.claim_leases or self.ended:
            return False
        if (await self.client().state(bound=False)).claimed:
            return False
        async with self._locked_claim():
            if self.ended:  # (the tree's close began meanwhile: its recycle made the generation unclaimed)
                return False
            await self._claim_unbound("again: the runtime restarted (its generation unclaimed)")
        return True

    async def claim(self) -> None:
        """Claim the VM once per driver tree."""
        if not self.claim_leases or self.claimed_generation is not None:
            return
        async with self._locked_claim():
            if self.claimed_generation is None and not self.ended:
                await self._claim_unbound("at the first call of the lease")

    @contextlib.asynccontextmanager
    async def _locked_claim(self) -> AsyncIterator[None]:
        """One claim at a time: this loop's and ``claim_now``'s thread (a late runtime)."""
        self.client()  # (the lock is the running loop's, made with its client)
        assert self._claim_lock is not None
        async with self._claim_lock:
            while not self._claim_mutex.acquire(blocking=False):
                await asyncio.sleep(0.05)
            try:
                yield
            finally:
                self._claim_mutex.release()

    async def _claim_unbound(self, when: str) -> None:
        """Claim through a client of its own, bound to no generation (the tree's client names the one
        it claims last, for the calls under way)."""
        async with RuntimeClient(self.socket) as client:
            self._claimed(await self._claim_with(client), when)

    async def _claim_with(self, client: RuntimeClient) -> int:
        # the link's token: a claim whose answer a timeout lost is answered again, not made twice; the
        # spec: a runtime that started without one, or runs one an earlier lease set, runs this one
        return (await client.claim(self.claim_token, spec=self.spec)).generation

    def claim_now(self, timeout: float | None = None) -> None:
        """Claim from synchronous code: ``reset()`` of a tree the exporter hands to a lease (or the
        thread that retries it while the runtime does not answer yet). Never twice: a second claim
        of one lease would recycle its own guest."""
        with self._claim_mutex:
            if self.claim_leases and self.claimed_generation is None and not self.ended:
                self._claimed(self.run_sync(self._claim_with, CLAIM_TIMEOUT_S if timeout is None else timeout),
                              "as the lease was handed out")

    def _claimed(self, generation: int, when: str) -> None:
        self.claimed_generation = generation
        log.info("claimed the VM at generation %d %s", generation, when)
        if self.on_claim is not None:
            self.on_claim()

    def close(self) -> None:
        """Close the API client's connection pool on its loop (called from the sync ``close`` hook)."""
        client, loop = self._client, self._loop
        self._client = self._loop = None
        if client is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task = loop.create_task(client.close())
            _closing.add(task)
            task.add_done_callback(_closing.discard)
        else:
            asyncio.run_coroutine_threadsafe(client.close(), loop)

    def run_sync(self, coro_fn: Callable[[RuntimeClient], Coroutine[Any, Any, T]], timeout: float = 120) -> T:
        """Run an API call from synchronous code (``close()``/``reset()``) on a private loop, given up
        (cancelled, its connection closed) after ``timeout`` seconds.

        :raise TimeoutError: it did not end within ``timeout``."""

        async def runner() -> T:
            async with RuntimeClient(self.socket) as client:
                # the bound is kept on the call's own loop: leaving the pool below waits for it
                return await asyncio.wait_for(coro_fn(client), timeout)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, runner()).result()
