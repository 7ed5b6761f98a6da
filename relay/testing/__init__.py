"""Test support shipped with the package.

The in-memory broker of the tests (:mod:`relay.testing.harness`: ``make_api``, a
configured API over a memory store with a client that signs its requests, and
``make_config``, ``new_message``), and the contract suites every storage backend
must pass, one module each: :class:`StoreContract` (spec §4, §5.1),
:class:`QuotaContract`, :class:`ExtensionContract` (v1.2), :class:`EventContract`
(REACH §11), :class:`GroupContract` (§13), :class:`TeamContract` (§13 roles, §14
priorities) and :class:`Wire2Contract` (the second wire). A third-party backend
proves itself by running them against its own ``store`` fixture.
"""

from relay.testing.contract import RULES, Recorder, ack, settle
from relay.testing.events import EventContract
from relay.testing.extensions import ExtensionContract
from relay.testing.groups import GroupContract
from relay.testing.harness import (
    SECRET,
    START,
    SignedClient,
    build_site,
    make_api,
    make_config,
    make_rules,
    new_message,
)
from relay.testing.quotas import QuotaContract
from relay.testing.store import StoreContract
from relay.testing.teams import TEAM_RULES, TeamContract
from relay.testing.v2 import Wire2Contract

__all__ = ["EventContract", "ExtensionContract", "GroupContract", "QuotaContract", "RULES",
           "Recorder", "SECRET", "START", "SignedClient", "StoreContract", "TEAM_RULES",
           "TeamContract", "Wire2Contract", "ack", "build_site", "make_api", "make_config",
           "make_rules", "new_message", "settle"]
