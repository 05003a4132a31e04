"""The group's credential: how a token is made (docs/security.md).

32 random bytes, URL-safe base64 (43 characters), so it fits a header and a command line unquoted. It never
starts with ``-``: stock SGLang takes it as ``--admin-api-key $(WEIGHTSYNC_GROUP_TOKEN)``, and argparse reads
an argument that starts with ``-`` as the next option ("expected one argument"), so one group in 64 had an
engine that could not start.
"""

from __future__ import annotations

import secrets

#: Random bytes per token.
TOKEN_BYTES = 32


def new_token() -> str:
    while True:
        token = secrets.token_urlsafe(TOKEN_BYTES)
        if not token.startswith("-"):
            return token
