"""gradaccum.app.config: options declared once, sections, one resolver of recipe defaults, and
every problem of type or value in one pass."""

import dataclasses

import pytest

from gradaccum.app import TrainConfig
from gradaccum.app.cli import parser
from gradaccum.app.cli.train import resolve
from gradaccum.app.config import (
    OPTION_SECTION,
    SECTIONS,
    CheckConfig,
    PlanConfig,
    RecipeDefault,
    read_config_file,
)
from gradaccum.app.recipes import RECIPES, minilm


def test_a_recipe_brings_its_own_defaults_to_a_configuration_made_in_python():
    cfg = TrainConfig.of(recipe="minilm")
    assert {k: cfg.flat()[k] for k in minilm.DEFAULTS} == minilm.DEFAULTS
    assert TrainConfig.of().batch.effective_batch == 64  # gpt keeps the option's own


def test_sections_made_directly_resolve_the_same_defaults():
    from gradaccum.app.config import Source

    made = TrainConfig(source=Source(recipe="minilm"))
    assert made.flat() == TrainConfig.of(recipe="minilm").flat()


def test_a_value_given_wins_even_when_it_equals_the_general_default():
    assert TrainConfig.of(recipe="minilm", effective_batch=64).batch.effective_batch == 64
    assert TrainConfig.of(recipe="minilm", lr=3e-3).schedule.lr == 3e-3


def test_a_hugging_face_model_replaces_the_recipe_and_its_defaults():
    assert TrainConfig.of(recipe="minilm", hf_model="some/path").batch.effective_batch == 64


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_default_a_recipe_sets_is_one_the_configuration_resolves(name):
    resolvable = {
        f.name
        for cls in SECTIONS.values()
        for f in dataclasses.fields(cls)
        if isinstance(f.default, RecipeDefault)
    }
    assert set(RECIPES[name].defaults) <= resolvable


def test_no_default_is_left_unresolved():
    for cfg in (TrainConfig.of(recipe="segment"), PlanConfig(recipe="segment")):
        values = cfg.flat() if isinstance(cfg, TrainConfig) else dataclasses.asdict(cfg)
        assert not any(isinstance(v, RecipeDefault) for v in values.values())


def test_plan_and_train_share_their_options_and_defaults():
    """One flag, one default: what `gradaccum plan --recipe minilm` plans for is what `gradaccum
    train --recipe minilm` trains (0.5's plan defaulted to 256 samples in 2GiB, train to 64
    in 512MB)."""
    for recipe in sorted(RECIPES):
        planned, trained = PlanConfig(recipe=recipe), TrainConfig.of(recipe=recipe).flat()
        for name in ("effective_batch", "budget", "margin", "meter", "checkpointing", "seed"):
            assert getattr(planned, name) == trained[name], (recipe, name)
    plan_fields = {f.name: f for f in dataclasses.fields(PlanConfig)}
    check_fields = {f.name: f for f in dataclasses.fields(CheckConfig)}
    for name, section in OPTION_SECTION.items():
        train_field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
        for other in (plan_fields, check_fields):
            if name == "lora" and other is plan_fields:
                # plan's --lora also takes a PEFT adapter_config.json (the estimate's LoRA as
                # users configure it); train's is the rank apply_lora takes
                assert plan_fields["lora"].metadata["opt"].check("16") is None
                continue
            if name == "precision" and other is plan_fields:
                # plan's --precision also takes bf16-true (the estimate's alone): train's
                # choices and default, and that one more
                opt, trains = plan_fields["precision"].metadata["opt"], train_field.metadata["opt"]
                assert opt.default == trains.default
                assert tuple(opt.choices) == (*trains.choices, "bf16-true")
                continue
            if name in other:  # the same declaration, so the same check and choices
                assert other[name].metadata["opt"] is train_field.metadata["opt"], name


def test_every_problem_of_type_and_value_comes_in_one_list():
    problems = TrainConfig.of(
        effective_batch="many", lr=-1.0, budget="lots", shard="zero", seed=True
    ).problems()
    assert problems == [
        "seed must be int, got True",
        "effective_batch must be int, got 'many'",
        "budget: cannot read 'lots' as a memory size; give bytes (2000000000) or a number "
        "with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of "
        "1024), e.g. 2GiB or 1500MB",
        "lr must be a positive finite number, got -1.0",
        "shard must be one of ddp, fsdp, got 'zero'",
    ]


def test_checks_between_options_run_once_the_types_are_right():
    cfg = TrainConfig.of(micro_batch=100, effective_batch=64, merge_lora=True)
    assert cfg.problems() == [
        "micro_batch 100 is larger than effective_batch 64",
        "merge_lora needs --lora R",
    ]


def test_resumable_options_are_marked_where_they_are_declared():
    from gradaccum.app.config import RESUMABLE

    assert "steps" in RESUMABLE and "guard" in RESUMABLE
    assert "effective_batch" not in RESUMABLE and "lr" not in RESUMABLE


