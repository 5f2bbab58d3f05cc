"""A service process's heap after start-up (relayrl.common.lifecycle): frozen once its server starts, in a
process that said it is a service, and never in one that only hosts servers (a test, an embedding program)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO

# in a fresh interpreter, so that this test process's own heap is never frozen
_PROGRAM = textwrap.dedent(
    """
    import asyncio, gc, json, sys, weakref
    from relayrl.common.grpc_utils import create_server
    from relayrl.common.lifecycle import freeze_heap_at_start
    from relayrl.config.endpoints import ServerConfig

    class Node:
        pass

    async def main():
        if sys.argv[1] == "service":
            freeze_heap_at_start()
        garbage = Node()
        garbage.me = garbage  # a cycle nothing else holds: only the cyclic collector frees it
        dropped = weakref.ref(garbage)
        del garbage
        gc.disable()  # no automatic collection between here and the server's start
        handle = create_server(ServerConfig(), [], ["test.Service"])
        walked = len(gc.get_objects())  # what a full collection walks (the permanent generation is not listed)
        await handle.start()
        result = {
            "frozen": gc.get_freeze_count(),
            "walked_before": walked,
            "walked_after": len(gc.get_objects()),
            "cycle_freed": dropped() is None,
        }
        await handle.stop(0)
        print(json.dumps(result))

    asyncio.run(main())
    """
)


def _start_a_server(role: str) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAM, role], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    result: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_service_process_collects_its_start_up_garbage_then_freezes_the_rest_when_its_server_starts() -> None:
    result = _start_a_server("service")
    assert result["frozen"] > 10_000  # the imported modules' objects, at least
    assert result["walked_after"] < result["walked_before"] // 10  # later collections walk only what came after
    assert result["cycle_freed"] is True  # collected before the freeze, not kept for the process's life


def test_a_process_that_only_hosts_a_server_keeps_its_heap_unfrozen() -> None:
    result = _start_a_server("host")
    assert result["frozen"] == 0 and result["cycle_freed"] is False
    assert result["walked_after"] >= result["walked_before"]
