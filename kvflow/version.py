"""`kvflow.__version__`: the installed distribution's version, or pyproject.toml's in a source checkout."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _version_from_pyproject(pyproject: Path) -> str:
    """The `version = "..."` of pyproject's [project] table; "unknown" when there is no such file or line."""
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    project = re.search(r"^\[project\]$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    match = project and re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.MULTILINE)
    return match.group(1) if match else "unknown"


def get_version() -> str:
    """Package metadata first (what `pip install` recorded); pyproject.toml when kvflow is not installed."""
    try:
        return metadata.version("kvflow")
    except metadata.PackageNotFoundError:
        return _version_from_pyproject(_PYPROJECT)


__version__ = get_version()
