"""Small helpers shared by the service implementations."""

from __future__ import annotations

import os
import socket
import time

from relayrl import __version__
from relayrl.common.pb.common_pb2 import ComponentStatus, ServingState


class StatusHeader:
    """Builds the ComponentStatus header of a service's status message."""

    def __init__(self, component: str) -> None:
        self.component = component
        self.instance_id = f"{socket.gethostname()}:{os.getpid()}"
        self.started = time.monotonic()
        self.state: ServingState.ValueType = ServingState.SERVING_STATE_STARTING

    def message(self) -> ComponentStatus:
        return ComponentStatus(component=self.component, instance_id=self.instance_id, state=self.state,
                               uptime_s=time.monotonic() - self.started, software_version=__version__)