def test_a_config_file_takes_flat_keys_or_sections(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text("effective-batch = 32\nbudget = 3e8\nlr = 1e-3\n")
    nested = tmp_path / "nested.toml"
    nested.write_text(
        "[batch]\neffective_batch = 32\n[memory]\nbudget = 3e8\n[schedule]\nlr = 1e-3\n"
    )
    assert (
        read_config_file(str(flat))
        == read_config_file(str(nested))
        == {
            "effective_batch": 32,
            "budget": "300000000",
            "lr": 1e-3,
        }
    )
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[memory]\neffective_batch = 32\n")
    belongs = r"\[memory\] effective_batch \(it belongs under \[batch\]\)"
    with pytest.raises(ValueError, match=belongs):
        read_config_file(str(wrong))
    twice = tmp_path / "twice.toml"
    twice.write_text("lr = 1e-3\n[schedule]\nlr = 2e-3\n")
    with pytest.raises(ValueError, match=r"given twice: lr and \[schedule\] lr"):
        read_config_file(str(twice))


def test_a_file_value_of_the_wrong_type_is_reported_with_the_flags_problems(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("steps: five\n")
    args = parser().parse_args(["train", "--config", str(file), "--lr", "0"])
    with pytest.raises(ValueError) as err:
        resolve(args)
    assert "steps must be int, got 'five'" in str(err.value)
    assert "lr must be a positive finite number, got 0.0" in str(err.value)


def test_help_groups_options_by_section_and_says_the_recipe_may_set_its_own(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 64, or the recipe's own)" in out
    assert "memory: the memory budget the micro-batch is planned for" in out
    assert out.index("--effective-batch") < out.index("--budget") < out.index("--lr")


def test_check_takes_micro_batch_and_its_old_spelling():
    new = parser().parse_args(["check", "--micro-batch", "2"])
    old = parser().parse_args(["check", "--micro-size", "2"])
    assert new.micro_batch == old.micro_batch == 2
    assert CheckConfig(batch=4, micro_batch=4).problems() == [
        "micro_batch 4 must be smaller than batch 4: the check compares several micro-batches "
        "against the whole batch"
    ]


@pytest.mark.parametrize(
    "saved, flag, want",
    [
        ({"epochs": 2.0}, ["--steps", "300"], (300, None, None)),
        ({"steps": 40}, ["--samples", "5000"], (None, None, 5000)),
        ({"samples": 800}, ["--epochs", "3"], (None, 3.0, None)),
    ],
)
def test_a_length_given_with_resume_replaces_the_saved_one_in_any_unit(tmp_path, saved, flag, want):
    """docs/cli.md's `--resume RUN --steps 300`, for a run begun with --epochs: refused as
    "steps and epochs both given" before."""
    import json

    begun = TrainConfig.of(recipe="digits", **saved).flat()
    (tmp_path / "config.json").write_text(json.dumps(begun))
    cfg = resolve(parser().parse_args(["train", "--resume", str(tmp_path), *flag]))
    assert (cfg.schedule.steps, cfg.schedule.epochs, cfg.schedule.samples) == want


def test_a_mistyped_or_foreign_config_key_is_answered_with_the_nearest_option(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text("efective-batch = 16\nlearning_rate = 0.1\nzzz = 1\n")
    with pytest.raises(ValueError) as err:
        read_config_file(str(file))
    said = str(err.value)
    assert "efective-batch (did you mean effective-batch?)" in said
    assert "learning_rate (did you mean lr?)" in said and "zzz;" in said


def test_a_negative_size_is_a_value_refused_with_its_reason():
    """argparse took -5MB for a flag ("expected one argument")."""
    args = parser().parse_args(["train", "--budget", "-5MB", "--max-memory", "-1GB"])
    problems = TrainConfig.of(budget=args.budget).problems()
    assert problems == ["budget: a memory size must be positive, got '-5MB'"]
    assert args.max_memory == "-1GB"


def problem_of(path, *flags):
    """The one ValueError `gradaccum train --config PATH FLAGS` is refused with, resolved in
    process as the command resolves it."""
    with pytest.raises(ValueError) as err:
        resolve(parser().parse_args(["train", "--config", str(path), *map(str, flags)]))
    return str(err.value)


def test_resume_and_config_in_a_config_file_are_refused_as_flags_only(tmp_path):
    """docs/cli.md: they cannot be set from a file (both were taken before)."""
    file = tmp_path / "c.toml"
    file.write_text('resume = "runs/old"\n[output]\nconfig = "other.toml"\n')
    with pytest.raises(ValueError) as err:
        read_config_file(str(file))
    said = str(err.value)
    assert f"--config {file}: resume cannot be set in a config file: it is a flag only " in said
    assert "(--resume DIR)" in said and "[output] config cannot be set in a config file" in said
    assert "(--config FILE)" in said


def test_resume_and_out_naming_one_folder_two_ways_are_one_folder(tmp_path, monkeypatch):
    """`--resume cfgres2 --out /abs/path/cfgres2` was refused as "different folders"."""
    import json

    run = tmp_path / "cfgres2"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(TrainConfig.of(recipe="digits").flat()))
    monkeypatch.chdir(tmp_path)
    for out in (run, "./cfgres2/", tmp_path / "x" / ".." / "cfgres2"):
        cfg = resolve(parser().parse_args(["train", "--resume", "cfgres2", "--out", str(out)]))
        assert cfg.output.resume == "cfgres2"
    with pytest.raises(ValueError, match=r"--out other and --resume cfgres2 name different"):
        resolve(parser().parse_args(["train", "--resume", "cfgres2", "--out", "other"]))


def test_a_binary_config_file_is_named_and_said_not_to_be_text(tmp_path):
    file = tmp_path / "c.toml"
    file.write_bytes(b"steps = 2\n\xc2\x00\xff\n")
    with pytest.raises(ValueError) as err:
        read_config_file(str(file))
    assert str(err.value) == (
        f"--config {file}: not UTF-8 text (byte 0xc2 at offset 10); a config file is TOML or "
        "YAML text"
    )


def test_every_problem_of_a_config_file_comes_in_one_error(tmp_path):
    """Unknown keys, a flag-only key, a section as a value, a wrong type and a bad value, in
    the file and in the flags: all in one message (steps = 1.5 came only after the others
    were fixed)."""
    for suffix, text in (
        (".toml", 'zzz = 1\nbatch = 5\nresume = "r"\nsteps = 1.5\nlr = -1.0\n'),
        (".yaml", "zzz: 1\nbatch: 5\nresume: r\nsteps: 1.5\nlr: -1.0\n"),
    ):
        file = tmp_path / f"c{suffix}"
        file.write_text(text)
        said = problem_of(file, "--seed", -1)
        assert said.startswith("invalid configuration:\n  - "), said
        for part in (
            "unknown option zzz;",
            "batch is a section (a table), not an option",
            "resume cannot be set in a config file",
            "steps must be int, got 1.5",
            "lr must be a positive finite number, got -1.0",
            "seed must be an integer >= 0, got -1",
        ):
            assert said.count(part) == 1, (part, said)


def test_a_section_given_a_value_is_said_to_be_a_section_with_its_form(tmp_path):
    """`batch = 5` was answered "did you mean micro-batch?"."""
    toml, yaml = tmp_path / "c.toml", tmp_path / "c.yaml"
    toml.write_text("batch = 5\n")
    yaml.write_text("memory: 2GB\n")
    with pytest.raises(ValueError) as err:
        read_config_file(str(toml))
    said = str(err.value)
    assert "batch is a section (a table), not an option; write `[batch]` then " in said
    assert "`effective_batch = ...`" in said and "did you mean" not in said
    with pytest.raises(ValueError) as err:
        read_config_file(str(yaml))
    said = str(err.value)
    assert "memory is a section (a table), not an option; write `memory:` then " in said
    assert "`  budget: ...`" in said and "did you mean" not in said


def test_a_folder_given_as_the_config_file_is_said_to_be_a_folder(tmp_path):
    folder = tmp_path / "configs.toml"
    folder.mkdir()
    with pytest.raises(ValueError) as err:
        read_config_file(str(folder))
    assert str(err.value) == (
        f"--config {folder}: is a directory; --config takes a file (.toml, .yaml or .yml)"
    )
    with pytest.raises(ValueError, match="no such file"):
        read_config_file(str(tmp_path / "missing.toml"))


def test_the_commands_configuration_problems_name_flags_and_a_files_problems_its_keys():
    """On the command line an option is its flag: a problem names ``--micro-batch``, not the
    field ``micro_batch``; a word like "steps" inside a sentence stays a word, and a config
    file's own problems keep the file's keys."""
    from gradaccum.app.config import invalid_configuration

    cfg = TrainConfig.of(micro_batch=100, effective_batch=64, merge_lora=True, budget="200")
    said = invalid_configuration(cfg.problems())
    assert said.splitlines()[1:] == [
        "  - --budget: 200 has no unit, so it is 200 bytes; did you mean 200MB?",
        "  - --micro-batch 100 is larger than --effective-batch 64",
        "  - --merge-lora needs --lora R",
    ], said
    file = "--config run.toml: unknown option [memory] effective_batch (it belongs under [batch])"
    assert invalid_configuration([file]) == f"invalid configuration: {file}"
    sentence = "--out a and --resume b name different folders; a resumed run stays in its folder"
    assert invalid_configuration([sentence]).endswith(sentence)
