"""The client side's one poll loop, and the page-by-page drain of an inbox.

:func:`poll` asks the broker for messages again and again, long-polling when
the broker advertises it (``capabilities.longPoll`` in ``GET /``) and
otherwise waiting between empty answers. The agent runtime leases with it
(``POST /v1/pull``); ``relay watch`` reads its inbox with it
(``GET /messages``). :func:`drain` reads an inbox until it is empty
(``relay recv``).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater

from relay.wire.errors import RelayError

# An empty long-poll answer that came back sooner than this was not held by
# the broker, so the loop waits before asking again instead of spinning.
MIN_HELD_SECONDS = 1.0

Message = Dict[str, Any]


async def poll(
    fetch: Callable[[Optional[float]], Awaitable[Sequence[Message]]],
    deliver: Callable[[Sequence[Message]], Awaitable[None]],
    *,
    clock: IReactorTime,
    wait: Optional[float],
    interval: float,
    running: Callable[[], bool],
    on_error: Callable[[RelayError], None],
    sleep: Optional[Callable[[float], Awaitable[Any]]] = None,
) -> None:
    """Fetch messages and deliver them for as long as ``running()`` is true.

    :param fetch: asks the broker once; called with ``wait``, the seconds it
        may long-poll (``None`` when the broker does not offer long polling),
        and returns the messages of the answer.
    :param deliver: called with the messages of every answer, empty or not;
        the next fetch starts when it is done.
    :param interval: seconds to wait after an empty answer that was not held
        (no long polling, or a broker that answered at once) and after a
        failure.
    :param on_error: called with each ``RelayError`` of ``fetch``; the loop
        then waits ``interval`` and goes on. Other exceptions end the loop.
    :param sleep: how to wait (default: ``deferLater`` on ``clock``), for a
        caller that needs to cancel the wait.
    """
    pause = sleep if sleep is not None else (lambda seconds: deferLater(clock, seconds))
    while running():
        started = clock.seconds()
        try:
            messages = await fetch(wait)
        except RelayError as error:
            on_error(error)
            await pause(interval)
            continue
        held = clock.seconds() - started
        await deliver(messages)
        if not messages and (not wait or held < MIN_HELD_SECONDS):
            await pause(interval)


async def drain(
    fetch_page: Callable[[], Awaitable[Sequence[Message]]], max_pages: int
) -> List[Message]:
    """The messages of up to ``max_pages`` pages, until a page brings nothing new.

    Each message id is kept once, in the order first seen.
    """
    received: List[Message] = []
    seen = set()
    for _ in range(max_pages):
        page = await fetch_page()
        fresh = [message for message in page if message.get("id") not in seen]
        if not fresh:
            break
        seen.update(message.get("id") for message in fresh)
        received.extend(fresh)
    return received
