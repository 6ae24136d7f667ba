"""Benchmarks that draw charts refuse to start without matplotlib: one line, exit 2, before measuring."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HIDE_MATPLOTLIB = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                   "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("script, args", [("zero_compare.py", ["--quick"]), ("breakdown.py", ["--layouts", "TP2"])])
def test_without_matplotlib(script, args):
    result = subprocess.run([sys.executable, "-c", HIDE_MATPLOTLIB, str(ROOT / "benchmarks" / script), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: this benchmark draws charts with matplotlib: "
                                                  "pip install -e '.[bench]'"]
