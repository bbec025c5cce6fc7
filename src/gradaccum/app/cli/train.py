"""`gradaccum train`: parse flags and a config file into a TrainConfig, then train."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any

from gradaccum.app.cli import options, say

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from gradaccum.app import Interrupted, TrainConfig, train
from gradaccum.app.folder import CONFIG, RunFolder
from gradaccum.app.launch import is_main, shutdown
from gradaccum.validate import invalid_configuration

_FILE_KEYS = {f.name for f in dataclasses.fields(TrainConfig)} - {"config", "resume"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a built-in recipe or a local Hugging Face model with an exact large batch",
        description="Plan the micro-batch for a memory budget, then train with one exact "
        "optimizer step per effective batch. With no options: a byte-level GPT on the Python "
        "standard library's own source.",
    )
    options.add_arguments(parser, TrainConfig)
    parser.set_defaults(run=run)


def read_config_file(path: str) -> dict[str, Any]:
    """TOML or YAML, parsed safely; keys may use dashes or underscores; unknown keys refused."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = file.read_text()
    if file.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"--config {path}: not valid TOML: {err}") from err
    elif file.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"--config {path}: not valid YAML: {err}") from err
    else:
        raise ValueError(f"--config {path}: use a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of options, got {type(data).__name__}")
    spelled: dict[str, list[str]] = {}
    for key in data:
        spelled.setdefault(str(key).replace("-", "_"), []).append(str(key))
    twice = [" and ".join(v) for v in spelled.values() if len(v) > 1]
    if twice:
        raise ValueError(f"--config {path}: the same option given twice: {'; '.join(twice)}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise ValueError(
            f"--config {path}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}; known options: {', '.join(sorted(_FILE_KEYS))}"
        )
    return data


def _check_types(values: dict[str, Any], source: str) -> list[str]:
    """Problems with the types of values from a file (flags are typed by argparse). Two
    spellings are taken as what they mean: YAML 1.1 reads ``2e-3`` (no dot) as a string, so
    a float option takes a string that is a number; the budget takes a number of bytes."""
    hints = typing.get_type_hints(TrainConfig)
    problems = []
    for key, value in list(values.items()):
        base = options._base_type(hints[key])
        if base is float and isinstance(value, str):
            try:
                values[key] = value = float(value)
            except ValueError:
                pass
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in ("budget", "max_memory") and numeric and float(value).is_integer():
            values[key] = value = str(int(value))  # 5e8 in TOML or YAML is a float
        if key == "max_time" and numeric:
            values[key] = value = str(value)
        ok = (
            (value is None and type(None) in typing.get_args(hints[key]))
            or (isinstance(value, base) and not (isinstance(value, bool) and base is not bool))
            or (base is float and isinstance(value, int) and not isinstance(value, bool))
        )
        if not ok:
            problems.append(f"{key} must be {base.__name__}, got {value!r} in {source}")
    return problems


def resolve(args: argparse.Namespace) -> TrainConfig:
    flags = options.given(args, TrainConfig)
    values: dict[str, Any] = {}
    problems: list[str] = []
    if flags.get("resume"):
        folder = RunFolder(flags["resume"])
        folder.check_usable(resume=True)
        saved = folder.read_json(CONFIG)
        values.update({k: v for k, v in saved.items() if k in _FILE_KEYS})
        values["out"] = flags["resume"]
    from_file: dict[str, Any] = {}
    if flags.get("config"):
        from_file = read_config_file(flags["config"])
        problems += _check_types(from_file, flags["config"])
        values.update(from_file)
    # (a recipe's own defaults, for what no flag or file gives: TrainConfig resolves them)
    values.update(flags)
    for other in ("epochs", "samples"):
        if ("steps" in flags or "steps" in from_file) and values.get(other) is not None:
            problems.append(
                f"steps and {other} (here {values[other]!r}) both given: {other} decides how "
                "long the run trains, so give one of them"
            )
    if problems:
        raise ValueError(invalid_configuration(problems))
    cfg = TrainConfig(**values)
    if cfg.resume and cfg.out != cfg.resume:
        raise ValueError(
            "--out and --resume name different folders; a resumed run stays in its folder"
        )
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    try:
        summary = train(cfg)
        if summary.get("stopped_by") == "guard":  # it gave up: the run did not finish
            if is_main():
                folder = Path(summary["run_folder"])
                say(
                    f"gradaccum: the incident guard stopped the run (see "
                    f"{folder / 'incidents.jsonl'}); to train through it: gradaccum train "
                    f"--resume {folder} --no-guard"
                )
            return 1
    except Interrupted as stop:
        if is_main():  # every rank stops; one says so
            say(f"\n{stop}")
        return 128 + stop.signum
    finally:
        shutdown()  # leave a torchrun job's process group cleanly (no-op otherwise)
    return 0
