"""packaging/grafana/torpord.json queries only what torpord exports: every metric named in its
queries is registered in crates/torpord/src, and, against a live daemon that has a deployed and
invoked function, every label the queries filter or group by is on that metric's series."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from conftest import ROOT

from .conftest import FUNCTIONS, Torpord

DASHBOARD = ROOT / "packaging/grafana/torpord.json"
SOURCES = ROOT / "crates/torpord/src"
METRIC = re.compile(r"\btorpor_[a-z_]+")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def queries(node: Any) -> Iterator[str]:
    """Every PromQL text in the dashboard: panel targets and template variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for value in node:
            yield from queries(value)


def registered() -> set[str]:
    """Metric names registered in the daemon's sources (string literals given to prometheus)."""
    text = "\n".join(p.read_text() for p in SOURCES.rglob("*.rs"))
    return set(re.findall(r'"(torpor_[a-z_]+)"', text))


def used() -> dict[str, set[str]]:
    """Metric name (histogram suffixes removed) -> the labels the queries use with it."""
    out: dict[str, set[str]] = {}
    for q in queries(json.loads(DASHBOARD.read_text())):
        grouped = {label.strip() for by in re.findall(r"by \(([^)]*)\)", q) for label in by.split(",")}
        grouped |= set(re.findall(r"label_values\([^,]+, *(\w+)\)", q))
        for m in re.finditer(r"\b(torpor_[a-z_]+)(\{([^}]*)\})?", q):
            name = m.group(1)
            matchers = set(re.findall(r"(\w+) *=~?", m.group(3) or ""))
            labels = (grouped | matchers) - {"le"}
            if name not in registered():
                name = HISTOGRAM_SUFFIX.sub("", name)
            out.setdefault(name, set()).update(labels)
    return out


def test_every_metric_the_dashboard_queries_is_registered_by_the_daemon() -> None:
    names = used()
    assert len(names) >= 10, names
    missing = sorted(set(names) - registered())
    assert missing == [], f"the dashboard queries metrics torpord does not export: {missing}"


def test_the_labels_the_dashboard_uses_are_on_the_live_series(torpord: Torpord) -> None:
    torpord.deploy(FUNCTIONS / "echoer")
    assert torpord.invoke("echoer", {"text": "dashboard"}).status == 200
    text = torpord.request("GET", "/metrics").body.decode()
    live: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"(torpor_[a-z_]+?)(_bucket|_sum|_count)?(\{([^}]*)\})? ", line)
        if m and not line.startswith("#"):
            labels = set(re.findall(r'(\w+)="', m.group(4) or ""))
            live.setdefault(m.group(1), set()).update(labels)
            live.setdefault(m.group(1) + (m.group(2) or ""), set()).update(labels)
    checked = 0
    for name, labels in used().items():
        if name not in live:
            # A labelled metric shows no series before its first observation (the split path's
            # fill bandwidth, for one); the test above checked it is registered.
            continue
        checked += 1
        assert labels <= live[name], f"{name}: the dashboard uses {labels}, the series have {live[name]}"
    assert checked >= 10, (sorted(used()), sorted(live))
