"""How clients spread over replicas: a server's bounded connection age makes a client open a new connection (the
moment a balancing client resolves its target again), and a balanced channel sends its calls to every address its
target names."""

from __future__ import annotations

import grpc

from relayrl.common.grpc_utils import ServerHandle, channel, create_server
from relayrl.config.endpoints import ServerConfig


def _peer_server(cfg: ServerConfig, name: str = "") -> ServerHandle:
    """A server whose one method, /t.Peer/Who, answers with the caller's address (its client port: a connection)
    and the server's ``name``."""

    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return f"{context.peer()} {name}".encode()

    handler = grpc.method_handlers_generic_handler("t.Peer", {"Who": grpc.unary_unary_rpc_method_handler(who)})
    return create_server(cfg, [lambda server: server.add_generic_rpc_handlers((handler,))], ["t.Peer"])


async def test_a_server_with_a_bounded_connection_age_makes_its_client_reconnect() -> None:
    handle = _peer_server(ServerConfig(port=0, max_connection_age_s=0.2, max_connection_age_grace_s=1.0))
    await handle.start()
    try:
        async with channel(f"127.0.0.1:{handle.port}", balanced=True) as ch:
            who = ch.unary_unary("/t.Peer/Who")
            peers: set[bytes] = set()
            for _ in range(2000):  # ends at the second connection (about 0.2 s); the bound only stops a failure
                peers.add(await who(b"", timeout=5))
                if len(peers) > 1:
                    break
    finally:
        await handle.stop(0)

    assert len(peers) == 2  # the first connection aged out, the client dialled again, no call failed


async def test_a_balanced_channel_sends_calls_to_every_address_of_its_target_and_a_plain_one_to_the_first() -> None:
    handles = [_peer_server(ServerConfig(port=0), str(i)) for i in range(3)]
    for h in handles:
        await h.start()
    target = "ipv4:" + ",".join(f"127.0.0.1:{h.port}" for h in handles)
    served: dict[bool, list[int]] = {}
    try:
        for balanced in (True, False):
            async with channel(target, balanced=balanced) as ch:
                who = ch.unary_unary("/t.Peer/Who")
                await ch.channel_ready()
                answers = [await who(b"", timeout=5) for _ in range(30)]
            served[balanced] = [sum(a.endswith(f" {i}".encode()) for a in answers) for i in range(3)]
    finally:
        for h in handles:
            await h.stop(0)

    assert served[False] == [30, 0, 0]
    # round robin over the connected subchannels (the first calls may go to the first that connected)
    assert min(served[True]) >= 5, served
