"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``).

``grpc_service.proto`` is the wire contract; ``grpc_service_pb2*.py`` are generated from
it by ``scripts/gen-grpc.sh`` and committed. The generated messages live in a private
protobuf descriptor pool, so this package and Triton's client (which registers the same
``inference`` package in the default pool) can be imported into one process.
"""
