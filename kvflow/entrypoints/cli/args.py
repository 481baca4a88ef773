"""Flags shared by the subcommands: the help formatter, the engine and sampling groups, and their parsing."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, NoReturn

from kvflow.entrypoints.cli.config_file import ConfigFileParser

if TYPE_CHECKING:
    from kvflow.sampling_params import SamplingParams

LOGGING_EPILOG = """\
logging:
  Logs (INFO and above) go to stderr. KVFLOW_LOGGING_LEVEL=WARNING quiets them; DEBUG
  shows more (and the traceback behind an engine startup error)."""


class SubcommandParser(ConfigFileParser):
    """A subcommand's parser: a usage error is one line naming the mistake and where help is, instead of the
    whole usage (dozens of engine flags) followed by the message. A subcommand with `--config`
    (`config_file.add_config_file_argument`) reads its flags from that YAML file too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except where it says nothing ("(default: None)", a flag's False) or the help
    text already states it; descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if (
            "default" in help_text
            or not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return help_text
        return super()._get_help_string(action)


def parse_token_ids(text: str) -> list[int]:
    """ "1,2, 3" -> [1, 2, 3]; argparse reports the ValueError as a usage error naming the flag."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated non-negative token ids, got {text!r}"
        )
    return [int(item) for item in items]


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per `EngineArgs` field (the "engine" group), but those in `exclude`."""
    from kvflow.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser, exclude=exclude)


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """The "sampling" group: one flag per `SamplingParams` field the commands expose."""
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="most tokens to generate per sample"
    )
    sampling.add_argument(
        "--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop may end"
    )
    sampling.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy; higher is more random"
    )
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sampling.add_argument(
        "--top-k", type=int, default=0, help="sample from the k most likely (0: all)"
    )
    sampling.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one's"
    )
    sampling.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeated tokens"
    )
    sampling.add_argument(
        "--presence-penalty", type=float, default=0.0, help="penalty on tokens already present"
    )
    sampling.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="penalty per earlier occurrence"
    )
    sampling.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)"
    )
    sampling.add_argument(
        "--stop-token-ids",
        action="append",
        type=parse_token_ids,
        default=None,
        metavar="IDS",
        help="token ids that end a sample: comma-separated, repeatable",
    )
    sampling.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token"
    )
    sampling.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="print each generated token's logprob and rank, plus the N most likely alternatives",
    )


def sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    """The SamplingParams the flags ask for (ValueError naming a bad field, before any model loads)."""
    from kvflow.sampling_params import SamplingParams

    stop_token_ids = [token for ids in args.stop_token_ids or [] for token in ids]
    return SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        stop_token_ids=stop_token_ids or None,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        **overrides,
    )
