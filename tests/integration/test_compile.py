"""torch.compile under gradaccum: a compiled model's accumulated gradient against the eager
full batch computed with torch alone, the number of graphs torch compiles over epochs whose
windows end ragged, and `gradaccum train --compile`.

Compiling takes most of a minute on 2 cores: the slow tier. Inductor's cache is private to
each test (TORCHINDUCTOR_CACHE_DIR), so a warm cache from an earlier run hides nothing."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import capture_step_grads, cli, rel_err

import gradaccum as ga

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def private_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TinyLM(torch.nn.Module):
    """Embedding, a causal self-attention layer, an MLP and a head over 32 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.layer(self.embed(ids), src_mask=mask, is_causal=True))


def token_loss(model, batch):
    """Summed cross-entropy over the tokens whose label is not -100, and their count."""
    logits = model(batch["ids"])
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss, (labels != -100).sum()


def data(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n, 12), generator=g)
    labels = ids.roll(-1, dims=1)
    lengths = torch.randint(3, 13, (n,), generator=g)  # padded rows: uneven token counts
    labels[torch.arange(12) >= lengths[:, None]] = -100
    return {"ids": ids, "labels": labels}


def test_a_compiled_model_is_exact_and_compiles_twice_over_epochs_of_ragged_windows():
    """Two epochs of 42 sequences in windows of 16 as micro-batches of 6 (6, 6, 4 and a last
    window of 6, 4): every window's gradient, through torch.compile's default backend, within
    1e-6 of the same window as one eager batch with torch alone (token-weighted); torch
    compiles two graphs (micro-batches of 6, then 4 with the batch dimension dynamic) and
    never again."""
    torch.manual_seed(0)
    model = TinyLM()
    reference = TinyLM()
    reference.load_state_dict(model.state_dict())
    shapes: list[tuple[int, ...]] = []

    def counting(gm, example_inputs):  # the default backend, counting what it compiles
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2]
        shapes.append(tuple(tensors[0].shape) if tensors else ())
        return torch._inductor.compile(gm, example_inputs)

    forward = torch.compile(model, backend=counting)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: compare each
    seen = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(model, optimizer)
    batch = data(42)
    for _epoch in range(2):
        for start in range(0, 42, 16):
            window = {k: v[start : start + 16] for k, v in batch.items()}
            result = acc.step(ga.split(window, 6), lambda _m, mb: token_loss(forward, mb))
            assert result.stepped
            reference.zero_grad()
            loss, count = token_loss(reference, window)
            (loss / count).backward()
            for name, want in reference.named_parameters():
                err = rel_err(seen[-1][name], want.grad)
                assert err <= 1e-6, (name, err)
    assert len(shapes) == 2, shapes


def test_train_compile_matches_the_eager_run_and_checkpoints_the_models_own_keys(tmp_path):
    """`gradaccum train --compile` on digits, 3 steps with a ragged epoch end: its losses
    within 1e-5 of the same run eager, its checkpoint's keys the model's own (no
    torch.compile wrapper prefix), so a resume without --compile reads it."""
    common = ["train", "--recipe", "digits", "--steps", "3", "--effective-batch", "600",
              "--micro-batch", "256", "--no-noise-scale", "--eval-every", "3"]  # fmt: skip
    cli(*common, "--out", tmp_path / "eager")  # (the cache folder: the fixture's, inherited)
    out = cli(*common, "--compile", "--out", tmp_path / "compiled")
    assert "--compile" in out.stdout + out.stderr

    def losses(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in lines if "loss" in json.loads(x)]

    eager, compiled = losses("eager"), losses("compiled")
    assert len(eager) == len(compiled) == 3
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (eager, compiled)

    def keys(tree) -> list[str]:
        if not isinstance(tree, dict):
            return []
        return [k for k in tree if isinstance(k, str)] + [x for v in tree.values() for x in keys(v)]

    state = torch.load(tmp_path / "compiled" / "checkpoint.pt", weights_only=True)
    names = keys(state)
    assert any(k.endswith(".weight") for k in names)  # the model's tensors are in it
    assert not any("_orig_mod" in k for k in names), [k for k in names if "_orig_mod" in k][:3]
    cli(*common[:3], "--steps", "4", "--resume", tmp_path / "compiled")


def test_the_transformers_trainer_with_torch_compile_is_exact(tmp_path):
    """gradaccum's Trainer with TrainingArguments(torch_compile=True): 28 padded sequences in
    windows of 4 micro-batches of 4 (the last window 3), every window's gradient within 1e-6
    of its 16 (or 12) sequences as one eager batch."""
    pytest.importorskip("transformers")
    import copy

    from frameworks import full_batch_grads, padded_sequences, rel_err, tiny_gpt2, trainer_arguments

    from gradaccum.integrations.transformers import Trainer

    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    items = padded_sequences(28)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    trainer = Trainer(
        model=model,
        args=trainer_arguments(tmp_path, torch_compile=True),
        train_dataset=items,
        optimizers=(optimizer, None),
    )
    trainer.train()
    assert hasattr(trainer.model_wrapped, "_orig_mod")  # torch.compile's module ran
    assert len(seen) == 2
    for w, grads in enumerate(seen):
        want = full_batch_grads(reference, items[16 * w : 16 * w + 16])
        assert rel_err(grads, want) <= 1e-6, w


def test_the_lightning_callback_with_a_compiled_model_is_exact():
    """ExactAccumulation over a LightningModule whose model is torch.compile'd: 28 padded
    sequences in windows of 4 micro-batches of 4, each window within 1e-6 of its sequences as
    one eager batch."""
    pytest.importorskip("lightning")
    import copy

    from frameworks import full_batch_grads, padded_sequences, rel_err, tiny_gpt2
    from test_lightning_callback import LM, fit

    from gradaccum.integrations.lightning import ExactAccumulation

    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    items = padded_sequences(28)
    module = LM(torch.compile(model), exact=True)
    fit(module, items, [ExactAccumulation()])
    # the compiled wrapper's names for the model's parameters start "_orig_mod."
    seen = [{k.removeprefix("_orig_mod."): v for k, v in g.items()} for g in module.optimizer.seen]
    assert len(seen) == 2
    for w, grads in enumerate(seen):
        want = full_batch_grads(reference, items[16 * w : 16 * w + 16])
        assert rel_err(grads, want) <= 1e-6, w
