"""gradaccum.app.planner: one planner for `plan` and `train`: a stored plan answers, a new
one is made once and stored, --replan makes it anew, a plan of every rank never touches the
cache."""

import json

import pytest
import torch
from helpers import make_plan

from gradaccum.app.planner import Planner

SETTINGS = {"recipe": "gpt", "effective_batch": 64, "budget": 2**30}  # make_plan(64)'s budget


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "plans"))


def planner(said, **options):
    return Planner(torch.device("cpu"), SETTINGS, log=said.append, **options)


def test_a_plan_is_made_once_then_read_from_the_cache():
    made = []

    def make():
        made.append(1)
        return make_plan(64, micro=16).to_dict()

    said = []
    first = planner(said).plan(make)
    again = planner(said).plan(make)
    assert made == [1] and again == json.loads(json.dumps(first)) and again["micro_size"] == 16
    assert said[0].startswith("the plan is the cached one (") and "--replan" in said[0]
    planner(said, replan=True).plan(make)
    assert made == [1, 1]


def test_a_plan_every_rank_makes_together_never_reads_or_writes_the_cache(tmp_path):
    made = []

    def make():
        made.append(1)
        return make_plan(64, micro=8).to_dict()

    for _ in range(2):
        planner([], cached=False).plan(make)
    assert made == [1, 1] and not (tmp_path / "plans").exists()


def test_gradaccum_plan_answers_from_the_cache_before_it_builds_anything():
    """A stored plan under `gradaccum plan`'s key, which is known before the model is built,
    is the answer: nothing is measured (the stored plan is a made-up one, micro-batch 16,
    which no measurement of the recipe gives) and no fresh process is asked."""
    from gradaccum.app.config import PlanConfig
    from gradaccum.app.planner import plan_recipe, recipe_planner

    cfg = PlanConfig(recipe="gpt", effective_batch=64, budget="1GiB")
    said = []
    _, _, planner_ = recipe_planner(cfg, said.append)
    planner_.keep(make_plan(64, micro=16).to_dict())
    recipe, answer = plan_recipe(cfg, said.append)
    assert recipe.name == "gpt" and answer == make_plan(64, micro=16)
    assert len(said) == 1 and said[0].startswith("the plan is the cached one")


def test_gradaccum_plan_prefer_reaches_the_plan_and_a_bad_value_is_one_line(capsys):
    """--prefer is the PlanRequest's prefer (and so a part of the plan's cache key); a value
    that is not one is refused in one line naming it."""
    from gradaccum.app.cli import main, parser
    from gradaccum.app.cli.options import given
    from gradaccum.app.config import PlanConfig
    from gradaccum.app.planner import recipe_planner

    keys = {}
    for prefer in ("largest", "fastest"):
        args = parser().parse_args(["plan", "--budget", "1GiB", "--prefer", prefer])
        _, request, planner_ = recipe_planner(PlanConfig(**given(args, PlanConfig)), print)
        assert request.prefer == prefer
        keys[prefer] = planner_.parts
    assert keys["largest"] != keys["fastest"]
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--prefer", "quickest"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefer" in err[0] and "'quickest'" in err[0]
