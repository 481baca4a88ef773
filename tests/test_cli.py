"""The `kvflow` console script, run as a real subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def kvflow_command() -> list[str]:
    script = shutil.which("kvflow", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "kvflow.entrypoints.cli"]


def test_demo_subcommand_verifies_its_outputs() -> None:
    result = subprocess.run([*kvflow_command(), "demo", "--num-requests", "20", "--max-tokens", "5"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "verified:            20/20" in result.stdout
    assert "prefix-cache hits" in result.stdout


def test_missing_subcommand_is_a_usage_error() -> None:
    result = subprocess.run(kvflow_command(), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "usage: kvflow" in result.stderr
