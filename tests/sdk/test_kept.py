"""torpor.kept, the worker's store of keyed outcomes (docs/torpord.md, "Retries"): what a worker
names in its reattach hello and settles, and the bounds that keep it from holding a function's
memory hostage."""

from __future__ import annotations

from torpor import kept
from torpor.kept import KeptAnswers


def result(value: object) -> dict[str, object]:
    return {"type": "result", "id": 7, "ok": True, "value": value, "handler_s": 0.25}


def test_a_kept_answer_is_named_in_hello_and_settled_without_the_lost_daemons_id() -> None:
    k = KeptAnswers()
    k.begin((None, "a"), "fa")
    k.begin(("detect", "b"), "fb")
    assert sorted(h["key"] for h in k.held()) == ["a", "b"]
    assert {"function": "detect", "key": "b", "fingerprint": "fb"} in k.held()
    k.end((None, "a"), result([1, 2]), 40)
    assert k.answered() == [(None, "a")]
    assert k.settled((None, "a")) == {
        "type": "settled", "key": "a", "fingerprint": "fa", "ok": True, "value": [1, 2], "handler_s": 0.25,
    }
    # Still running: named, but nothing to settle yet.
    assert k.settled(("detect", "b")) is None
    # An end without a begin (an unkeyed request) keeps nothing.
    k.end((None, "zzz"), result(0), 10)
    assert k.settled((None, "zzz")) is None


def test_the_oldest_answers_go_past_the_count_or_byte_bound() -> None:
    k = KeptAnswers()
    half = kept.MAX_KEPT_BYTES // 2 + 1
    for key in ("old", "new"):
        k.begin((None, key), key)
        k.end((None, key), result(key), half)
    assert k.answered() == [(None, "new")]
    # One answer larger than the bound is not kept at all (its retry runs again).
    k.begin((None, "huge"), "h")
    k.end((None, "huge"), result("x"), kept.MAX_KEPT_BYTES + 1)
    assert (None, "huge") not in k.answered()
    k2 = KeptAnswers()
    for i in range(kept.MAX_KEPT + 5):
        k2.begin((None, str(i)), "f")
        k2.end((None, str(i)), result(i), 1)
    assert len(k2.answered()) == kept.MAX_KEPT and k2.answered()[0] == (None, "5")
