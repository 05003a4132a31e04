"""Relay TCP connections from ``HOST:PORT`` to ``TO_HOST:TO_PORT`` (bytes both ways, until either side closes).

``python -m weightsync_testing.tcp_forward HOST PORT TO_HOST TO_PORT``; prints ``listening`` once bound. The pod
sandboxes' way to the local API server (``pod_sandbox.py``), and the real node's (the ``kubernetes`` Service's
ClusterIP on its bridge: ``weightsync_tools/localcluster/realnode.py``). Test-only."""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(ConnectionError, OSError):
        writer.close()


async def serve(host: str, port: int, to_host: str, to_port: int) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(to_host, to_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    server = await asyncio.start_server(relay, host, port)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    host, port, to_host, to_port = argv
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(host, int(port), to_host, int(to_port)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
