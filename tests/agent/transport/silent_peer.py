"""A peer that accepts TCP connections and never says a word: prints ``{"port": N}``, exits on EOF."""

from __future__ import annotations

import json
import socket
import sys
import threading


def main() -> int:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            connection, _ = server.accept()
            held.append(connection)

    threading.Thread(target=accept, daemon=True).start()
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
