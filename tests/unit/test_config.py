"""TrainConfig (gradaccum.app.config): where a recipe's own defaults are resolved, once, for
the command line, config files and Python alike."""

import dataclasses

import pytest

from gradaccum.app import TrainConfig
from gradaccum.app.cli import parser
from gradaccum.app.config import RecipeDefault
from gradaccum.app.recipes import RECIPES, minilm


def test_a_recipe_brings_its_own_defaults_to_a_configuration_made_in_python():
    cfg = TrainConfig(recipe="minilm")
    assert {k: getattr(cfg, k) for k in minilm.DEFAULTS} == minilm.DEFAULTS
    assert TrainConfig().effective_batch == 64  # gpt keeps TrainConfig's own


def test_a_value_given_wins_even_when_it_equals_the_general_default():
    assert TrainConfig(recipe="minilm", effective_batch=64).effective_batch == 64
    assert TrainConfig(recipe="minilm", lr=3e-3).lr == 3e-3


def test_a_hugging_face_model_replaces_the_recipe_and_its_defaults():
    assert TrainConfig(recipe="minilm", hf_model="some/path").effective_batch == 64


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_default_a_recipe_sets_is_one_the_configuration_resolves(name):
    resolvable = {
        f.name for f in dataclasses.fields(TrainConfig) if isinstance(f.default, RecipeDefault)
    }
    assert set(RECIPES[name].defaults) <= resolvable


def test_no_default_is_left_unresolved():
    cfg = TrainConfig(recipe="segment")
    assert not any(isinstance(v, RecipeDefault) for v in dataclasses.asdict(cfg).values())


def test_help_says_the_recipe_may_set_its_own(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["train", "--help"])
    assert "(default: 64, or the recipe's own)" in " ".join(capsys.readouterr().out.split())
