"""A gateway's way from a request to a replica, without a transport: the routing table
it follows (published by the server), the targets, splits and shadows of each model,
replica choice (least loaded; prefix, adapter and engine load for generations), held
requests, the result cache, the transport-agnostic data plane every API calls, and the
per-request context. Below :mod:`inferd.api` and :mod:`inferd.grpc`, above
:mod:`inferd.serving`'s client.
"""
