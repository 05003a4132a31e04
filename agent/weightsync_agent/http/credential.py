"""The group's credential as an agent holds it: the current token and, during a rotation, the previous one.

A rotation (``weightsync rotate-token``, docs/security.md "Rotating the token") moves the Secret's ``token`` to
``previous`` and writes a new ``token``; ``--finish`` drops ``previous``. Kubelets refresh a Secret volume in
place (within about a minute), so an agent that reads the Secret's files and re-reads them when they change
follows a rotation without a restart:

* incoming, either token is accepted (both compared in constant time, always both, so timing does not tell
  which one matched);
* outgoing, the current one is sent; when a peer answers 401 the files are re-read and the call is retried once
  with the other token: an engine started before the rotation keeps its old admin key until its pod restarts,
  and an agent whose kubelet has not refreshed its volume yet still sends the old one.

Re-reading is a ``stat`` of two files, cheap enough for every tick and every refused request. Local runs and
tests without a mounted Secret use a fixed token (``WEIGHTSYNC_GROUP_TOKEN``).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from weightsync.api import names

log = logging.getLogger("weightsync.credential")

Which = Literal["token", "previous"]
#: A file's identity and content stamp: a kubelet's refresh swaps the files (new inode), an edit changes the rest.
_Stamp = tuple[int, int, int] | None


class CredentialError(ValueError):
    """No usable token: the mounted Secret has none, or neither the mount nor the environment names one."""


@dataclass(frozen=True)
class TokenSet:
    """The tokens accepted at one moment: ``token`` (sent) and, during a rotation window, ``previous``."""

    token: str
    previous: str | None = None

    def __post_init__(self) -> None:
        if not self.token:
            raise CredentialError("the group's token must not be empty")
        if self.previous == "":
            raise CredentialError("an empty previous token is no token: leave it out")

    def which(self, given: str | None) -> Which | None:
        """Which token ``given`` is, or None. Compares against both in constant time whatever matches."""
        if not given:
            return None
        raw = given.encode()
        current = hmac.compare_digest(raw, self.token.encode())
        # Compared even when the current one matched (or there is no previous: against the current again), so
        # the time taken does not depend on which token was given.
        previous = hmac.compare_digest(raw, (self.previous or self.token).encode()) and self.previous is not None
        if current:
            return "token"
        return "previous" if previous else None

    def accepts(self, given: str | None) -> bool:
        return self.which(given) is not None

    def candidates(self) -> tuple[str, ...]:
        """What a client may send, in order: the current token, then the previous one (if different)."""
        if self.previous is None or self.previous == self.token:
            return (self.token,)
        return (self.token, self.previous)


class Credential:
    """A :class:`TokenSet` that follows a directory of Secret files (``token``, optional ``previous``), or a fixed
    one. Thread-safe: the HTTP server's loop, the agent's tick and every client thread share one."""

    def __init__(self, tokens: TokenSet, directory: Path | None = None) -> None:
        self._tokens = tokens
        self.directory = directory
        self._lock = threading.Lock()
        self._stamp: tuple[_Stamp, _Stamp] | None = self._stamps() if directory is not None else None

    @classmethod
    def fixed(cls, token: str, previous: str | None = None) -> Credential:
        return cls(TokenSet(token, previous))

    @classmethod
    def from_directory(cls, directory: str | os.PathLike[str]) -> Credential:
        path = Path(directory)
        return cls(read_token_set(path), path)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credential:
        env = os.environ if env is None else env
        return cls.from_sources(env.get(names.ENV_CREDENTIALS_DIR), env.get(names.ENV_GROUP_TOKEN))

    @classmethod
    def from_sources(cls, directory: str | None, token: str | None) -> Credential:
        """The mounted Secret (``WEIGHTSYNC_CREDENTIALS_DIR``) if named, else ``WEIGHTSYNC_GROUP_TOKEN``."""
        if directory:
            return cls.from_directory(directory)
        if not token:
            raise CredentialError(
                f"neither {names.ENV_CREDENTIALS_DIR} nor {names.ENV_GROUP_TOKEN} is set: the agent serves and calls "
                "only with the group's credential"
            )
        return cls.fixed(token)

    def tokens(self) -> TokenSet:
        return self._tokens

    def refresh(self) -> bool:
        """Re-read the files if they changed since the last read; True when the tokens changed. A Secret caught
        without a token (being rewritten, or emptied by hand) keeps the last good tokens and is retried next time."""
        if self.directory is None:
            return False
        with self._lock:
            before = self._stamps()
            if before == self._stamp:
                return False
            try:
                tokens = read_token_set(self.directory)
            except CredentialError as exc:
                log.warning("keeping the group's current tokens: %s", exc)
                return False
            # A kubelet swap between the stat and the read: leave the stamp stale so the next call reads again.
            self._stamp = before if self._stamps() == before else None
            changed = tokens != self._tokens
            if changed:
                log.info(
                    "the group's credential changed (%s): now %s",
                    self.directory,
                    "a token and a previous one (rotation window)" if tokens.previous else "one token",
                )
            self._tokens = tokens
            return changed

    def which(self, given: str | None) -> Which | None:
        """Which token ``given`` is; a token not accepted makes the files be re-read once (a rotation that this
        agent's volume shows but its last read did not)."""
        found = self._tokens.which(given)
        if found is None and given and self.refresh():
            found = self._tokens.which(given)
        return found

    def accepts(self, given: str | None) -> bool:
        return self.which(given) is not None

    def _stamps(self) -> tuple[_Stamp, _Stamp]:
        assert self.directory is not None
        return (_stamp(self.directory / names.SECRET_TOKEN_KEY), _stamp(self.directory / names.SECRET_PREVIOUS_KEY))


def read_token_set(directory: Path) -> TokenSet:
    """The tokens in a Secret volume: ``token`` required, ``previous`` optional (absent or empty: none)."""
    token = _read(directory / names.SECRET_TOKEN_KEY)
    if not token:
        raise CredentialError(
            f"{directory / names.SECRET_TOKEN_KEY} is missing or empty: the group's Secret has no token"
        )
    return TokenSet(token, _read(directory / names.SECRET_PREVIOUS_KEY) or None)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CredentialError(f"cannot read {path}: {exc}") from exc


def _stamp(path: Path) -> _Stamp:
    try:
        st = path.stat()  # follows the kubelet's symlinks (token -> ..data/token)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


#: What clients take as their key: a fixed token (engines' and tests' clients), a :class:`Credential`, or none.
ApiKey = str | Credential | None


def as_credential(key: ApiKey) -> Credential | None:
    if key is None or key == "":
        return None
    return key if isinstance(key, Credential) else Credential.fixed(key)
