"""Small helpers shared by the service implementations: the status header, messages as plain data."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

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
        return ComponentStatus(
            component=self.component,
            instance_id=self.instance_id,
            state=self.state,
            uptime_s=time.monotonic() - self.started,
            software_version=__version__,
        )


_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def as_dict(message: Message) -> dict[str, Any]:
    """A message as JSON-ready data with proto field names, every field present, and 64-bit integers as numbers
    (protobuf's JSON mapping writes them as strings)."""
    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(message.DESCRIPTOR, data)


def _numbers(desc: Any, data: dict[str, Any]) -> dict[str, Any]:
    for f in desc.fields:
        if f.name not in data:
            continue
        value = data[f.name]
        repeated = isinstance(value, list)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            if f.message_type.fields_by_name["value"].type in _INT64:  # map<string, uint64> and the like
                data[f.name] = {k: int(v) for k, v in value.items()}
        elif f.message_type is not None:
            items = value if repeated else [value]
            for item in items:
                _numbers(f.message_type, item)
        elif f.type in _INT64:
            data[f.name] = [int(v) for v in value] if repeated else int(value)
    return data
