"""`--config FILE.yaml`: a command's flags read from a YAML file, as vLLM's `vllm serve --config` reads them.

The file is a mapping from flag names to values:

    model: /models/qwen2.5-0.5b          # the `--model` flag (MODEL given on the command line wins)
    served-model-name: qwen              # a flag's long name without its dashes ...
    max_num_seqs: 8                      # ... with '-' or '_' between words
    enable-prefix-caching: false         # booleans: true / false
    enable-admin-endpoints: true
    lora-modules: [a=/adapters/a, b=/adapters/b]   # a list for a flag that takes several values
    allowed-origins: ["https://app.example"]       # a list or mapping for a one-value flag: passed as JSON

Every option of the parser works with no extra code: a key is looked up among the parser's own option strings
and its value goes through the option's own `type`, `choices` and action, so a value is checked exactly as on the
command line. Flags given on the command line win over the file. An unknown key, a value of the wrong shape, or a
missing or unparsable file is a usage error naming the file and the key.

How: `ConfigFileParser.parse_known_args` parses the command line as usual; when it holds `--config`, it parses it
once more with every default suppressed (which tells the flags given on the command line apart from defaults),
turns the file's values into a namespace by calling each option's action, and parses the command line a last time
over that namespace for the options the command line does not give. The destinations taken from the file are
listed in `args.config_file_dests`.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"
# The namespace attribute listing the destinations whose values came from the file (empty without --config).
CONFIG_FILE_DESTS = "config_file_dests"


class ConfigFileAction(argparse.Action):
    """The `--config FILE` option: stores the path (the file is read by `ConfigFileParser`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


def add_config_file_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Adds `--config FILE.yaml` (the parser must be a `ConfigFileParser` for it to be read)."""
    parser.add_argument(
        CONFIG_FLAG,
        action=ConfigFileAction,
        default=None,
        metavar="FILE.yaml",
        help="read flags from a YAML file: each key a flag's long name ('max-num-seqs' or "
        "'max_num_seqs'; 'model' for the model), true/false for on/off flags, a list for flags "
        "that take several values; flags on the command line win over the file",
    )


class ConfigFileParser(argparse.ArgumentParser):
    """An ArgumentParser that reads `--config FILE.yaml` when it has the option (`add_config_file_argument`).

    Invariants: without `--config` on the command line, parsing is argparse's own, plus `config_file_dests` set
    to an empty frozenset when the parser has the option; with it, every destination in `config_file_dests` holds
    the file's value and was not given on the command line.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        config_action = next(
            (action for action in self._actions if isinstance(action, ConfigFileAction)), None
        )
        if config_action is None:
            return super().parse_known_args(args, namespace)
        start = argparse.Namespace(**vars(namespace)) if namespace is not None else None
        parsed, extras = super().parse_known_args(args, start)
        path = getattr(parsed, config_action.dest)
        if path is None:
            setattr(parsed, CONFIG_FILE_DESTS, frozenset())
            return parsed, extras
        given = self._given_on_command_line(args)
        from_file = {
            dest: value
            for dest, value in vars(self._read_config_file(path)).items()
            if dest not in given
        }
        start = argparse.Namespace(**{**vars(namespace or argparse.Namespace()), **from_file})
        parsed, extras = super().parse_known_args(args, start)
        setattr(parsed, CONFIG_FILE_DESTS, frozenset(from_file))
        return parsed, extras

    def _given_on_command_line(self, args: Sequence[str] | None) -> set[str]:
        """The destinations the command line sets: its parse with every option's default suppressed holds only
        those (and the positionals', which no file key names)."""
        optionals = [action for action in self._actions if action.option_strings]
        saved_defaults = [(action, action.default) for action in optionals]
        saved_parser_defaults = dict(self._defaults)
        try:
            for action in optionals:
                action.default = argparse.SUPPRESS
            self._defaults.clear()
            parsed, _ = super().parse_known_args(args, None)
        finally:
            for action, default in saved_defaults:
                action.default = default
            self._defaults.update(saved_parser_defaults)
        return set(vars(parsed))

    def _read_config_file(self, path: str) -> argparse.Namespace:
        """The file's values, each through its option's type, choices and action; `self.error` (one line naming
        the file) for a missing or unparsable file, an unknown key, or a value the option refuses."""
        import yaml  # only with --config: the command line starts without it

        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            self.error(f"{CONFIG_FLAG} {path}: cannot read it: {error.strerror or error}")
        except UnicodeDecodeError:
            self.error(f"{CONFIG_FLAG} {path}: not a UTF-8 text file")
        try:
            content = yaml.safe_load(text)
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" (line {where.line + 1})" if where is not None else ""
            problem = getattr(error, "problem", None) or type(error).__name__
            self.error(f"{CONFIG_FLAG} {path}: not valid YAML{line}: {problem}")
        if content is None:
            content = {}
        if not isinstance(content, dict):
            self.error(
                f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values, got "
                f"{type(content).__name__}"
            )
        values = argparse.Namespace()
        keys_by_dest: dict[str, str] = {}
        for key, value in content.items():
            action, option_string = self._option_for_key(path, key)
            if action.dest in keys_by_dest:
                self.error(
                    f"{CONFIG_FLAG} {path}: {key!r} and {keys_by_dest[action.dest]!r} set the same option"
                )
            keys_by_dest[action.dest] = str(key)
            try:
                _apply(self, action, option_string, value, values)
            except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
                self.error(f"{CONFIG_FLAG} {path}: {key}: {error}")
        return values

    def _option_for_key(self, path: str, key: object) -> tuple[argparse.Action, str]:
        """The option a file key names (`max-num-seqs` or `max_num_seqs` -> `--max-num-seqs`) and the option
        string it matched; `self.error` naming the key when it names none (help and --config itself included)."""
        if isinstance(key, str):
            option_string = "--" + key.replace("_", "-")
            action = self._option_string_actions.get(option_string)
            if action is not None and _settable(action):
                return action, option_string
        names = sorted(
            option[2:]
            for option, action in self._option_string_actions.items()
            if option.startswith("--") and _settable(action)
        )
        close = difflib.get_close_matches(str(key).replace("_", "-"), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        self.error(f"{CONFIG_FLAG} {path}: unknown key {key!r}{hint}: not a {self.prog} flag")


def _settable(action: argparse.Action) -> bool:
    """Whether a file may set this option: not --help, --version or --config itself."""
    return not isinstance(action, argparse._HelpAction | argparse._VersionAction | ConfigFileAction)


def _apply(
    parser: argparse.ArgumentParser,
    action: argparse.Action,
    option_string: str,
    value: Any,
    namespace: argparse.Namespace,
) -> None:
    """Sets `namespace` as the command line `option_string VALUE...` would (null: the option's default)."""
    if value is None:
        setattr(namespace, action.dest, action.default)
    elif action.nargs == 0:  # an on/off flag
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        if value:
            action(parser, namespace, None, option_string)
        elif isinstance(action, argparse.BooleanOptionalAction):
            [opposite] = [option for option in action.option_strings if option != option_string]
            action(parser, namespace, None, opposite)
        else:
            setattr(namespace, action.dest, action.default)
    elif isinstance(action, argparse._AppendAction) and not isinstance(
        action, argparse._ExtendAction
    ):
        # each item as one occurrence of the flag
        for item in value if isinstance(value, list) else [value]:
            action(parser, namespace, _convert(parser, action, item), option_string)
    elif action.nargs in (None, argparse.OPTIONAL):
        action(parser, namespace, _convert(parser, action, value), option_string)
    else:  # several values: '+', '*' or a count
        items = value if isinstance(value, list) else [value]
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            raise ValueError(f"expected {action.nargs} values, got {len(items)}")
        if action.nargs == argparse.ONE_OR_MORE and not items:
            raise ValueError("expected at least one value")
        action(parser, namespace, [_convert(parser, action, item) for item in items], option_string)


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, value: Any) -> Any:
    """One value as the option's `type` reads it from the command line, checked against its `choices`: a mapping
    is passed as JSON, and so is a list to a flag with a `type` (one that reads a JSON list; a text flag refuses
    it); a boolean as true/false, anything else as its text."""
    if isinstance(value, list) and action.type in (None, str):
        # a text flag (no JSON list reader) takes one value: vLLM's list of served model names, say, is refused
        # rather than served as a name spelled '["a", "b"]'
        raise ValueError(f"expected one value, got a list: {value!r}")
    if isinstance(value, list | dict):
        text = json.dumps(value)
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = str(value)
    convert = parser._registry_get("type", action.type, action.type) or str
    try:
        converted = convert(text)
    except argparse.ArgumentTypeError:
        raise
    except (TypeError, ValueError) as error:
        name = getattr(action.type, "__name__", "value")
        raise ValueError(f"invalid {name} value: {text!r}") from error
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ValueError(f"invalid choice: {converted!r} (choose from {choices})")
    return converted
