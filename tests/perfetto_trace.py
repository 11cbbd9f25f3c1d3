"""A Perfetto trace read back with the perfetto package's own protobuf classes."""
from __future__ import annotations

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace


def decode(data: bytes):
    """(track names by uuid, parents by uuid, track events as (ts, TrackEvent) in file order)."""
    trace = Trace()
    trace.ParseFromString(data)
    names, parents, events = {}, {}, []
    for pkt in trace.packet:
        assert pkt.trusted_packet_sequence_id == 1
        if pkt.HasField("track_descriptor"):
            d = pkt.track_descriptor
            names[d.uuid] = d.name
            parents[d.uuid] = d.parent_uuid if d.HasField("parent_uuid") else None
        elif pkt.HasField("track_event"):
            events.append((pkt.timestamp, pkt.track_event))
    return names, parents, events
