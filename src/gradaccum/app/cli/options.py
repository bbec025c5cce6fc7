"""A command's flags from its configuration's dataclass (app/config.py's options).

Each field's ``metadata["help"]`` is its --help line; ``choices`` restricts a string; a
bool becomes a flag; an option that may be None takes ``none`` to set it so. A field whose
type is itself a dataclass is a section: its options become a group in --help, their flags
as flat as any other (``--effective-batch``, not ``--batch.effective-batch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

from gradaccum.app.config import base_type


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


def sections(cls: type) -> Iterator[tuple[str | None, type]]:
    """(section title, dataclass) for each group of options: the class itself when it is
    flat, else each section, titled by its docstring."""
    hints = typing.get_type_hints(cls)
    nested = [f for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    if not nested:
        yield None, cls
    for f in nested:
        yield f"{f.name}: {(hints[f.name].__doc__ or '').strip()}", hints[f.name]


def names(cls: type) -> set[str]:
    """Every option's name (the sections' fields, for a sectioned configuration)."""
    return {f.name for _, section in sections(cls) for f in dataclasses.fields(section)}


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    for title, section in sections(cls):
        group = parser if title is None else parser.add_argument_group(title)
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            _add(group, f, hints[f.name])


def _add(group: Any, f: dataclasses.Field, hint: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    opt = f.metadata.get("opt")
    help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help
    default = f.default if f.default is not dataclasses.MISSING else None
    tp = base_type(hint)
    if tp is bool:
        action = argparse.BooleanOptionalAction if default else "store_true"
        group.add_argument(flag, action=action, default=None, help=help_text)
        return
    shown = "" if default is None else f" (default: {default})"
    optional = type(None) in typing.get_args(hint)
    group.add_argument(
        flag,
        type=_or_none(tp) if optional else tp,
        default=None,  # None means "not given", so config files can sit under flags
        choices=opt.choices if opt else None,
        metavar=(opt.metavar if opt else None) or f.name.upper(),
        help=help_text + shown,
    )


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options the user typed (not the defaults), by name."""
    known = names(cls)
    typed = {k: v for k, v in vars(args).items() if k in known and v is not None}
    return {k: None if v is UNSET else v for k, v in typed.items()}
