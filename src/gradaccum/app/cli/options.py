"""Config dataclasses as the one source of defaults, help text and parsing for the CLI.

Each field's ``metadata["help"]`` is its --help line; ``choices`` restricts a string; a
bool becomes a flag; an option that may be None takes ``none`` to set it so. Commands
define a keyword-only dataclass and call these two helpers.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _base_type(tp: Any) -> Any:
    """int for ``int``, str for ``str | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


class _Unset:
    """A value typed as ``none``: the option set to None (a target removed on --resume)."""

    def __repr__(self) -> str:
        return "none"


UNSET = _Unset()


def _or_none(tp: Any) -> Any:
    def parse(text: str) -> Any:
        return UNSET if text.strip().lower() == "none" else tp(text)

    parse.__name__ = tp.__name__  # argparse names the type in its errors
    return parse


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help
        default = f.default if f.default is not dataclasses.MISSING else None
        tp = _base_type(hints[f.name])
        if tp is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(flag, action=action, default=None, help=help_text)
            continue
        shown = "" if default is None else f" (default: {default})"
        optional = type(None) in typing.get_args(hints[f.name])
        parser.add_argument(
            flag,
            type=_or_none(tp) if optional else tp,
            default=None,  # None means "not given", so config files can sit under flags
            choices=f.metadata.get("choices"),
            metavar=f.metadata.get("metavar", f.name.upper()),
            help=help_text + shown,
        )


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options the user typed (not the defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return {k: None if v is UNSET else v for k, v in given.items()}


def build(cls: type[T], values: dict[str, Any]) -> T:
    return cls(**values)
