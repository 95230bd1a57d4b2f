"""The run record, `train_log.json` in the asset directory: what every stage did, read back by the later stages
and rendered into the model card."""

from __future__ import annotations

import json
from pathlib import Path

LOG_FILE = "train_log.json"


def read_record(outdir: Path) -> dict:
    path = outdir / LOG_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_record(outdir: Path, record: dict) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / LOG_FILE).write_text(json.dumps(record, indent=2) + "\n")
