"""Talking to a guest over the runtime's console sockets, as a person at the console would.

The recipes' guests share one shell prompt (``prompt`` in recipe.toml); the tests and bench/ drive
them through :class:`Console`.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

#: the shell prompt of the tiny and debian guests (their recipes set it)
PROMPT = b"vm# "


class Console:
    """One client connection to a console socket (``console.sock`` or ``hvc0.sock``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.seen = bytearray()

    @classmethod
    async def open(cls, path: Path) -> Console:
        reader, writer = await asyncio.open_unix_connection(str(path))
        return cls(reader, writer)

    @classmethod
    async def open_when_served(cls, path: Path, timeout: float = 30) -> Console:
        """Connect as soon as the runtime has created the socket (before the guest prints anything)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return await cls.open(path)
            except (FileNotFoundError, ConnectionRefusedError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def expect(self, pattern: bytes | str, timeout: float = 60) -> re.Match[bytes]:
        """Read until ``pattern`` (regex) appears in what this connection received."""
        regex = re.compile(pattern.encode() if isinstance(pattern, str) else pattern)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (m := regex.search(self.seen)):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"{pattern!r} not seen within {timeout} s; got {bytes(self.seen[-600:])!r}")
            try:
                chunk = await asyncio.wait_for(self.reader.read(4096), remaining)
            except TimeoutError:
                continue
            if not chunk:
                raise EOFError(f"console closed before {pattern!r}; got {bytes(self.seen[-600:])!r}")
            self.seen += chunk
        return m

    async def run(self, command: str, timeout: float = 30) -> str:
        """Run a shell command on the guest and return its output (between unique markers)."""
        tag = uuid.uuid4().hex[:8]
        self.seen.clear()
        self.writer.write(f"echo B{tag}; {command}; echo E{tag}\n".encode())
        await self.writer.drain()
        m = await self.expect(rf"(?s)\nB{tag}\r?\n(.*?)E{tag}\r?\n".encode(), timeout)
        return m.group(1).decode(errors="replace").replace("\r", "")

    async def drain_replay(self, quiet: float = 0.5) -> None:
        """Read what the socket replays on connect (scrollback) until it has been quiet for ``quiet`` s."""
        while True:
            try:
                chunk = await asyncio.wait_for(self.reader.read(65536), quiet)
            except TimeoutError:
                return
            if not chunk:
                raise EOFError("console closed while replaying its scrollback")
            self.seen += chunk

    async def wake(self, timeout: float = 120) -> None:
        """Get a fresh prompt: getty eats the first line, and a replayed old prompt must not count.

        A newline every 4 s until ``timeout``: a caller may connect while the guest still boots, and
        under TCG on a loaded host a tiny guest's boot has taken more than 30 s (its echo lagging
        behind the newlines)."""
        await self.drain_replay()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (remaining := deadline - loop.time()) > 0:
            self.seen.clear()
            self.writer.write(b"\n")
            await self.writer.drain()
            try:
                await self.expect(re.escape(PROMPT), min(4, remaining))
                return
            except TimeoutError:
                continue
        raise TimeoutError(f"no shell prompt on the console within {timeout} s; got {bytes(self.seen[-600:])!r}")

    async def close(self) -> None:
        self.writer.close()
