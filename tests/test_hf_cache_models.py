"""A Hugging Face id as the model, resolved offline from a local Hugging Face cache built here in
huggingface_hub's layout (`models--org--name/refs/<ref>` holding a commit, `snapshots/<commit>/` the files):
`--revision` picks a snapshot, `kvflow serve org/name` serves it under the id, and a miss is one line naming the
cache folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvflow.default_model import ensure_default_model
from tests.entrypoints.server import DEFAULT_SERVER, running_server
from tests.test_cli import run_kvflow
from tests.test_cli_errors import assert_one_line_error

MAIN_COMMIT = "a" * 40
V2_COMMIT = "b" * 40


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding acme/tiny: "main" is the built-in model, tag "v2" the same files with a generation config
    that caps outputs at 3 tokens (so a run shows which snapshot it read)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny"
    for commit in (MAIN_COMMIT, V2_COMMIT):
        shutil.copytree(ensure_default_model(), repo / "snapshots" / commit)
    v2_config = repo / "snapshots" / V2_COMMIT / "generation_config.json"
    v2_config.write_text('{"max_new_tokens": 3, "temperature": 0.0}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    (repo / "refs" / "v2").write_text(V2_COMMIT)
    return cache


def test_an_id_in_the_cache_runs_and_revision_picks_the_snapshot(hub_cache: Path) -> None:
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    prompt = ("generate", "The capital of France is", "--model", "acme/tiny")
    main = run_kvflow(*prompt, "--max-tokens", "5", "--temperature", "0", **env)
    assert main.returncode == 0, main.stderr
    assert f"snapshots/{MAIN_COMMIT}" in main.stderr  # the loader logs the folder it read
    v2 = run_kvflow(*prompt, "--revision", "v2", **env)
    assert v2.returncode == 0, v2.stderr
    assert f"snapshots/{V2_COMMIT}" in v2.stderr


def test_an_id_missing_from_the_cache_is_one_line_naming_where_kvflow_looked(
    hub_cache: Path,
) -> None:
    result = run_kvflow(
        "generate", "Hi", "--model", "acme/absent", HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1"
    )
    assert_one_line_error(result, "not in the local Hugging Face cache")
    assert (
        str(hub_cache) in result.stderr and "huggingface-cli download acme/absent" in result.stderr
    )


@pytest.mark.slow  # a server start; resolving ids from the cache is the LLM test's, served names tests/entrypoints
def test_serve_an_id_from_the_cache_under_the_id_as_its_model_name(hub_cache: Path) -> None:
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    with running_server("acme/tiny", "--revision", "v2", *DEFAULT_SERVER, env=env) as server:
        client = server.client()
        assert [model.id for model in client.models.list()] == ["acme/tiny"]
        completion = client.completions.create(
            model="acme/tiny", prompt="The capital of France is", max_tokens=16
        )
        # v2's generation_config.json caps outputs at 3 tokens: the server read that snapshot.
        assert completion.usage.completion_tokens == 3
