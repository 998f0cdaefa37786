"""``jumpstarter.v1.RouterService``: pair two ``Stream`` calls by token and forward frames.

``Dial`` (client) and ``Listen`` (exporter) hand out the same router token; both peers
then open ``RouterService.Stream`` with ``authorization: Bearer <token>``. Every
``StreamRequest`` one peer sends is written to the other as a ``StreamResponse`` with the
same payload and frame type (DATA, PING, GOAWAY, ...).

Half-close: jumpstarter's ``RouterStream.send_eof`` writes GOAWAY and then closes its
sending side, while the other direction may still carry data. So a peer's call ends
(status OK) only once *both* directions are finished; if one peer's call breaks (reset,
cancel), the other is aborted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from jumpstarter_protocol.jumpstarter.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

_DONE = object()  # "the peer finished sending"
_BROKEN = object()  # "the peer's call failed"


def bearer_token(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return ""


@dataclass
class _Pair:
    inboxes: list[asyncio.Queue] = field(default_factory=lambda: [asyncio.Queue(), asyncio.Queue()])
    joined: int = 0
    both: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class RouterStats:
    streams: int = 0  # Stream calls accepted
    pairs: int = 0  # token pairs that got both peers
    frames: int = 0  # frames forwarded (both directions)


class Router(router_pb2_grpc.RouterServiceServicer):
    """Accepts any token that :meth:`expect` announced; ``pair_timeout`` bounds the wait for the peer."""

    def __init__(self, pair_timeout: float = 30.0):
        self.pair_timeout = pair_timeout
        self.stats = RouterStats()
        self._pairs: dict[str, _Pair] = {}

    def expect(self, token: str) -> None:
        """Announce a token (called by ``Dial``, on the event loop)."""
        self._pairs[token] = _Pair()

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        token = bearer_token(context)
        pair = self._pairs.get(token)
        if pair is None or pair.joined >= 2:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown router token")
        side, pair.joined = pair.joined, pair.joined + 1
        self.stats.streams += 1
        if pair.joined == 2:
            self.stats.pairs += 1
            pair.both.set()
            del self._pairs[token]  # a token is good for one pair
        try:
            await asyncio.wait_for(pair.both.wait(), self.pair_timeout)
        except TimeoutError:
            self._pairs.pop(token, None)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "router peer did not connect")

        mine, theirs = pair.inboxes[side], pair.inboxes[1 - side]
        reader = asyncio.create_task(self._pump(context, theirs))
        try:
            while (item := await mine.get()) is not _DONE:
                if item is _BROKEN:
                    await context.abort(grpc.StatusCode.ABORTED, "router peer went away")
                await context.write(router_pb2.StreamResponse(payload=item.payload, frame_type=item.frame_type))
            if not await reader:  # wait until this peer has finished sending, too
                await context.abort(grpc.StatusCode.ABORTED, "router stream broken")
        finally:
            if not reader.done():
                reader.cancel()
                theirs.put_nowait(_BROKEN)
            await asyncio.gather(reader, return_exceptions=True)

    async def _pump(self, context: grpc.aio.ServicerContext, peer: asyncio.Queue) -> bool:
        """Copy this call's requests into the peer's inbox; True on a clean end of stream."""
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                self.stats.frames += 1
                peer.put_nowait(request)
        except Exception as e:  # reset, abort, cancelled call: the peer must not wait forever
            logger.debug("router: stream read failed: %r", e)
            peer.put_nowait(_BROKEN)
            return False
        peer.put_nowait(_DONE)
        return True
