#!/usr/bin/env bash
# Regenerates inferd/grpc/grpc_service_pb2*.py from inferd/grpc/grpc_service.proto.
# (.venv/bin/python -m pytest tests/test_v2_grpc.py checks the result against Triton's
# own client.)
#
# The generated code is committed so that installing inferd needs no compiler. It is
# generated with protobuf 6 code generation (grpcio-tools 1.80), which protobuf
# runtimes 6.x and 7.x both load; newer tools would emit code that needs runtime >= 7.
set -euo pipefail
cd "$(dirname "$0")/.."
tools="${GRPC_TOOLS_VENV:-${TMPDIR:-/tmp}/inferd-grpc-tools}"
if [ ! -x "$tools/bin/python" ]; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install --quiet "grpcio-tools==1.80.0"
fi
"$tools/bin/python" -m grpc_tools.protoc -I . \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    inferd/grpc/grpc_service.proto
# The messages go to a private descriptor pool, not protobuf's default one: Triton's
# client registers the same "inference" package there, and a process holding both (a
# test, a benchmark, an app embedding inferd) would be refused for duplicate symbols.
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile(/' \
    inferd/grpc/grpc_service_pb2.py
grep -q "_descriptor_pool.DescriptorPool().AddSerializedFile" inferd/grpc/grpc_service_pb2.py
echo "generated: $(ls inferd/grpc/grpc_service_pb2*)"
