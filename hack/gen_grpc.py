"""Regenerate runtime/serving/grpc/grpc_service_pb2.py (the messages) from runtime/serving/grpc/grpc_service.proto
(needs grpcio-tools, a dev-only dependency). The service's handlers are not generated:
runtime/serving/grpc/endpoint.py builds them from the service's descriptor.

    python hack/gen_grpc.py [OUT_DIR]

OUT_DIR defaults to runtime/serving/grpc/ (tests/runtime/test_grpc.py generates into a temporary one
and compares). One edit after protoc: the messages are built in a descriptor pool of their
own, not protobuf's default one: tritonclient (and any Triton or KServe stub) registers its
own `inference` package there, and one process may hold both (a test, a client embedding
Kiln).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "runtime" / "serving" / "grpc"
PROTO = "grpc_service.proto"
POOL_LINE = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = ("# Kiln: a pool of its own (hack/gen_grpc.py), so Triton's stubs of the same package\n"
                "# can be imported beside these.\n"
                "_pool = _descriptor_pool.DescriptorPool()\n"
                "DESCRIPTOR = _pool.AddSerializedFile(")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{RUNTIME}", f"--python_out={tmp}",
                          str(RUNTIME / PROTO)])
        if rc != 0:
            raise SystemExit(f"protoc failed ({rc})")
        messages = (Path(tmp) / "grpc_service_pb2.py").read_text()
    if POOL_LINE not in messages:
        raise SystemExit("protoc's output changed shape: update hack/gen_grpc.py")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "grpc_service_pb2.py"
    path.write_text(messages.replace(POOL_LINE, PRIVATE_POOL))
    return [path]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else RUNTIME):
        print(path)
