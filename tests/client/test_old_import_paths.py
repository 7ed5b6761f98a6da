"""The import paths the client library documented before the layout by layer still
work for one release, each warning that it moved."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = {
    "relay.errors": ("relay.wire.errors", "RelayError"),
    "relay.signing": ("relay.wire.signing", "sign"),
    "relay.sse": ("relay.client.sse", "RelayEvent"),
    "relay.settings": ("relay.client.settings", "resolve_settings"),
    "relay.receipts": ("relay.agent.receipts", "ReceiptStore"),
    "relay.webhook_receiver": ("relay.client.webhook_receiver", "verify"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_names_the_same_objects(old):
    new, name = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    sys.modules.pop(old, None)
