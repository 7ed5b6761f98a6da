"""docs/openapi.yaml: a valid OpenAPI 3.1 document whose paths are exactly the routes
the Klein app serves, whose error codes are the broker's, and whose response
schemas hold for what the broker answers (checked on real answers here; CI also
fuzzes the running broker from it with schemathesis, see tests/processes/fuzz_openapi.py)."""

from __future__ import annotations

import re
from typing import Any, Dict, Set, Tuple

import pytest
import pytest_twisted
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from relay.broker.api import RelayAPI
from relay.wire import errors
from tests.support import REPO

DOCUMENT = REPO / "docs" / "openapi.yaml"
METHODS = {"get", "post", "put", "patch", "delete"}


@pytest.fixture(scope="module")
def document() -> Dict[str, Any]:
    return yaml.safe_load(DOCUMENT.read_text(encoding="utf-8"))


def served_routes() -> Set[Tuple[str, str]]:
    """``(path template, method)`` of every route of the main listener's Klein app."""
    out = set()
    for rule in RelayAPI.app.url_map.iter_rules():
        path = re.sub(r"<(?:[a-z]+:)?[A-Za-z_]+>", "{}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            out.add((path, method.lower()))
    return out


def documented_routes(document) -> Set[Tuple[str, str]]:
    return {(re.sub(r"\{[^}]+\}", "{}", path), method)
            for path, item in document["paths"].items() for method in item if method in METHODS}


def test_the_document_is_valid_openapi_3_1(document):
    from openapi_spec_validator import validate

    assert document["openapi"].startswith("3.1")
    validate(document)


def test_its_paths_are_exactly_the_routes_served(document):
    assert documented_routes(document) == served_routes()


def test_its_error_codes_are_the_brokers(document):
    documented = set(document["components"]["schemas"]["ErrorCode"]["enum"])
    raised = {getattr(errors, name)("x").code for name in dir(errors)
              if callable(getattr(errors, name)) and name.islower()
              and name not in ("annotations",)
              and getattr(getattr(errors, name), "__module__", "") == "relay.wire.errors"}
    assert raised | {"id_conflict", "request_timeout"} == documented


def test_every_operation_documents_the_errors_any_request_may_get(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            codes = set(operation["responses"])
            assert {"400", "404", "429", "503"} <= codes, (method, path)
            if operation.get("security") != []:
                assert {"401", "403"} <= codes, (method, path)


# -- the broker's answers hold to the schemas ---------------------------------------------


class Checker:
    def __init__(self, document) -> None:
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self.registry = Registry().with_resource("urn:relay:openapi", resource)
        self.document = document

    def check(self, path: str, method: str, status: int, body: Any) -> None:
        responses = self.document["paths"][path][method]["responses"]
        assert str(status) in responses, (path, method, status)
        pointer = f"/paths/{path.replace('/', '~1')}/{method}/responses/{status}"
        response = responses[str(status)]
        if "$ref" in response:
            pointer = response["$ref"][1:]
        schema = {"$ref": f"urn:relay:openapi#{pointer}/content/application~1json/schema"}
        Draft202012Validator(schema, registry=self.registry).validate(body)


@pytest_twisted.ensureDeferred
async def test_answers_of_every_route_match_their_schemas(document):
    from relay.testing import make_api

    check = Checker(document).check
    api, c, clock = make_api(maxAttempts=0)

    async def call(method: str, path: str, template: str, body: Any = None,
                   agent: Any = "beta", expect: int = 200) -> Any:
        code, answer, _ = await c.request(agent, method.upper(), path, body)
        assert code == expect, (path, code, answer)
        check(template, method, code, answer)
        return answer

    await call("get", "/", "/", agent=None)
    await call("post", "/register", "/register",
               {"card": {"description": "answers questions", "skills": ["qa"]}})
    await call("post", "/register", "/register", {}, agent="alpha")
    await call("get", "/peers", "/peers")
    sent = await call("post", "/messages", "/messages",
                      {"to": "beta", "kind": "request", "body": {"q": 1}, "ttlSeconds": 60},
                      agent="alpha", expect=201)
    await call("post", "/messages", "/messages", {"id": sent["id"], "to": "beta"},
               agent="alpha", expect=200)
    await call("post", "/messages", "/messages", {"to": "beta", "delaySeconds": 30},
               agent="alpha", expect=201)
    page = await call("get", "/messages?limit=5", "/messages")
    await call("post", f"/messages/{sent['id']}/ack", "/messages/{messageId}/ack",
               {"status": "ok"}, expect=201)
    pulled = await call("post", "/v1/pull", "/v1/pull", {"limit": 1})
    (lease,) = pulled["messages"]
    await call("post", "/v1/lease/renew", "/v1/lease/renew",
               {"messageId": lease["id"], "leaseId": lease["leaseId"], "leaseSeconds": 30})
    await call("post", "/v1/ack", "/v1/ack",
               {"messageId": lease["id"], "leaseId": lease["leaseId"], "outcome": "completed",
                "reply": {"body": {"a": 2}}})
    await call("post", "/v1/status", "/v1/status", {"messageIds": [sent["id"], "nope"]})
    await call("post", "/v1/recent", "/v1/recent", {"limit": 3})
    await call("post", "/v1/messages/query", "/v1/messages/query", {"box": "all"})
    await call("post", "/v1/thread", "/v1/thread", {"rootId": sent["id"]})
    other = await call("post", "/messages", "/messages", {"to": "beta"}, agent="alpha",
                       expect=201)
    await call("post", "/v1/cancel", "/v1/cancel", {"messageId": other["id"]}, agent="alpha")
    await call("post", "/v1/requeue", "/v1/requeue", {"messageId": other["id"]}, agent="alpha")
    assert page["messages"]
    # errors, with their codes
    await call("post", "/v1/ack", "/v1/ack",
               {"messageId": lease["id"], "leaseId": "x", "outcome": "retry"}, expect=409)
    await call("post", "/v1/requeue", "/v1/requeue", {"messageId": "nope"}, expect=404)
    await call("post", "/messages", "/messages", {"to": "nobody"}, agent="alpha", expect=404)
    await call("post", "/v1/pull", "/v1/pull", {"limit": 1}, agent=None, expect=401)
    await call("get", "/peers", "/peers", agent="x y", expect=401)


@pytest_twisted.ensureDeferred
async def test_group_answers_match_their_schemas(document):
    """REACH §13: a group send, its duplicate, its status, a copy and /peers."""
    from relay.testing import make_api

    check = Checker(document).check
    _, c, _ = make_api(agents={"alpha": {}, "beta": {}, "gamma": {}},
                       groups={"team": {"members": ["alpha", "beta", "gamma"]}},
                       roles={"triage": {"members": ["beta"]}})

    async def call(method: str, path: str, body: Any = None, agent: str = "alpha",
                   expect: int = 200) -> Any:
        code, answer, _ = await c.request(agent, method.upper(), path, body)
        assert code == expect, (path, code, answer)
        check(path, method, code, answer)
        return answer

    await call("post", "/register", {}, agent="beta")
    sent = await call("post", "/messages", {"to": "group:team", "id": "g1"}, expect=201)
    assert len(sent["copies"]) == 2
    await call("post", "/messages", {"to": "group:team", "id": "g1"}, expect=200)
    await call("post", "/messages", {"to": "group:team", "id": "g1"}, agent="beta",
               expect=201)
    await call("post", "/messages", {"to": "beta", "id": "plain"}, expect=201)
    await call("post", "/messages", {"to": "group:team", "id": "plain"}, expect=409)
    await call("post", "/messages", {"to": "group:none"}, expect=404)
    (entry, _) = (await call("post", "/v1/status", {"messageIds": ["g1", "nope"]}))["messages"]
    assert entry["via"] == "group:team"
    (copy,) = (await call("post", "/v1/pull", {"limit": 1}, agent="gamma"))["messages"]
    assert copy["via"] == "group:team"
    peers = await call("get", "/peers")
    assert peers["groups"] and peers["roles"]
