"""What moved: the installed distributions of this environment against requirements/lock.txt.

`make test-latest` runs it in its venv of the newest versions pyproject's ranges allow, so that the closing note of
a session can say which packages moved past the lock (and the suite's verdict on them).

    python tools/compare_lock.py [requirements/lock.txt]

Prints one line per package whose version differs, that the lock lacks, or that is locked but not installed;
"no package moved" when none. Always exits 0: it reports, the suite judges.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

DEFAULT_LOCK = Path(__file__).resolve().parents[1] / "requirements" / "lock.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
NOT_LOCKED = {
    "kvflow",
    "pip",
    "setuptools",
    "wheel",
}  # the project itself and the installer's own tools


def canonical(name: str) -> str:
    """PEP 503 normalized name: case, '-', '_' and '.' do not distinguish packages."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a pip-compile output."""
    pins = {}
    for line in lock.read_text().splitlines():
        match = PIN.match(line.strip())
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def installed_versions() -> dict[str, str]:
    """name -> version of every distribution installed in this interpreter's environment."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[canonical(name)] = dist.version
    return found


def same_version(locked: str, installed: str) -> bool:
    """`torch==2.13.0` in the lock accepts the local build `2.13.0+cpu`, as pip's `==` does."""
    return installed == locked or installed.split("+", 1)[0] == locked


def moved(locked: dict[str, str], installed: dict[str, str]) -> list[str]:
    """One line per difference, sorted by package."""
    lines = []
    for name in sorted(set(locked) | set(installed)):
        if name in NOT_LOCKED:
            continue
        old, new = locked.get(name), installed.get(name)
        if old is None:
            lines.append(f"{name}: not in the lock, installed {new}")
        elif new is None:
            lines.append(f"{name}: locked {old}, not installed")
        elif not same_version(old, new):
            lines.append(f"{name}: {old} -> {new}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lock", nargs="?", type=Path, default=DEFAULT_LOCK)
    args = parser.parse_args(argv)
    lines = moved(locked_versions(args.lock), installed_versions())
    print("\n".join(lines) if lines else "no package moved")


if __name__ == "__main__":
    main()
