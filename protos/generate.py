"""Generate the Python code for the streamlog protos: `python protos/generate.py [OUT_DIR]`.

The one way generated code is produced, used by `make gen` and by the test that
checks protos/gen is not stale. Output goes to protos/gen by default, laid out so
that `from streamlog.v1 import streamlog_pb2, streamlog_pb2_grpc` works once
protos/gen is on the import path (pyproject maps the `streamlog` package there).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_ROOT / "gen"
PACKAGE = "streamlog"
DESCRIPTOR_SET = "descriptors.binpb"


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto of the contract, sorted so the compiler sees them in a stable order."""
    return sorted((root / PACKAGE).rglob("*.proto"))


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Regenerate `out_dir/streamlog` from scratch; return the files written, sorted."""
    package_dir = out_dir / PACKAGE
    # Start empty so a message or file removed from the protos leaves no stale module behind.
    # The directory itself is kept: an editable install maps the package to it.
    if package_dir.exists():
        for child in package_dir.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    package_dir.mkdir(parents=True, exist_ok=True)
    protos = proto_files()
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        # The well-known types (google/protobuf/*.proto) ship inside grpc_tools.
        f"--proto_path={Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        # The descriptors with their comments, for documents built from the contract (the HTTP
        # API's OpenAPI document, service/http/openapi.py): generated code drops the comments.
        f"--descriptor_set_out={package_dir / DESCRIPTOR_SET}",
        "--include_source_info",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(map(str, protos))}")
    # protoc writes modules only; make every output directory a regular package.
    for directory in [package_dir, *(p for p in package_dir.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    return sorted(p for p in package_dir.rglob("*") if p.is_file())


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    written = generate(target)
    print(f"generated {len(written)} files in {target / PACKAGE}")
