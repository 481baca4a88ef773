"""No file of benchmarks/ or tools/ may take the name of an installed distribution's top-level module.

Run as `python benchmarks/x.py`, Python puts benchmarks/ first on sys.path: a `benchmarks/kernels.py` there once
shadowed the `kernels` distribution that transformers imports, and every later import of transformers failed. The
scripts now import each other through the `benchmarks` / `tools` packages, and this test keeps names from colliding
again whichever versions the environment resolves.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT_FOLDERS = ("benchmarks", "tools")


def top_level_names(folder: Path) -> set[str]:
    """What `import NAME` finds in `folder` when it is on sys.path: modules and packages."""
    names = {path.stem for path in folder.glob("*.py")}
    names |= {path.name for path in folder.iterdir() if (path / "__init__.py").is_file()}
    return names


def installed_top_level_names() -> dict[str, list[str]]:
    """Top-level import names of every installed distribution but kvflow itself, with their distributions."""
    names = importlib.metadata.packages_distributions()
    return {
        name: dists
        for name, dists in names.items()
        if any(dist.lower() != "kvflow" for dist in dists)
    }


def test_no_script_module_shadows_an_installed_distribution() -> None:
    installed = installed_top_level_names()
    assert "torch" in installed  # the mapping really lists this environment's distributions
    collisions = {
        f"{folder}/{name}": installed[name]
        for folder in SCRIPT_FOLDERS
        for name in sorted(top_level_names(REPO / folder))
        if name in installed
    }
    assert not collisions, f"rename these: they shadow installed distributions {collisions}"


def test_the_script_folders_themselves_shadow_nothing() -> None:
    """The repo root is on sys.path for scripts and tests, so its packages' names must be free too."""
    installed = installed_top_level_names()
    for name in (*SCRIPT_FOLDERS, "tests"):
        assert (REPO / name / "__init__.py").is_file(), f"{name}/ must be a package"
        assert name not in installed, f"{name}/ shadows {installed[name]}"


def test_a_script_run_by_path_leaves_its_folder_off_sys_path(tmp_path: Path) -> None:
    """`python benchmarks/throughput.py` (its folder is sys.path[0]) imports siblings through the package."""
    folder, script = REPO / "benchmarks", REPO / "benchmarks" / "throughput.py"
    probe = (
        "import runpy, sys\n"
        f"sys.path[0] = {str(folder)!r}  # what Python sets for `python {script}`\n"
        "sys.argv = ['throughput.py', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        f"print({str(folder)!r} in sys.path, 'benchmarks.compute_floor' in sys.modules,"
        " 'compute_floor' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert result.stdout.splitlines()[-1] == "False True False"
