"""``POST /v1/thread`` (EXTENSIONS.md §5): a conversation by its root, paged by ``since``.

In memory, time on a ``task.Clock``.
"""

from __future__ import annotations

import pytest_twisted

from tests.support.api import assert_error, two_agents

# -- v1.2 (EXTENSIONS.md §5) ---------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_thread_paging():
    b = await two_agents()
    await b.message("alpha", "beta", id="root", kind="request")
    for i in range(3):
        await b.message("beta", "alpha", id=f"r{i}", rootId="root", parentId="root")
    page = (await b.post("alpha", "/v1/thread", {"rootId": "root", "limit": 2})).json
    assert ([m["id"] for m in page["messages"]], page["count"], page["cursor"]) == (
        ["root", "r0"], 2, "r0")
    page = (await b.post("alpha", "/v1/thread", {"rootId": "root", "since": "r0"})).json
    assert ([m["id"] for m in page["messages"]], page["cursor"]) == (["r1", "r2"], "r2")
    page = (await b.post("alpha", "/v1/thread", {"rootId": "root", "limit": 0})).json
    assert page["count"] == 1, "limit is clamped as everywhere"
    page = (await b.post("alpha", "/v1/thread", {"rootId": "unknown"})).json
    assert page == {"messages": [], "count": 0, "cursor": None}
    for body in ({}, {"rootId": 5}, {"rootId": "root", "since": 5}):
        assert_error(await b.post("alpha", "/v1/thread", body), 400, "bad_request")
