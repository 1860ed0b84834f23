"""The ced.v1 gRPC API: `ced.proto` plus stubs generated from it on first import.

The stubs (`ced_pb2.py`, `ced_pb2.pyi`, `ced_pb2_grpc.py`) are build outputs: they are gitignored and
regenerated here with grpc_tools.protoc whenever they are missing or older than `ced.proto`. protoc runs
with `-I <directory that contains serving/>` on `serving/proto/ced.proto`, so the generated grpc module
imports `from serving.proto import ced_pb2` (package-relative), never a top-level `ced_pb2`.

Generation writes into a temporary directory and moves each file into place with `os.replace`, so two
processes importing at once (a test runner and a server subprocess) never see a half-written stub.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent
_PROTO = _HERE / "ced.proto"
_OUTPUTS = ("ced_pb2.py", "ced_pb2.pyi", "ced_pb2_grpc.py")


def _stale() -> bool:
    proto_mtime = _PROTO.stat().st_mtime
    for name in _OUTPUTS:
        out = _HERE / name
        if not out.exists() or out.stat().st_mtime < proto_mtime:
            return True
    return False


def generate_stubs(force: bool = False) -> None:
    """Runs protoc on ced.proto if the stubs are missing or stale (or always, with force)."""
    if not force and not _stale():
        return
    # Imported lazily: grpc_tools is only needed when the stubs must be (re)built.
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    rel = _PROTO.relative_to(_ROOT)
    with tempfile.TemporaryDirectory(prefix="ced_proto_") as tmp:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{_ROOT}",
                f"-I{well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(rel),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed (exit {rc}) on {_PROTO}")
        for name in _OUTPUTS:
            src = Path(tmp) / rel.parent / name
            # Same filesystem is not guaranteed for /tmp, so copy next to the target, then rename.
            staged = _HERE / f".{name}.{os.getpid()}.tmp"
            staged.write_bytes(src.read_bytes())
            os.replace(staged, _HERE / name)


generate_stubs()

from serving.proto import ced_pb2, ced_pb2_grpc  # noqa: E402  (must follow generation)

__all__ = ["ced_pb2", "ced_pb2_grpc", "generate_stubs"]
