"""`DrainingServer`: uvicorn's server with the shutdown a server under traffic needs.

    server = DrainingServer(uvicorn.Config(app, http=header_timeout_protocol(10.0), **CONFIG_LIMITS), manager,
                            drain_timeout=30)
    server.run(sockets=[sock])
    exit_code = server.exit_code()     # 0 after a clean drain, 1 after the engine failed

On SIGTERM / SIGINT (or `should_exit`): the listening socket closes, the manager refuses new requests, ends the
queued ones at once (503 / an SSE error event), and gives the running ones `drain_timeout` seconds; then it ends
them with an error event, so every stream closes with `[DONE]` or an error, never cut mid-air, and uvicorn's own
grace period (a little longer) finds no connection left to cut. A second signal (Ctrl-C twice) ends the running
ones at once, the same way (uvicorn would drop their connections mid-body); a third drops them. If the engine's
thread dies, the server shuts down by itself and `exit_code()` is 1, so a supervisor restarts the process.

`header_timeout_protocol` bounds every request's headers, a keep-alive connection's later requests included: their
bytes (431 beyond `max_header_bytes`, counted before the parser holds them) and the time they take to arrive.
"""

from __future__ import annotations

import contextlib
import json

from .protocol import error_body

# Seconds uvicorn waits beyond the drain for responses to be written out before it cancels them.
FLUSH_GRACE_S = 5.0
# Seconds a connection has to send a request's headers, from its opening or the end of its previous response (a
# client that trickles them holds a connection).
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Bytes of one request's request line and headers.
DEFAULT_MAX_HEADER_BYTES = 32 << 10
# uvicorn's own bounds: connections served at once (beyond: 503), and h11's buffer for an incomplete request head
# (where uvicorn runs h11 rather than httptools).
MAX_CONNECTIONS = 1024
CONFIG_LIMITS = dict(limit_concurrency=MAX_CONNECTIONS, h11_max_incomplete_event_size=DEFAULT_MAX_HEADER_BYTES)


def _uvicorn():
    try:
        import uvicorn
    except ImportError as error:
        raise ImportError(f'the server needs fastapi and uvicorn: pip install "moe_jax[serve]" ({error})') from None
    return uvicorn


def draining_server_class():
    uvicorn = _uvicorn()

    class DrainingServer(uvicorn.Server):
        def __init__(self, config, manager, *, drain_timeout: float):
            config.timeout_graceful_shutdown = drain_timeout + FLUSH_GRACE_S
            super().__init__(config)
            self.manager, self.drain_timeout = manager, drain_timeout
            self.engine_failed = self.ending_now = False

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and not self.ending_now:   # the second signal: end the running requests now
                self.ending_now = True
                self.manager.begin_drain(0.0)
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.manager.error is not None:   # the engine's thread died: stop, so a supervisor restarts us
                self.engine_failed = True
                return True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None) -> None:
            self.manager.begin_drain(self.drain_timeout)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            """A graceful shutdown on SIGTERM / SIGINT ends `run` normally (uvicorn raises the signal again once
            it has shut down, which would kill the process before the engine stops)."""
            with super().capture_signals():
                try:
                    yield
                finally:
                    getattr(self, "_captured_signals", []).clear()

        def exit_code(self) -> int:
            return 1 if self.engine_failed or self.manager.error is not None else 0

    return DrainingServer


def header_timeout_protocol(seconds: float = DEFAULT_HEADER_TIMEOUT_S,
                            max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES):
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks) that bounds each request's head: a
    connection whose next request's headers have not all arrived `seconds` after it opened, or after its previous
    response ended, is closed (uvicorn waits forever once a byte has come); a request whose request line and
    headers pass `max_header_bytes` gets 431 and the connection is closed, before the parser has held more."""
    _uvicorn()
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class BoundedHeadProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_bytes, self._tail, self._awaiting_head = 0, b"", True
            self._header_timer = None
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._headers_overdue, self.cycle)

        def _headers_overdue(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():   # no new request's headers since
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head:   # between a request's end and the next one's headers' end
                scan = self._tail + data
                end = _head_end(scan)
                self._head_bytes += len(data) if end < 0 else max(end - len(self._tail), 0)
                if self._head_bytes > max_header_bytes:
                    return self._refuse_head()
                self._tail = scan[-3:]
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:   # a new request's headers have all arrived
                self._header_timer.cancel()
                self._head_bytes, self._tail = 0, b""
            self._awaiting_head = self.cycle is None or not self.cycle.more_body

        def _refuse_head(self) -> None:
            if self.cycle is None or self.cycle.response_complete:   # else a response is being written: just close
                body = json.dumps(error_body(f"the request's headers take more than {max_header_bytes} bytes.",
                                             code="request_header_fields_too_large")).encode()
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
                                     b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
                self._arm_header_timer()   # no pipelined request waits: the next one's headers are due in time

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return BoundedHeadProtocol


def _head_end(data: bytes) -> int:
    """Where the blank line ending a request's head ends in `data` (-1: not in it)."""
    ends = [found + len(blank) for blank in (b"\r\n\r\n", b"\n\n") if (found := data.find(blank)) >= 0]
    return min(ends, default=-1)
