"""requirements/lock.txt pins every package the code imports, and tools/compare_lock.py reports what moved past it.

The lock is what `make test`, `make demo` and CI install (`pip install -c requirements/lock.txt`): a package the
package, its tests, benchmarks or tools import but the lock does not pin would come at whatever version the
registry serves on the day, which is how a transformers release once broke a clean checkout's suite.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest

from tools.compare_lock import canonical, locked_versions, moved, same_version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
OWN_TOP_LEVEL = {"kvflow", "tests", "benchmarks", "tools"}


def imported_top_level_names() -> set[str]:
    """Top-level names of every absolute import in kvflow/, tests/, benchmarks/ and tools/."""
    names: set[str] = set()
    for folder in OWN_TOP_LEVEL:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names


def test_every_imported_distribution_is_pinned() -> None:
    pins = locked_versions(LOCK)
    distributions = importlib.metadata.packages_distributions()
    third_party = {
        name
        for name in imported_top_level_names()
        if name not in sys.stdlib_module_names | OWN_TOP_LEVEL and name in distributions
    }
    assert {"torch", "transformers", "pytest"} <= third_party  # the scan sees the real imports
    unpinned = {
        name: distributions[name]
        for name in sorted(third_party)
        if not any(canonical(dist) in pins for dist in distributions[name])
    }
    assert not unpinned, f"imported but not in {LOCK.name} (run `make lock`): {unpinned}"


def test_the_lock_pins_torch_without_a_local_label() -> None:
    """`torch==2.13.0` matches both the local CPU build (2.13.0+cpu) and PyPI's; `==2.13.0+cpu` only the first."""
    pins = locked_versions(LOCK)
    assert "+" not in pins["torch"]
    assert "pytest-xdist" in pins  # `make test` runs in parallel workers


@pytest.mark.parametrize(
    ("locked", "installed", "same"),
    [("2.13.0", "2.13.0+cpu", True), ("2.13.0", "2.13.0", True), ("5.24.0", "5.25.0", False)],
)
def test_a_local_build_label_is_the_same_version(locked: str, installed: str, same: bool) -> None:
    assert same_version(locked, installed) is same


def test_moved_lists_upgrades_additions_and_removals() -> None:
    locked = {"transformers": "5.24.0", "torch": "2.13.0", "gone": "1.0"}
    installed = {"transformers": "5.25.0", "torch": "2.13.0+cpu", "kernels": "0.19.1", "pip": "26"}
    assert moved(locked, installed) == [
        "gone: locked 1.0, not installed",
        "kernels: not in the lock, installed 0.19.1",
        "transformers: 5.24.0 -> 5.25.0",
    ]


def test_lock_lines_are_read_with_normalized_names(tmp_path: Path) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text(
        "# header\nJinja2==3.1.6\n    # via kvflow\nprometheus_client==0.21.1 ; python_version >= '3.9'\n"
    )
    assert locked_versions(lock) == {"jinja2": "3.1.6", "prometheus-client": "0.21.1"}
