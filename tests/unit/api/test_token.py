"""The group token's shape: what engines' command lines and HTTP headers take unquoted."""

from __future__ import annotations

import argparse
import re

import pytest

from weightsync.api import token as token_mod
from weightsync.api.token import new_token


def test_a_token_is_43_url_safe_characters_and_never_an_option() -> None:
    tokens = {new_token() for _ in range(2000)}
    assert len(tokens) == 2000
    assert all(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]{42}", t) for t in tokens)


def test_a_token_drawn_with_a_leading_dash_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = iter(["-starts-with-a-dash", "fine"])
    monkeypatch.setattr(token_mod.secrets, "token_urlsafe", lambda _n: next(drawn))
    assert new_token() == "fine"


def test_argparse_takes_the_token_as_the_options_value() -> None:
    """What stock SGLang does with ``--admin-api-key $(WEIGHTSYNC_GROUP_TOKEN)``; a leading dash failed it."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--admin-api-key")
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(["--admin-api-key", "-abc"])
    for _ in range(200):
        value = new_token()
        assert parser.parse_args(["--admin-api-key", value]).admin_api_key == value
