"""GET /v1/openapi.json on a live daemon: every operation it documents is served (not the
router's fallbacks), and the answers of the JSON routes have the documented fields."""

from __future__ import annotations

from typing import Any

from .conftest import Torpord

FALLBACKS = ("no route for", "is not allowed on")


def test_every_documented_operation_is_served(torpord: Torpord) -> None:
    r = torpord.request("GET", "/v1/openapi.json")
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "torpord"
    operations = [(m.upper(), p) for p, item in doc["paths"].items() for m in item]
    assert ("POST", "/v1/functions/{name}/invoke") in operations and len(operations) >= 10
    for method, path in operations:
        # A function that does not exist: every route answers, none reaches the fallbacks.
        body = {} if method == "POST" else None
        answer = torpord.request(method, path.replace("{name}", "no-such-function"), body)
        text = answer.body.decode(errors="replace")
        assert not any(f in text for f in FALLBACKS), (method, path, answer.status, text)
    # The fallbacks themselves still answer for what is not documented.
    assert b"no route for" in torpord.request("GET", "/v1/nothing").body


def schema(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(doc["components"]["schemas"][name])


def test_the_json_answers_have_the_documented_fields(torpord: Torpord) -> None:
    doc = torpord.request("GET", "/v1/openapi.json").json()
    for path, name in (("/v1/status", "Status"), ("/v1/functions", "FunctionList")):
        body = torpord.request("GET", path).json()
        s = schema(doc, name)
        assert set(s.get("required", [])) <= set(body), (path, s.get("required"), body)
        assert set(body) <= set(s["properties"]), (path, set(body) - set(s["properties"]))
    missing = torpord.request("GET", "/v1/functions/no-such-function")
    assert missing.status == 404
    assert set(missing.json()) == set(schema(doc, "ErrorBody")["properties"])
