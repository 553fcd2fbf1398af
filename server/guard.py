"""Connections that never finish their headers (slowloris): uvicorn's h11
protocol with a header deadline and a cap on open connections.

- A connection has `header_timeout` seconds to deliver a request's headers,
  from its opening or from the end of its previous response (uvicorn's
  keep-alive timer stops at the first byte of the next request, so a client
  trickling bytes would otherwise hold the connection forever); then it is
  closed.
- Past `max_open` open connections, the oldest one still waiting for its
  headers is closed to make room (none waiting: the newcomer is), so a flood
  of trickling connections cannot exhaust the process's file descriptors and a
  client that sends its request at once (a `/health` probe) still gets in.
- Closing such connections logs one line a second at most; asyncio's
  "socket.accept() out of system resource" is rate-limited the same way.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("vkengine.server")


class _RateLimited:
    """One log line per `every` seconds for a kind of event, with the count since."""

    def __init__(self, every: float = 1.0):
        self.every, self.last, self.count = every, 0.0, 0

    def hit(self) -> int:
        """How many happened since the last line, when a line is due now (else 0)."""
        self.count += 1
        now = time.monotonic()
        if now - self.last < self.every:
            return 0
        n, self.count, self.last = self.count, 0, now
        return n


class AcceptErrorFilter(logging.Filter):
    """asyncio's logger: "socket.accept() out of system resource" once a second
    with how many there were, instead of thousands a second."""

    def __init__(self):
        super().__init__()
        self.rate = _RateLimited(1.0)

    def filter(self, record: logging.LogRecord) -> bool:
        if "socket.accept() out of system resource" not in record.getMessage():
            return True
        n = self.rate.hit()
        if n:
            record.msg, record.args, record.exc_info = (f"socket.accept() out of system resource ({n} times since "
                                                        "the last line)"), (), None
            return True
        return False


class GuardedH11Protocol(H11Protocol):
    header_timeout = 10.0
    max_open = 1000
    _waiting: OrderedDict[int, GuardedH11Protocol] = OrderedDict()   # awaiting headers, oldest first
    _closed_log = _RateLimited(1.0)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._served: object = None           # the request cycle whose headers came last
        self._wait_headers()
        if len(self.connections) > self.max_open:
            victim = next(iter(self._waiting.values()), None) if self._waiting else None
            (victim or self)._drop("too many open connections: closed the oldest still sending its headers")

    def _wait_headers(self) -> None:
        self._waiting[id(self)] = self
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.header_timeout, self._drop,
                                              f"no request headers within {self.header_timeout:g} s")

    def _got_headers(self) -> None:
        self._waiting.pop(id(self), None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _drop(self, why: str) -> None:
        self._got_headers()
        n = self._closed_log.hit()
        if n:
            log.warning("closed %d connection(s): %s", n, why)
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._served:
            self._served = self.cycle         # a request's headers are in: its body and reply take their time
            self._got_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._wait_headers()              # (the next request's headers have header_timeout too)

    def connection_lost(self, exc) -> None:
        self._got_headers()
        super().connection_lost(exc)
