"""The plan's seal (weightsync.plan.seal): an HMAC of the document under the group's token."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from weightsync.plan.seal import seal, sealed_by

tokens = st.text(min_size=1, max_size=64)
texts = st.text(max_size=512)


@given(tokens, tokens, texts, texts)
def test_only_the_same_token_and_the_same_text_match(token: str, other: str, text: str, changed: str) -> None:
    made = seal(token, text)
    assert sealed_by([token], text, made) and sealed_by([other, token], text, made)
    assert sealed_by([other], text, made) == (other == token)
    assert sealed_by([token], changed, made) == (changed == text)


def test_no_seal_or_no_token_never_matches() -> None:
    assert not sealed_by(["t"], "plan", None) and not sealed_by(["t"], "plan", "")
    assert not sealed_by([], "plan", seal("t", "plan"))


def test_the_seal_is_domain_separated_from_a_plain_hmac_of_the_text() -> None:
    import hashlib
    import hmac

    assert seal("t", "plan") != hmac.new(b"t", b"plan", hashlib.sha256).hexdigest()
