"""A TCP relay: the real node's stand-in for kube-proxy's one rule that pods need, the ``kubernetes`` Service.

A pod's in-cluster client connects to ``$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` (the Service's ClusterIP,
10.96.0.1:443), which nothing routes without kube-proxy; the API server listens on 127.0.0.1 only. The real node puts
the ClusterIP on its bridge and runs this relay there, copying bytes to the API server: TLS stays end to end (the
API server's certificate names 10.96.0.1), and no netfilter rule is needed. A NAT rule would also do, but a NAT
table makes the kernel track every connection of the host, the suite's loopback traffic included
(docs/local-cluster.md, "The real-node tier").

    python -m weightsync_tools.localcluster.relay LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            if writer.can_write_eof():
                writer.write_eof()


async def _relay(target: tuple[str, int], client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    try:
        await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))
    finally:
        for writer in (client_w, server_w):
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


async def serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    server = await asyncio.start_server(lambda r, w: _relay(target, r, w), *listen, reuse_address=True)
    print(f"relaying {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    listen_host, listen_port, target_host, target_port = argv
    asyncio.run(serve((listen_host, int(listen_port)), (target_host, int(target_port))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
