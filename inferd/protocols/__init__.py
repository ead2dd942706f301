"""The API families' requests without their transports: tensor codecs (JSON rows, V2
tensors as JSON or binary), number checks, and the Open Inference Protocol's semantics
(metadata, schedule policy, model repository).

Layer rule: ``inferd.api`` (HTTP routes) and ``inferd.grpc`` (the gRPC service) import
from here, from ``inferd.routing`` (data plane, generation start, request context) and
``inferd.priority``; nothing here or in ``inferd.routing`` imports ``inferd.api`` or
``inferd.grpc`` (but for type checking), nor the replica's batcher.
"""
