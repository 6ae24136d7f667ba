"""The shipped CPU demo config, and writing an edited copy of it for a test."""

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())


def write_config(tmp_path, edit=None, text=None) -> Path:
    config = json.loads(json.dumps(DEMO))
    config["hybrid3d"]["train"]["output_dir"] = str(tmp_path / "out")
    if edit:
        edit(config)
    path = tmp_path / "config.json"
    path.write_text(text if text is not None else json.dumps(config))
    return path


def h(config):
    return config["hybrid3d"]
