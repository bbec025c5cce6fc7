"""The plan's fresh process (gradaccum.app.measure): its run in miniature evaluates through
the arithmetic the run's evaluation runs, on the sample."""

import math

import pytest
import torch

from gradaccum.app.measure import recipe_evaluation
from gradaccum.app.recipes import get_recipe


def test_a_language_model_is_evaluated_by_its_held_out_loss_on_the_sample():
    recipe = get_recipe("gpt")
    torch.manual_seed(0)
    model = recipe.build_model().train()
    batch = recipe.sample_batch(3)  # fewer than two micro-batches of 2: rows repeated
    got = recipe_evaluation(recipe, 0, batch, 2)(model)
    assert model.training  # as it was
    # torch alone: next-token cross-entropy per predicted byte over the 4 sequences
    ids = torch.cat([batch["input_ids"], batch["input_ids"][:1]])
    model.eval()
    with torch.no_grad():
        logits = model(ids)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    assert math.isclose(got["loss"], float(expected), rel_tol=1e-5)


@pytest.mark.parametrize("name", ["digits", pytest.param("minilm", marks=pytest.mark.slow)])
def test_a_recipe_with_its_own_evaluation_runs_it_on_the_sample(name):
    """digits and minilm: the recipe's evaluate on two micro-batches of the sample, equal to
    a torch-alone cross-entropy and accuracy over them; the model left in training mode."""
    recipe = get_recipe(name)
    torch.manual_seed(0)
    model = recipe.build_model()
    model.train()
    batch = recipe.sample_batch(4)
    got = recipe_evaluation(recipe, 0, batch, 2)(model)
    assert model.training
    model.eval()
    with torch.no_grad():
        if name == "digits":
            x, y = batch
            logits = model(x)
        else:
            logits = model(batch["input_ids"], batch["attention_mask"])
            y = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits, y)
    assert math.isclose(got["loss"], float(loss), rel_tol=1e-5)
    assert got["accuracy"] == float((logits.argmax(1) == y).float().mean())


def test_a_recipe_without_one_evaluates_its_data():
    recipe = get_recipe("segment")
    assert recipe.logits is None and recipe.evaluate is None
    torch.manual_seed(0)
    model = recipe.build_model()
    got = recipe_evaluation(recipe, 0, recipe.sample_batch(2), 1)(model)
    data = recipe.make_data(0)
    assert got == data.evaluate(model, 1, limit=2)


def test_the_run_in_miniature_goes_on_until_its_peak_stops_climbing():
    """The fresh process's windows, evaluation and checkpoint repeat until the peak settles:
    a climb that one cycle, or two, would have missed (the resident set of digits' windows
    rising over five cycles, as a run of 6 steps with 3 evaluations saw) keeps it going."""
    from gradaccum.app.measure import settled

    mib = 2**20
    climb = [int(x * mib) for x in (37.8, 39.8, 41.7, 41.8, 41.8, 41.8)]
    stops = next(n for n in range(1, len(climb) + 1) if settled(climb[:n]))
    assert stops == 5 and climb[stops - 1] == max(climb)
    assert not settled(climb[:2])  # never fewer than three cycles
    assert settled([40 * mib] * 3)
