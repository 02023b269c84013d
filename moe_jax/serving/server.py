"""`DrainingServer`: uvicorn's server with the shutdown a server under traffic needs.

    server = DrainingServer(uvicorn.Config(app, http=header_timeout_protocol(10.0)), manager, drain_timeout=30)
    server.run(sockets=[sock])
    exit_code = server.exit_code()     # 0 after a clean drain, 1 after the engine failed

On SIGTERM / SIGINT (or `should_exit`): the listening socket closes, the manager refuses new requests, ends the
queued ones at once (503 / an SSE error event), and gives the running ones `drain_timeout` seconds; then it ends
them with an error event, so every stream closes with `[DONE]` or an error, never cut mid-air, and uvicorn's own
grace period (a little longer) finds no connection left to cut. If the engine's thread dies, the server shuts down
by itself and `exit_code()` is 1, so a supervisor restarts the process.
"""

from __future__ import annotations

import contextlib

# Seconds uvicorn waits beyond the drain for responses to be written out before it cancels them.
FLUSH_GRACE_S = 5.0
# Seconds a new connection has to send its request headers (a client that trickles them holds a connection).
DEFAULT_HEADER_TIMEOUT_S = 10.0


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
            self.engine_failed = False

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


def header_timeout_protocol(seconds: float = DEFAULT_HEADER_TIMEOUT_S):
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks) that closes a connection whose first
    request's headers have not all arrived `seconds` after it opened (uvicorn itself waits forever)."""
    _uvicorn()
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._headers_overdue)

        def _headers_overdue(self) -> None:
            if getattr(self, "cycle", None) is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
