"""Fuzz the running broker from docs/openapi.yaml with schemathesis (CI runs this file
by name: ``pytest tests/processes/fuzz_openapi.py``; it needs the ``ci`` extra).

A real ``twistd -n relay`` on a loopback port; every generated request is signed
(spec §3) by a requests auth hook, over the exact path and body sent. Each
operation gets a bounded number of examples. Checked: no 5xx, every status
code documented, every answer a JSON body that holds to its documented schema.
"""

from __future__ import annotations

import os
import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from relay.wire.signing import sign
from tests.support import REPO
from tests.support.processes import BrokerProcess

pytestmark = pytest.mark.process

DOCUMENT = REPO / "docs" / "openapi.yaml"
# Long polls (waitSeconds, wait) may each take up to 20 s: keep the count modest.
EXAMPLES = int(os.environ.get("RELAY_FUZZ_EXAMPLES", "25"))
AGENTS = ("alpha", "beta")

# GET /v1/events is a stream kept open (keepalives, no end): it does not fit a
# request that is answered and done. Its answers are checked by tests/api/test_events.py
# (in memory) and tests/processes/test_events.py (a real broker).
schema = schemathesis.openapi.from_path(DOCUMENT).exclude(path="/v1/events")


class Signed(requests.auth.AuthBase):
    """Signs each prepared request as ``agent``, over its path and body as sent."""

    def __init__(self, secret: str, agent: str) -> None:
        self.secret = secret
        self.agent = agent

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        body = request.body or b""
        if isinstance(body, str):
            body = body.encode("utf-8")
        ts = int(time.time())
        request.headers["X-Relay-Agent"] = self.agent
        request.headers["X-Relay-Timestamp"] = str(ts)
        request.headers["X-Relay-Signature"] = sign(self.secret, request.method,
                                                    request.path_url, ts, body)
        return request


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    process = BrokerProcess(str(directory), storage="sqlite").start()
    session = requests.Session()
    session.auth = Signed(process.secret, "alpha")
    for agent in AGENTS:  # so that sends find registered recipients
        assert process.request(agent, "POST", "/register", {})[0] == 200
    yield process, session
    process.stop()
    log = process.log()
    assert "incident" not in log and "Traceback" not in log, log


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_the_broker_holds_to_its_description(case, broker):
    process, session = broker
    case.call_and_validate(
        base_url=process.url, session=session, timeout=30,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                response_schema_conformance],
    )
