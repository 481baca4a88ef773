"""`kvflow serve --config FILE.yaml` (vLLM's): every flag by its long name ('max-num-seqs' or 'max_num_seqs'),
true/false for on/off flags, lists for flags with several values, `model` for the model; the command line wins
over the file; an unknown key, a refused value, and a missing or unparsable file are one-line usage errors naming
the file and the key. One real server started from a file answers with the file's settings."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvflow.entrypoints.cli.config_file import ConfigFileParser, add_config_file_argument
from kvflow.entrypoints.cli.engine import CommandError
from kvflow.entrypoints.cli.main import build_parser, main
from kvflow.entrypoints.cli.serve import resolve_model
from tests.entrypoints.server import RemoteServer, running_server


def write(folder: Path, text: str, name: str = "serve.yaml") -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


def parse_serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `kvflow` prints for a usage error (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    return line


def test_the_files_values_are_the_flags_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
model: hash
served-model-name: from-file
max_num_seqs: 8                   # either spelling
max-num-batched-tokens: 512
scheduling_policy: priority       # a flag with choices
timeout-keep-alive: 30.5
enable-admin-endpoints: true      # store_true
enable_prefix_caching: false      # --enable-prefix-caching / --no-enable-prefix-caching
no-engine-process: true
lora-modules: [a=/adapters/a, {name: b, path: /adapters/b}]   # nargs '+'; a mapping as JSON
allowed-origins: ["https://app.example"]                       # a list for a one-value JSON flag
speculative-config: {method: ngram, num_speculative_tokens: 2}
""",
    )
    args = parse_serve("--config", path)
    assert (args.model, args.model_tag, args.served_model_name) == ("hash", None, "from-file")
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (8, 512)
    assert (args.scheduling_policy, args.timeout_keep_alive) == ("priority", 30.5)
    assert args.enable_admin_endpoints is True
    assert (args.enable_prefix_caching, args.engine_process) == (False, False)
    assert args.lora_modules == ["a=/adapters/a", '{"name": "b", "path": "/adapters/b"}']
    assert args.allowed_origins == ("https://app.example",)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    untouched = parse_serve()
    assert (args.port, args.host, args.max_model_len) == (
        untouched.port,
        untouched.host,
        untouched.max_model_len,
    )
    assert untouched.config_file_dests == frozenset()
    assert "max_num_seqs" in args.config_file_dests and "port" not in args.config_file_dests


def test_the_command_line_wins_before_and_after_config(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: /from/file\nmax-num-seqs: 8\nenable-prefix-caching: false\n"
        "lora-modules: [a=/x]\nport: 9000\n",
    )
    args = parse_serve(
        "hash",
        "--max-num-seqs",
        "2",
        "--config",
        path,
        "--enable-prefix-caching",
        "--lora-modules",
        "b=/y",
    )
    assert (args.max_num_seqs, args.enable_prefix_caching, args.lora_modules) == (2, True, ["b=/y"])
    assert args.port == 9000  # from the file: not on the command line
    resolve_model(args)  # MODEL given on the command line wins over the file's model
    assert args.model == "hash"
    with pytest.raises(CommandError, match="disagree"):  # but not over --model on the command line
        resolve_model(parse_serve("hash", "--model", "/elsewhere", "--config", path))


def test_every_kind_of_option_of_any_parser(tmp_path: Path) -> None:
    """The reading is the parser's own, for options no code of config_file.py names: append, fixed counts."""
    parser = ConfigFileParser(prog="tool")
    add_config_file_argument(parser)
    parser.add_argument("--stop", action="append", default=None)
    parser.add_argument("--point", nargs=2, type=float, default=None)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--color", action=argparse.BooleanOptionalAction, default=True)
    path = write(tmp_path, "stop: [a, b]\npoint: [1, 2.5]\nquiet: true\nno-color: true\n")
    args = parser.parse_args(["--config", path])
    assert (args.stop, args.point, args.quiet, args.color) == (["a", "b"], [1.0, 2.5], True, False)
    # an append flag on the command line replaces the file's list instead of adding to it
    assert parser.parse_args(["--stop", "c", "--config", path]).stop == ["c"]
    assert parser.parse_args(["--config", path, "--color"]).color is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-seq: 8\n", "unknown key 'max-num-seq' (did you mean 'max-num-seqs'?)"),
        ("help: true\n", "unknown key 'help'"),
        ("config: other.yaml\n", "unknown key 'config'"),
        ("scheduling-policy: lifo\n", "scheduling-policy: invalid choice: 'lifo'"),
        ("max-num-seqs: many\n", "max-num-seqs: invalid int value: 'many'"),
        ("enable-admin-endpoints: 1\n", "enable-admin-endpoints: expected true or false, got 1"),
        ("allowed-origins: https://app.example\n", "allowed-origins: expected a JSON list"),
        # vLLM's list of served names: kvflow serves one; never a model literally named '["a", "b"]'
        ("served-model-name: [a, b]\n", "served-model-name: expected one value, got a list"),
        (
            "max-num-seqs: 2\nmax_num_seqs: 3\n",
            "'max_num_seqs' and 'max-num-seqs' set the same option",
        ),
        ("max-num-seqs: [8\n", "not valid YAML (line 2)"),
        ("- max-num-seqs\n", "expected a mapping of flag names to values, got list"),
    ],
)
def test_a_bad_file_is_a_one_line_usage_error_naming_it(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, text)
    line = usage_error(["serve", "--config", path], capsys)
    assert line.startswith(f"kvflow serve: error: --config {path}: {message}")


def test_a_missing_file_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "absent.yaml")
    line = usage_error(["serve", "--config", path], capsys)
    assert line.startswith(f"kvflow serve: error: --config {path}: cannot read it: No such file")


def test_an_empty_file_sets_nothing(tmp_path: Path) -> None:
    args = parse_serve("--config", write(tmp_path, "# nothing yet\n"))
    assert args.config_file_dests == frozenset() and args.max_num_seqs == parse_serve().max_num_seqs


@pytest.fixture(scope="module")
def served_from_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    path = write(
        tmp_path_factory.mktemp("config"),
        """
model: hash
served-model-name: from-yaml
max_model_len: 1024
num-kv-blocks: 256
max-num-seqs: 16
allowed-origins: ["https://app.example"]
""",
    )
    with running_server("--config", path, "--max-model-len", "512") as server:
        yield server


def test_a_server_started_from_a_file_serves_its_settings(served_from_file: RemoteServer) -> None:
    [card] = served_from_file.client().models.list().data
    assert card.id == "from-yaml"
    assert card.model_extra["max_model_len"] == 512  # the command line won over the file's 1024
    cors = httpx.get(f"{served_from_file.url}/v1/models", headers={"Origin": "https://app.example"})
    assert cors.headers["access-control-allow-origin"] == "https://app.example"
