"""`gradaccum train`: parse flags and a config file into a TrainConfig, then train."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

from gradaccum.app.cli import options
from gradaccum.app.process import say

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from gradaccum.app import Interrupted, TrainConfig, train
from gradaccum.app.config import HINTS, OPTION_SECTION, SECTIONS, base_type
from gradaccum.app.folder import CONFIG, INCIDENTS, RunFolder
from gradaccum.app.launch import is_main, shutdown
from gradaccum.validate import invalid_configuration

_FLAGS_ONLY = {"config": "--config FILE", "resume": "--resume DIR"}  # docs/cli.md says so
_FILE_KEYS = set(OPTION_SECTION) - set(_FLAGS_ONLY)
_LENGTH = ("steps", "epochs", "samples")  # how long the run trains: one of them


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
    """TOML or YAML, parsed safely, into option names: flat keys, or keys under their
    section's table (``[batch]`` then ``effective_batch = 256``); dashes or underscores.
    Every problem of its keys (unknown, given twice, a flag only, a section as a value) is
    refused in one ValueError."""
    values, problems = parse_config_file(path)
    if problems:
        raise ValueError(invalid_configuration(problems))
    return values


def parse_config_file(path: str) -> tuple[dict[str, Any], list[str]]:
    """(option name -> value, every problem of the file's keys): the options it gives well,
    and what is wrong with the rest, each problem naming the file, so the caller reports
    them with the values' own problems in one pass. A file that cannot be read or parsed at
    all is a ValueError of its own."""
    data = _load_config_file(path)
    found: dict[str, tuple[str, Any]] = {}  # option -> (as written, value)
    twice, unknown, problems = [], [], []
    example = "[{0}]` then `{1} = ...`" if path.endswith(".toml") else "{0}:` then `  {1}: ...`"

    def add(key: str, value: Any, written: str, section: str | None = None) -> None:
        name = key.replace("-", "_")
        if name in _FLAGS_ONLY:
            problems.append(
                f"--config {path}: {written} cannot be set in a config file: it is a flag "
                f"only ({_FLAGS_ONLY[name]})"
            )
        elif name in SECTIONS and section is None:  # a section, given a value
            first = fields(SECTIONS[name])[0].name
            problems.append(
                f"--config {path}: {written} is a section (a table), not an option; write "
                f"`" + example.format(name, first) + f" (its options: "
                f"{', '.join(f.name for f in fields(SECTIONS[name]))})"
            )
        elif name not in OPTION_SECTION or (section and OPTION_SECTION[name] != section):
            home = OPTION_SECTION.get(name)
            unknown.append(written + (f" (it belongs under [{home}])" if home else ""))
        elif name in found:
            twice.append(f"{found[name][0]} and {written}")
        else:
            found[name] = (written, value)

    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for inner, v in value.items():
                add(str(inner), v, f"[{key}] {inner}", name)
        else:
            add(str(key), value, str(key))
    if twice:
        problems.append(f"--config {path}: the same option given twice: {'; '.join(twice)}")
    if unknown:
        near = [_nearest(u.split(" ")[-1]) for u in unknown]
        said = [
            u + (f" (did you mean {n}?)" if n and "belongs" not in u else "")
            for u, n in zip(unknown, near, strict=True)
        ]
        problems.append(
            f"--config {path}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(said)}; every option is listed in gradaccum train --help"
        )
    return {name: _coerce(name, value) for name, (_, value) in found.items()}, problems


def _load_config_file(path: str) -> dict[Any, Any]:
    """The file's table, parsed (TOML, or YAML with safe_load); ValueError naming the file
    when it is not one: a folder, missing, not UTF-8 text, not valid TOML or YAML."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(
            f"--config {path}: is a directory; --config takes a file (.toml, .yaml or .yml)"
        )
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    if file.suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"--config {path}: use a .toml, .yaml or .yml file")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--config {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
            f"{err.start}); a config file is TOML or YAML text"
        ) from None
    except OSError as err:
        raise ValueError(f"--config {path}: cannot be read ({err.strerror or err})") from None
    if file.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"--config {path}: not valid TOML: {err}") from err
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"--config {path}: not valid YAML: {_yaml_problem(err)}") from err
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of options, got {type(data).__name__}")
    return data


def _nearest(key: str) -> str | None:
    """The known option a mistyped key most likely means, as a file would write it."""
    import difflib

    name = key.replace("-", "_")
    if name in _OTHER_NAMES:
        return _OTHER_NAMES[name]
    found = difflib.get_close_matches(name, sorted(_FILE_KEYS), n=1, cutoff=0.6)
    return found[0].replace("_", "-") if found else None


