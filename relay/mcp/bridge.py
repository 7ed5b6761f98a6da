"""Where the MCP SDK's asyncio loop and the Twisted reactor meet: the only place.

``relay mcp`` runs inside the ``relay`` command, that is inside a running
Twisted reactor in the main thread, and :class:`relay.client.client.RelayClient` (one
client, one signing implementation) must be called in that thread. The MCP SDK
is built on anyio over asyncio, with an event loop of its own. So:

- the SDK's loop runs in a thread of its own (:class:`AsyncioThread`); the
  reactor keeps the main thread, its signal handlers and every broker request;
- a tool handler on the loop calls into the reactor with
  :meth:`ReactorBridge.call`: the function runs in the reactor thread
  (``reactor.callFromThread``), and its Deferred's outcome comes back to an
  asyncio future (``loop.call_soon_threadsafe``);
- cancellation crosses in both directions: a tool call the MCP client cancels
  (or that ends with the session) cancels the Deferred in the reactor, which
  stops the request and its retries; stopping the reactor (SIGTERM, SIGINT)
  cancels the loop's main task through :meth:`AsyncioThread.stop`.

Nothing else in the relay touches both worlds; the reactor side
(:mod:`relay.mcp.tools`) is plain Twisted and the server side
(:mod:`relay.mcp.server`) plain asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Awaitable, Callable, List, Optional

from twisted.internet import defer
from twisted.python.failure import Failure


class ReactorBridge:
    """Runs functions that return Deferreds in the reactor thread, for asyncio code."""

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    async def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` run in the reactor thread; its result (a
        Deferred's, when it returns one), or the exception it failed with.

        Must be awaited on an asyncio loop in another thread than the reactor's.
        Cancelling the awaiting task cancels the Deferred.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        running: List[defer.Deferred] = []

        def settle(outcome: Any) -> None:  # in the loop's thread
            if future.done():
                return  # cancelled meanwhile
            if isinstance(outcome, Failure):
                future.set_exception(outcome.value)
            else:
                future.set_result(outcome)

        def deliver(outcome: Any) -> None:  # in the reactor thread
            # RuntimeError: the loop has closed, nobody waits for this outcome any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, outcome)

        def start() -> None:  # in the reactor thread
            d = defer.maybeDeferred(function, *args, **kwargs)
            running.append(d)
            d.addBoth(deliver)

        def cancel() -> None:  # in the reactor thread, always after start()
            for d in running:
                d.cancel()

        # callFromThread runs its calls in order, so cancel() never precedes start().
        self._reactor.callFromThread(start)
        try:
            return await future
        except asyncio.CancelledError:
            self._reactor.callFromThread(cancel)
            raise


class AsyncioThread:
    """An asyncio loop running ``main()`` in a daemon thread, watched from the reactor.

    :attr:`finished` (a Deferred, fired in the reactor thread) fires with None
    when ``main`` returns or is stopped, or fails with what it raised.
    """

    def __init__(self, reactor: Any, main: Callable[[], Awaitable[None]]) -> None:
        self._reactor = reactor
        self._main = main
        self.finished: defer.Deferred = defer.Deferred()
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._stopping = False
        # A daemon thread: a read of standard input that never returns cannot
        # keep the process alive once the reactor has stopped.
        self._thread = threading.Thread(target=self._run, name="relay-mcp-asyncio", daemon=True)

    def start(self) -> defer.Deferred:
        """Start the thread; :attr:`finished`."""
        self._thread.start()
        return self.finished

    def stop(self) -> None:
        """Cancel ``main`` (from any thread); :attr:`finished` fires once it has unwound."""
        with self._lock:
            self._stopping = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(task.cancel)

    def _run(self) -> None:  # in the thread
        outcome: Any = None
        try:
            asyncio.run(self._guarded())
        except asyncio.CancelledError:
            pass  # stopped
        except BaseException as error:  # noqa: B036 - handed to the reactor, not swallowed
            outcome = Failure(error)
        self._reactor.callFromThread(self._finish, outcome)

    async def _guarded(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
        await self._main()

    def _finish(self, outcome: Any) -> None:  # in the reactor thread
        if isinstance(outcome, Failure):
            self.finished.errback(outcome)
        else:
            self.finished.callback(None)
