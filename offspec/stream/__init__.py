"""Streaming the target's layers: the host arena and disk store, the ring of device slots, the copy backends
(docs/streaming.md)."""