# What other trainers call an option (Hugging Face's TrainingArguments, Lightning).
_OTHER_NAMES = {
    "learning_rate": "lr",
    "max_steps": "steps",
    "num_train_epochs": "epochs",
    "max_epochs": "epochs",
    "batch_size": "effective-batch",
    "per_device_train_batch_size": "micro-batch",
    "gradient_accumulation_steps": "effective-batch (micro-batches follow from --budget)",
    "accumulate_grad_batches": "effective-batch (micro-batches follow from --budget)",
    "warmup": "warmup-steps",
    "output_dir": "out",
}


def _yaml_problem(err: Exception) -> str:
    """PyYAML's several-line message as one: what it expected, and where."""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{what}{where}"


def _coerce(name: str, value: Any) -> Any:
    """A file's spellings taken as what they mean (flags are typed by argparse; a wrong type
    is left for the configuration's own check): YAML 1.1 reads ``2e-3`` (no dot) as a
    string, so a float option takes a string that is a number; the budget and
    --max-memory take a number of bytes, --max-time a number of seconds."""
    base = base_type(HINTS[name])
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if name in ("budget", "max_memory") and numeric and float(value).is_integer():
        return str(int(value))  # 5e8 in TOML or YAML is a float
    if name == "max_time" and numeric:
        return str(value)
    return value


def resolve(args: argparse.Namespace) -> TrainConfig:
    """One configuration from, in rising order: the options' and the recipe's defaults, a
    resumed run's saved config, a config file, the flags."""
    flags = options.given(args, TrainConfig)
    values: dict[str, Any] = {}
    if flags.get("resume"):
        folder = RunFolder(flags["resume"])
        folder.check_usable(resume=True)
        saved = folder.read_json(CONFIG, needs=("effective_batch",))
        values.update({k: v for k, v in saved.items() if k in _FILE_KEYS})
        values["out"] = flags["resume"]
    from_file: dict[str, Any] = {}
    problems: list[str] = []
    if flags.get("config"):
        # the file's own problems are reported with every other one, in one pass
        from_file, problems = parse_config_file(flags["config"])
        values.update(from_file)
    values.update(flags)
    given = [k for k in _LENGTH if k in flags or k in from_file]
    if flags.get("resume") and given:
        # A length given with --resume replaces the saved one, in whichever unit: a run
        # begun with --epochs continues with --steps 300.
        values.update({k: None for k in _LENGTH if k not in given})
    cfg = TrainConfig.of(**values)
    problems += cfg.problems()
    for other in ("epochs", "samples"):
        if ("steps" in flags or "steps" in from_file) and values.get(other) is not None:
            problems.append(
                f"steps and {other} (here {values[other]!r}) both given: {other} decides how "
                "long the run trains, so give one of them"
            )
    resume, out = cfg.output.resume, cfg.output.out
    if isinstance(resume, str) and isinstance(out, str) and not _same_folder(resume, out):
        problems.append(
            f"--out {out} and --resume {resume} name different folders; a resumed run stays "
            "in its folder"
        )
    if problems:
        raise ValueError(invalid_configuration(problems))
    return cfg


def _same_folder(a: str, b: str) -> bool:
    """Whether two spellings name one folder (relative or absolute, through links)."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def guard_stop(folder: Path) -> str:
    """What to do after the guard stopped a run: its last incident says why."""
    incidents = folder / INCIDENTS
    last = RunFolder(folder).lines(INCIDENTS)[-1:] if incidents.is_file() else []
    if last and last[0].get("kind") == "divergence":
        return (
            f"gradaccum: the loss diverged in the warm-up (see {incidents}); start a new run "
            "with a lower --lr (or longer --warmup-steps)"
        )
    return (
        f"gradaccum: the incident guard stopped the run (see {incidents}); to train through "
        f"it: gradaccum train --resume {folder} --no-guard"
    )


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    try:
        summary = train(cfg)
        if summary.get("stopped_by") == "guard":  # it gave up: the run did not finish
            if is_main():
                say(guard_stop(Path(summary["run_folder"])))
            return 1
    except Interrupted as stop:
        if is_main():  # every rank stops; one says so
            say(f"\n{stop}")
        return 128 + stop.signum
    finally:
        shutdown()  # leave a torchrun job's process group cleanly (no-op otherwise)
    return 0
