"""Regenerate runtime/grpc_service_pb2.py and runtime/grpc_service_pb2_grpc.py from
runtime/grpc_service.proto (needs grpcio-tools, a dev-only dependency):

    python hack/gen_grpc.py [OUT_DIR]

OUT_DIR defaults to runtime/ (tests/runtime/test_grpc.py generates into a temporary one
and compares). Two edits after protoc, so the modules live inside the kiln.runtime package:

- the messages are built in a descriptor pool of their own, not protobuf's default one:
  tritonclient (and any Triton or KServe stub) registers its own `inference` package there,
  and one process may hold both (a test, a client embedding Kiln);
- the gRPC module imports the messages as `kiln.runtime.grpc_service_pb2`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "runtime"
PROTO = "grpc_service.proto"
POOL_LINE = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = ("# Kiln: a pool of its own (hack/gen_grpc.py), so Triton's stubs of the same package\n"
                "# can be imported beside these.\n"
                "_pool = _descriptor_pool.DescriptorPool()\n"
                "DESCRIPTOR = _pool.AddSerializedFile(")
IMPORT_LINE = "import grpc_service_pb2 as grpc__service__pb2"
PACKAGE_IMPORT = "from kiln.runtime import grpc_service_pb2 as grpc__service__pb2"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{RUNTIME}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}", str(RUNTIME / PROTO)])
        if rc != 0:
            raise SystemExit(f"protoc failed ({rc})")
        messages = (Path(tmp) / "grpc_service_pb2.py").read_text()
        service = (Path(tmp) / "grpc_service_pb2_grpc.py").read_text()
    if POOL_LINE not in messages or IMPORT_LINE not in service:
        raise SystemExit("protoc's output changed shape: update hack/gen_grpc.py")
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("grpc_service_pb2.py", messages.replace(POOL_LINE, PRIVATE_POOL)),
                       ("grpc_service_pb2_grpc.py", service.replace(IMPORT_LINE, PACKAGE_IMPORT))):
        (out / name).write_text(text)
        written.append(out / name)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else RUNTIME):
        print(path)
