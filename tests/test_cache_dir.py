"""KVFLOW_CACHE_DIR that cannot be kvflow's cache folder is a clear ValueError naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow import LLM


def test_cache_dir_that_is_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_folder = tmp_path / "cache.txt"
    not_a_folder.write_text("")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(not_a_folder))
    with pytest.raises(
        ValueError, match=r"KVFLOW_CACHE_DIR='.*cache\.txt' \(kvflow's cache folder\) is a file"
    ):
        LLM()


def test_cache_dir_under_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "file" / "kvflow"))
    with pytest.raises(
        ValueError, match=r"KVFLOW_CACHE_DIR=.*\(kvflow's cache folder\) lies under a file"
    ):
        LLM()
