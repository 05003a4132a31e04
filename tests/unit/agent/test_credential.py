"""The group's token set during a rotation (weightsync_agent/http/credential.py): which tokens are accepted and
sent, re-reading the Secret's files as a kubelet swaps them, and the clients' one retry on a 401 against a real
HTTP server."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.api import names
from weightsync_agent.http.client import HttpCallError, JsonHttpClient
from weightsync_agent.http.credential import Credential, CredentialError, TokenSet, as_credential

tokens = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=50)


@given(token=tokens, previous=st.none() | tokens, other=tokens)
def test_token_set_accepts_exactly_its_tokens(token: str, previous: str | None, other: str) -> None:
    tokens_ = TokenSet(token, previous)
    assert tokens_.which(token) == "token"
    if previous is not None and previous != token:
        assert tokens_.which(previous) == "previous"
    expected = other in (token, previous)
    assert tokens_.accepts(other) is expected
    assert not tokens_.accepts(None) and not tokens_.accepts("")
    candidates = tokens_.candidates()
    assert candidates[0] == token and len(set(candidates)) == len(candidates)
    assert set(candidates) == {t for t in (token, previous) if t is not None}


def test_token_set_refuses_empty_tokens() -> None:
    with pytest.raises(CredentialError):
        TokenSet("")
    with pytest.raises(CredentialError):
        TokenSet("a", "")


def write_secret(directory: Path, token: str | None, previous: str | None = None) -> None:
    """As a kubelet refreshes a Secret volume: the new files appear at once (renamed in), a dropped key vanishes."""
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in ((names.SECRET_TOKEN_KEY, token), (names.SECRET_PREVIOUS_KEY, previous)):
        path = directory / key
        if value is None:
            path.unlink(missing_ok=True)
            continue
        tmp = directory / f".{key}.tmp"
        tmp.write_text(value)
        os.replace(tmp, path)


def test_credential_follows_its_files(tmp_path: Path) -> None:
    write_secret(tmp_path, "old")
    credential = Credential.from_directory(tmp_path)
    assert credential.tokens() == TokenSet("old")
    assert credential.refresh() is False  # nothing changed: a stat, no read
    write_secret(tmp_path, "new", "old")  # rotate
    assert credential.refresh() is True
    assert credential.tokens() == TokenSet("new", "old")
    assert credential.accepts("old") and credential.accepts("new")
    write_secret(tmp_path, "new")  # finish
    assert credential.accepts("old")  # until the next re-read (the agent's tick): an accepted token reads nothing
    assert credential.refresh() is True
    assert credential.accepts("new") and not credential.accepts("old")
    assert credential.tokens() == TokenSet("new")


def test_a_refused_token_rereads_the_files_first(tmp_path: Path) -> None:
    write_secret(tmp_path, "old")
    credential = Credential.from_directory(tmp_path)
    write_secret(tmp_path, "new", "old")
    # No tick ran yet: the peer's new token is accepted because the refusal re-reads the files.
    assert credential.which("new") == "token"


def test_a_secret_caught_without_a_token_keeps_the_last_good_tokens(tmp_path: Path) -> None:
    write_secret(tmp_path, "old")
    credential = Credential.from_directory(tmp_path)
    write_secret(tmp_path, None)
    assert credential.refresh() is False
    assert credential.tokens() == TokenSet("old")
    write_secret(tmp_path, "new")
    assert credential.refresh() is True and credential.tokens() == TokenSet("new")


def test_from_env_prefers_the_mounted_files(tmp_path: Path) -> None:
    write_secret(tmp_path, "from-file")
    env = {names.ENV_CREDENTIALS_DIR: str(tmp_path), names.ENV_GROUP_TOKEN: "from-env"}
    assert Credential.from_env(env).tokens().token == "from-file"
    assert Credential.from_env({names.ENV_GROUP_TOKEN: "from-env"}).tokens().token == "from-env"
    with pytest.raises(CredentialError, match="neither"):
        Credential.from_env({})
    with pytest.raises(CredentialError, match="no token"):
        Credential.from_env({names.ENV_CREDENTIALS_DIR: str(tmp_path / "missing")})
    assert as_credential(None) is None and as_credential("") is None


class _Peer:
    """A real HTTP server that accepts one bearer token (like an engine started with one admin key)."""

    def __init__(self, accepted: str) -> None:
        self.accepted = accepted
        self.seen: list[str] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                given = self.headers.get("Authorization", "").removeprefix("Bearer ")
                peer.seen.append(given)
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                ok = given == peer.accepted
                body = b'{"ok": true}' if ok else b'{"error": {"message": "unauthorized"}}'
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def peer() -> Iterator[_Peer]:
    server = _Peer("old")
    yield server
    server.server.shutdown()


def test_client_falls_back_to_the_previous_token_once_and_remembers(peer: _Peer, tmp_path: Path) -> None:
    write_secret(tmp_path, "new", "old")
    client = JsonHttpClient(peer.url, api_key=Credential.from_directory(tmp_path))
    assert client.request("POST", "/x", body={})[1] == {"ok": True}
    assert peer.seen == ["new", "old"]
    client.request("POST", "/x", body={})
    assert peer.seen[2:] == ["old"]  # the peer's token is tried first from now on
    peer.accepted = "new"  # the peer restarted with the new token
    client.request("POST", "/x", body={})
    assert peer.seen[3:] == ["old", "new"]


def test_client_without_a_previous_token_does_not_retry(peer: _Peer, tmp_path: Path) -> None:
    write_secret(tmp_path, "new")
    client = JsonHttpClient(peer.url, api_key=Credential.from_directory(tmp_path))
    with pytest.raises(HttpCallError) as refused:
        client.request("POST", "/x", body={})
    assert refused.value.status == 401 and peer.seen == ["new"]
    fixed = JsonHttpClient(peer.url, api_key="wrong")
    with pytest.raises(HttpCallError):
        fixed.request("POST", "/x", body={})
    assert peer.seen == ["new", "wrong"]


def test_client_rereads_the_files_on_a_401(peer: _Peer, tmp_path: Path) -> None:
    peer.accepted = "new"
    write_secret(tmp_path, "old")
    credential = Credential.from_directory(tmp_path)
    client = JsonHttpClient(peer.url, api_key=credential)
    write_secret(tmp_path, "new", "old")  # rotated, and no tick re-read it yet
    client.request("POST", "/x", body={})
    assert peer.seen == ["old", "new"]  # the 401 re-read the files: the new current token
    client.request("POST", "/x", body={})
    assert peer.seen[2:] == ["new"]
