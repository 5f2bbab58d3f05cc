"""`relayrl run`: the whole stack as local processes, with an embedded Redis, on free ports.

Starts redis-server (unless a Redis URL is configured: redis.url or $RELAYRL_REDIS_URL), with a password of
its own (the caller's $RELAYRL_REDIS_PASSWORD, else a fresh random one), then reward, inference, trainer and
rollout as child processes running `relayrl serve`, waits for their health, shows progress from metrics.jsonl, and stops
everything at the end, on Ctrl-C, SIGTERM or SIGHUP (exit code 128 + the signal), or as soon as any service dies
(exit code 1, naming the service). Every child dies with the launcher, also when it is SIGKILLed
(relayrl.common.lifecycle).
"""

from relayrl.launcher.local_config import SERVICE_ORDER, local, local_http, local_publication, with_thread_budget
from relayrl.launcher.stack import CONTROL_TOKEN_FILE, RUN_FOLDERS, Child, Launcher
from relayrl.launcher.stopping import SERVICE_STOP_S, STOP_MARGIN, STOP_STAGES, stop_deadline

__all__ = [
    "CONTROL_TOKEN_FILE",
    "RUN_FOLDERS",
    "SERVICE_ORDER",
    "SERVICE_STOP_S",
    "STOP_MARGIN",
    "STOP_STAGES",
    "Child",
    "Launcher",
    "local",
    "local_http",
    "local_publication",
    "stop_deadline",
    "with_thread_budget",
]
