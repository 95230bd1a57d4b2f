"""The committed generated code is what `make proto` produces from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto" / "pdspark" / "v1").glob("*.proto"))
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    generated = sorted(p.name for p in (tmp_path / "pdspark" / "v1").iterdir())
    committed = sorted(p.name for p in (ROOT / "src" / "pdspark" / "v1").iterdir() if p.name != "__init__.py"
                       and p.suffix in (".py", ".pyi"))
    assert generated == committed
    for name in generated:
        fresh = (tmp_path / "pdspark" / "v1" / name).read_text()
        assert fresh == (ROOT / "src" / "pdspark" / "v1" / name).read_text(), f"{name} is stale: run `make proto`"


def test_installed_package_imports_the_schema():
    from pdspark.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    assert worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"]
    assert hasattr(worker_pb2_grpc, "DecodeWorkerStub") and common_pb2.ErrorCode.Value("ERROR_CODE_INCOMPATIBLE") == 2
