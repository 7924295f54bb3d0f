"""`--config FILE` (YAML or JSON; keys are flag names, with or without dashes) read through the command line's own
parser: every value gets its flag's type and choices, booleans strictly (true/false, not "false" the string),
an unknown key names the nearest flag, and the flags of a mutually exclusive group may not both be set in the
file. The command line wins over the file, also across such a group (`--fp16` on the command line overrides
`bf16: true` in the file). `KEY:` with no value (null) leaves the flag at its default.

No file can exhaust memory or time: a file over MAX_BYTES is refused unread, YAML aliases (`*name`, the way a
few lines expand to gigabytes) are refused before any value is built (libyaml's parser where PyYAML has it: the
pure-Python one takes seconds per 100 KB), and every message quotes a value as a bounded excerpt.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os

from mpzero.cli.checks import CheckError, Number, error_reason
from mpzero.cli.megatron_flags import NOT_IN_MPZERO
from mpzero.errors import ConfigError, excerpt, shorten

MAX_BYTES = 1 << 16  # a flags file is a few KB (every flag of pretrain_gpt.py: ~6 KB); over 64 KiB is no flags file


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """{dest: typed value} for the flags `path` sets."""
    values = _load_mapping(path)
    by_dest, by_option = {}, {}  # a key is a flag name (no-masked-softmax-fusion) or its dest (masked_softmax_fusion)
    for action in parser._actions:
        if action.dest in ("help", "config"):
            continue
        by_dest[action.dest] = action
        for option in action.option_strings:
            by_option[option.lstrip("-").replace("-", "_")] = action
    typed = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        action = by_option.get(name) or by_dest.get(name)
        if action is None:
            megatron = "--" + name.replace("_", "-")
            if megatron in NOT_IN_MPZERO:
                raise ConfigError(f"--config {path}: {key}: a Megatron-LM flag that mpzero does not have; "
                                  f"{NOT_IN_MPZERO[megatron]}")
            near = difflib.get_close_matches(name, list(by_option), n=1)
            hint = f": did you mean {_flag(near[0])!r}?" if near else ""
            raise ConfigError(f"--config {path}: unknown flag {excerpt(key)}{hint}")
        if value is None:  # `KEY:` with no value: the flag's default
            continue
        typed[action.dest] = _typed(path, key, value, action, given_as_option=name in by_option)
    for group in parser._mutually_exclusive_groups:
        both = [a.dest for a in group._group_actions if a.dest in typed and typed[a.dest] != a.default]
        if len(both) > 1:
            raise ConfigError(f"--config {path} sets {' and '.join(_flag(d) for d in both)}: they exclude each "
                              f"other, keep one")
    return typed


def drop_overridden(typed: dict, parser: argparse.ArgumentParser, argv: list[str] | None) -> dict:
    """The file's values less those of a mutually exclusive group the command line sets a member of."""
    given = _given_on_command_line(parser, argv)
    out = dict(typed)
    for group in parser._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        if dests & given:
            for dest in dests - given:
                out.pop(dest, None)
    return out


def _given_on_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    options = {}
    for action in parser._actions:
        for option in action.option_strings:
            options[option] = action.dest
    given = set()
    for token in argv or []:
        name = token.split("=", 1)[0]
        if name in options:
            given.add(options[name])
    return given


def _load_mapping(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    is_yaml = path.endswith((".yaml", ".yml"))
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ConfigError(f"--config {path} is over {MAX_BYTES >> 10} KiB: a flags file is a few KB of "
                              f"flag: value lines")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {path} cannot be read as UTF-8 text ({error_reason(error)})") from None
    if not text.strip():
        raise ConfigError(f"--config {path} is empty: write flag: value lines, or drop --config")
    try:
        values = _yaml_without_aliases(path, text) if is_yaml else json.loads(text)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - any parse failure is the same one-line answer
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"--config {path} is not valid {'YAML' if is_yaml else 'JSON'}: "
                          f"{shorten(reason)}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a mapping of flag names to values")
    return values


def _yaml_without_aliases(path: str, text: str):
    """yaml.safe_load, but an alias (`*name`, also `<<: *name`) is refused from the event stream, before any
    value is built: a few aliased lines expand to gigabytes."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(f"--config {path}: line {event.start_mark.line + 1} uses the YAML alias "
                              f"*{shorten(str(event.anchor), 40)}: aliases are not read; write the value out")
    return yaml.load(text, Loader=loader)  # noqa: S506 - CSafeLoader/SafeLoader: plain values only


def _typed(path: str, key, value, action: argparse.Action, given_as_option: bool):
    where = f"--config {path}: {excerpt(key)[1:-1] if isinstance(key, str) else excerpt(key)}"
    if action.nargs == 0:  # a switch (store_true / store_false: const is the value it stores when given)
        if not isinstance(value, bool):
            raise ConfigError(f"{where} is {excerpt(value)}: write true or false (unquoted)")
        # `no-overlap-comm: true` gives the switch; `overlap_comm: false` sets its destination directly
        return (action.const if value else action.default) if given_as_option else value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else str(value).split()
        return [_one_value(where, item, action) for item in items]
    return _one_value(where, value, action)


def _one_value(where: str, value, action: argparse.Action):
    """`value` through its flag's checked type (mpzero/cli/checks.py), strictly: 64.0 is not an integer, a
    boolean is not a number, a list or mapping is not one value."""
    if isinstance(value, (dict, list, bool)):
        raise ConfigError(f"{where} is {excerpt(value)}, not a single {_type_name(action)}")
    kind = Number(action.type) if action.type in (int, float) else action.type
    if isinstance(kind, Number) and kind.kind is int and isinstance(value, float):
        raise ConfigError(f"{where} is {excerpt(value)}, not an integer")
    try:
        typed = kind(value) if kind is not None else str(value)
    except CheckError as error:
        text = str(error)
        if text.startswith(("invalid ", excerpt(value) + " is not a")):  # a value of another type
            raise ConfigError(f"{where} is {excerpt(value)}, not {_type_name(action)}") from None
        raise ConfigError(f"{where} {text}") from None
    except (TypeError, ValueError):
        raise ConfigError(f"{where} is {excerpt(value)}, not {_type_name(action)}") from None
    if action.choices is not None and typed not in action.choices:
        raise ConfigError(f"{where} is {excerpt(typed)}: choose one of {', '.join(map(str, action.choices))}")
    return typed


def _type_name(action: argparse.Action) -> str:
    kind = action.type.kind if isinstance(action.type, Number) else action.type
    return {int: "an integer", float: "a number"}.get(kind, "a string")


def _flag(dest: str) -> str:
    return dest.replace("_", "-")
