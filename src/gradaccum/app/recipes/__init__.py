"""Built-in models and data for the CLI and the examples; nothing is downloaded.

A recipe names a model, its loss in the ``(loss_sum, count)`` form, a sample batch at the
largest shape the model will see (what the planner measures), and its data: a stream of
samples in which sample ``i`` is a pure function of ``(seed, i)``. A run's data position is
the number of samples it has read, whatever size its windows had, so a resumed run reads
exactly what an uninterrupted one would, under a changing batch size too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from gradaccum.app.recipes.base import Recipe, TaskData, epoch_order, held_out_loss
from gradaccum.batching import split
from gradaccum.loss import causal_lm_loss, sample_mean

__all__ = [
    "GPT_SHAPE",
    "RECIPES",
    "Recipe",
    "TaskData",
    "epoch_order",
    "get_recipe",
    "held_out_loss",
    "HF_SIZES",
    "hf_config_file",
    "hf_config_problems",
    "hf_recipe",
]


# -- byte-level GPT on the standard library's source -------------------------------------------

_GPT = {"max_len": 128, "d_model": 128, "n_heads": 4, "n_layers": 4}
GPT_SHAPE = _GPT  # the built-in GPT's shape, for what depends on it (pipeline stages)


def _gpt_model() -> torch.nn.Module:
    from gradaccum.app.recipes.gpt import GPT, GPTConfig

    return GPT(GPTConfig(**_GPT))


def _gpt_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]):
    return causal_lm_loss(model(mb["input_ids"]), mb["labels"])


def _gpt_sample(n: int) -> dict[str, torch.Tensor]:
    from gradaccum.app.recipes.stdlib_text import corpus_bytes, full_length_batch

    return full_length_batch(corpus_bytes(), n, _GPT["max_len"], seed=0)


_BLOCK = 1024  # samples drawn together in TextData's stream


class TextData:
    """Random full-length windows of a byte (or token) stream; the last 10% is held out."""

    def __init__(
        self,
        ids: torch.Tensor,
        length: int,
        seed: int,
        logits: Callable | None = None,
        eval_sequences: int = 32,
    ) -> None:
        cut = int(len(ids) * 0.9)
        self.train, self.held_out = ids[:cut], ids[cut:]
        self.length, self.seed = length, seed
        self.logits = logits or (lambda model, x: model(x))
        if len(self.held_out) < length * 2 or len(self.train) < length * 2:
            raise ValueError(f"corpus of {len(ids)} tokens is too short for length {length}")
        starts = torch.linspace(0, len(self.held_out) - length - 1, eval_sequences).long()
        self.eval_ids = torch.stack([self.held_out[s : s + length] for s in starts.tolist()])

    def batch(self, position: int, size: int) -> dict[str, torch.Tensor]:
        # Sample i's start is drawn in blocks of _BLOCK seeded by (seed, i // _BLOCK): the
        # stream does not depend on how it is cut into windows.
        first, last = position // _BLOCK, (position + size - 1) // _BLOCK
        starts = torch.cat(
            [
                torch.randint(
                    0,
                    len(self.train) - self.length,
                    (_BLOCK,),
                    generator=torch.Generator().manual_seed(self.seed * 1_000_003 + block),
                )
                for block in range(first, last + 1)
            ]
        )[position - first * _BLOCK :][:size]
        ids = torch.stack([self.train[s : s + self.length] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids.clone()}

    def epoch_samples(self) -> int:
        return max(1, math.ceil(len(self.train) / (self.length - 1)))

    def evaluate(
        self, model: torch.nn.Module, micro_size: int, limit: int | None = None
    ) -> dict[str, float]:
        ids = self.eval_ids[:limit]
        return held_out_loss(model, self.logits, ids, ids, micro_size)


def _byte_encoder(max_len: int):
    from gradaccum.app.recipes.userdata import byte_encoder

    return byte_encoder(max_len)


def _gpt_data(seed: int) -> TextData:
    from gradaccum.app.recipes.stdlib_text import corpus_bytes

    ids = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    return TextData(ids, _GPT["max_len"], seed)


# -- a GroupNorm CNN on scikit-learn's bundled digits -------------------------------------------


class DigitsCNN(torch.nn.Module):
    """8x8 digit images; GroupNorm, so the accumulated step equals the large batch's."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.GroupNorm(8, 32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2),
            nn.GroupNorm(8, 64),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.GroupNorm(8, 64),
            nn.ReLU(),
        )
        self.head = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _digits_loss(model: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]):
    x, y = mb
    return sample_mean(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))


def _load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ValueError(
            "the digits recipe needs scikit-learn (its bundled digits are the data): "
            "pip install 'gradaccum[digits]'"
        ) from err
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.long)


class DigitsData:
    """1797 images: a fixed 20% held out; each epoch a fresh permutation of the rest."""

    def __init__(self, seed: int) -> None:
        x, y = _load_digits()
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
        cut = int(len(y) * 0.8)
        self.x, self.y = x[order[:cut]], y[order[:cut]]
        self.test_x, self.test_y = x[order[cut:]], y[order[cut:]]
        self.seed = seed

    def epoch_samples(self) -> int:
        return len(self.y)

    def batch(self, position: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = epoch_order(len(self.y), self.seed, position, size)
        return self.x[chosen], self.y[chosen]

    def evaluate(
        self, model: torch.nn.Module, micro_size: int, limit: int | None = None
    ) -> dict[str, float]:
        return _digits_evaluate(model, (self.test_x[:limit], self.test_y[:limit]), micro_size)


@torch.no_grad()
def _digits_evaluate(
    model: torch.nn.Module, held: tuple[torch.Tensor, torch.Tensor], micro_size: int
) -> dict[str, float]:
    was_training = model.training
    model.eval()
    total, correct = 0.0, 0
    for x, y in split(held, micro_size):
        logits = model(x)
        total += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    model.train(was_training)
    n = len(held[1])
    return {"loss": total / n, "accuracy": correct / n}


# -- any Hugging Face causal LM from a local directory or config file ---------------------------


_CONFIG_LARGEST = 4 << 20  # bytes: a model's config.json is kilobytes
_BOM = (
    "{file} starts with a byte-order mark (BOM, as some Windows editors save UTF-8), which "
    "transformers' JSON reader refuses: save it as UTF-8 without a BOM"
)
# a config's sizes: each an integer >= 1 where given (None: the model's default)
HF_SIZES = (
    "num_hidden_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "d_model",
    "num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "intermediate_size",
    "n_inner", "vocab_size", "max_position_embeddings", "n_positions", "n_ctx", "head_dim",
    "image_size", "patch_size", "num_channels", "num_labels",
)  # fmt: skip


def hf_config_problems(config_file: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """A model's config.json read as every command reads it, and every problem that would
    otherwise end deep inside transformers: a file too large to be a config (never read
    whole), one that is not a regular file (a FIFO is never opened for a read that waits),
    not JSON, without ``model_type``, with sizes that are not integers >= 1, each named.
    Returns (the JSON object or None, the problems)."""
    from gradaccum.app.plan_cache import read_text

    try:
        text = read_text(config_file, _CONFIG_LARGEST)
    except ValueError as err:
        return None, [f"{config_file} {err}"]
    if text is None:
        return None, [f"{config_file} does not exist"]
    if text.startswith("\ufeff"):
        return None, [_BOM.format(file=config_file)]
    try:
        data = json.loads(text)
    except ValueError as err:
        return None, [f"{config_file} is not a model configuration JSON ({err})"]
    if not isinstance(data, dict):
        return None, [f"{config_file} is not a model configuration (a JSON object)"]
    out = []
    if not isinstance(data.get("model_type"), str) or not data.get("model_type"):
        out.append(f"{config_file} has no model_type (llama, gpt2, qwen2, ...): it names the model")
    for name in HF_SIZES:
        value = data.get(name)
        if value is not None and (type(value) is not int or value < 1):
            out.append(f"{config_file}: {name} must be an integer >= 1, got {value!r}")
    return data, out


def hf_config_file(path: Any) -> Any:
    """The config.json of a Hugging Face model folder, or ``path`` itself when it is a file."""
    from pathlib import Path

    source = Path(path)
    return source / "config.json" if source.is_dir() else source


def hf_recipe(path: str, build_check: bool = True) -> Recipe:
    """A ``transformers`` causal LM from a local directory (weights, or a config.json only:
    random init) or a config JSON file; never the hub, and never the folder's own code: a
    config.json or tokenizer_config.json with ``auto_map`` is refused before transformers
    reads anything, and every load passes ``trust_remote_code=False``. Data: the stdlib
    corpus, tokenized with the directory's tokenizer when it has one, else bytes modulo the
    vocabulary. ``build_check``: a causal LM is built from the config on the meta device
    first, so that what transformers cannot build is one line now, not a traceback later
    (the memory estimate, which builds the config's own head, checks its own)."""
    from pathlib import Path

    source = Path(path)
    if not source.exists():
        raise ValueError(f"--hf-model {path}: no such file or directory")
    config_file = hf_config_file(source)
    if not config_file.is_file():
        raise ValueError(
            f"--hf-model {path}: no config.json in that folder, so it is not a Hugging Face "
            "model folder (models are read from local files only, never the hub)"
        )
    raw, problems = hf_config_problems(config_file)
    if problems:
        raise ValueError(f"--hf-model {path}: " + "; ".join(problems))
    _refuse_custom_code(path, config_file, raw)
    tokenizer_config = source / "tokenizer_config.json"
    for name in ("tokenizer_config.json", "tokenizer.json"):  # the JSON files a tokenizer reads
        if source.is_dir() and (source / name).is_file():
            with (source / name).open("rb") as f:
                if f.read(3) == b"\xef\xbb\xbf":
                    raise ValueError(f"--hf-model {path}: " + _BOM.format(file=source / name))
    if source.is_dir() and tokenizer_config.is_file():
        try:
            _refuse_custom_code(path, tokenizer_config, json.loads(tokenizer_config.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass  # not this check's to judge: the tokenizer's own load says what is wrong
    try:
        from gradaccum.integrations import hf_models
    except ImportError as err:
        raise ValueError("--hf-model needs transformers: pip install 'gradaccum[hf]'") from err
    try:  # transformers' own checks, and a model built from it on the meta device (no memory)
        config = hf_models.config(config_file)
        if build_check:
            with torch.device("meta"):
                hf_models.causal_lm(config)
    except Exception as err:  # noqa: BLE001 (whatever transformers raises: one line)
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        detail = " ".join(line.strip() for line in str(err).strip().splitlines()[1:2])[:200]
        usual = ("rope_scaling", "quantization_config", "id2label", "label2id", "rope_parameters",
                 "task_specific_params")  # fmt: skip
        nested = [k for k, v in raw.items() if isinstance(v, dict) and k not in usual]
        hint = f" (its nested sections: {', '.join(nested)})" if nested else ""
        raise ValueError(
            f"--hf-model {path}: transformers cannot make a causal LM of {config_file}: "
            f"{type(err).__name__}: {reason}{' ' + detail if detail else ''}{hint}"
        ) from None
    has_weights = source.is_dir() and any(
        (source / n).exists() for n in ("model.safetensors", "pytorch_model.bin")
    )
    # a multimodal config (gemma3, llava) holds the language model's sizes in its text_config
    # (read when tokens are made: an image model's config has no vocabulary to read)
    language = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_positions = (
        getattr(language, "n_positions", None) or getattr(language, "max_position_embeddings", None)
    ) or 128
    length = min(128, max_positions)

    def build() -> torch.nn.Module:
        if not has_weights:
            return hf_models.causal_lm(config)
        try:
            # By its absolute path: the model records it (config's _name_or_path), and so
            # does a LoRA adapter saved from it, which then finds its base from anywhere.
            return hf_models.causal_lm(folder=source.resolve())
        except Exception as err:
            if "weights_only" not in str(err) and "Unpickl" not in type(err).__name__:
                raise
            # transformers reads pytorch_model.bin with torch.load(weights_only=True), and
            # torch's refusal advises unpickling it: never. Say what to do instead.
            raise ValueError(
                f"--hf-model {path}: pytorch_model.bin cannot be read safely: it holds "
                "pickled objects other than tensors; convert it to model.safetensors where "
                "you trust its source (model.save_pretrained(folder, safe_serialization=True))"
            ) from None

    def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    def loss_fn(model: torch.nn.Module, mb: dict[str, torch.Tensor]):
        return causal_lm_loss(logits(model, mb["input_ids"]), mb["labels"])

    @functools.cache  # the sample batch and the data both read it: tokenize once
    def tokens() -> torch.Tensor:
        from gradaccum.app.recipes.stdlib_text import corpus_bytes

        text = corpus_bytes(400_000)
        if source.is_dir() and (source / "tokenizer.json").exists():
            tok = hf_models.tokenizer(source)
            return torch.tensor(tok(text.decode("utf-8", "replace"))["input_ids"])
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long() % language.vocab_size

    def sample(n: int) -> dict[str, torch.Tensor]:
        ids = tokens()[: n * length].reshape(n, length)
        return {"input_ids": ids, "labels": ids.clone()}

    def encoder():
        from gradaccum.app.recipes.userdata import DataError, Encoder

        if not (source.is_dir() and (source / "tokenizer.json").exists()):
            raise DataError(
                f"--data with --hf-model {path}: no tokenizer.json in that folder; save the "
                "model's tokenizer beside it (tokenizer.save_pretrained)"
            )
        tok = hf_models.tokenizer(source)
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if eos is None:
            raise DataError(f"--hf-model {path}: its tokenizer has no end-of-text token")
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        digest = hashlib.sha256((source / "tokenizer.json").read_bytes()).hexdigest()[:16]
        name = f"tokenizer.json {digest}"  # the cache key changes with the tokenizer
        encode = functools.partial(tok.encode, add_special_tokens=False)
        return Encoder(encode, eos, pad, max_positions, name)

    return Recipe(
        name="hf",
        summary=f"{config.model_type} from {path} ({'weights' if has_weights else 'random init'})",
        item="token",
        build_model=build,
        loss_fn=loss_fn,
        sample_batch=sample,
        make_data=lambda seed: TextData(tokens(), length, seed, logits=logits),
        signature={"recipe": "hf", "model_type": config.model_type},
        encoder=encoder,
        logits=logits,
    )


def _refuse_custom_code(path: str, file: Any, read: Any) -> None:
    """A model folder's JSON that names code of its own (``auto_map``: transformers'
    trust_remote_code) is refused, in one line naming the file: gradaccum runs no code that
    comes with a model."""
    if isinstance(read, dict) and "auto_map" in read:
        names = read["auto_map"]
        named = ", ".join(sorted(names)) if isinstance(names, dict) else repr(names)
        raise ValueError(
            f"--hf-model {path}: {file} has auto_map ({named}): the model needs custom code "
            "from its folder, and gradaccum never runs a model's own code "
            "(trust_remote_code=False); use a model class that transformers ships"
        )


RECIPES: dict[str, Recipe] = {
    "gpt": Recipe(
        name="gpt",
        summary="byte-level GPT (4 layers, d_model 128, 128 bytes) on the Python stdlib's source",
        item="byte",
        build_model=_gpt_model,
        loss_fn=_gpt_loss,
        sample_batch=_gpt_sample,
        make_data=_gpt_data,
        signature={"recipe": "gpt", **_GPT},
        encoder=lambda: _byte_encoder(_GPT["max_len"]),
        logits=lambda model, ids: model(ids),
    ),
    "digits": Recipe(
        name="digits",
        summary="GroupNorm CNN on scikit-learn's bundled 8x8 digits",
        item="image",
        build_model=DigitsCNN,
        loss_fn=_digits_loss,
        sample_batch=lambda n: (torch.zeros(n, 1, 8, 8), torch.zeros(n, dtype=torch.long)),
        make_data=DigitsData,
        evaluate=_digits_evaluate,
        signature={"recipe": "digits"},
        metrics=("loss", "accuracy"),
    ),
}


def _minilm() -> Recipe:
    from gradaccum.app.recipes import minilm

    return Recipe(
        name="minilm",
        item="paragraph",
        summary="pretrained all-MiniLM-L6-v2 (22.7M parameters) classifying stdlib docstring "
        f"paragraphs by package ({len(minilm.FAMILIES)} packages)",
        build_model=minilm.DocstringClassifier,
        loss_fn=minilm.loss_fn,
        sample_batch=minilm.sample_batch,
        make_data=minilm.DocstringData,
        evaluate=minilm.evaluate,
        # (samples: whole docstrings before 0.5.0; a run of those is another run)
        signature={"recipe": "minilm", "families": list(minilm.FAMILIES), "samples": "paragraphs"},
        metrics=("loss", "accuracy"),
        defaults=minilm.DEFAULTS,
    )


RECIPES["minilm"] = _minilm()


def _minilm_pairs() -> Recipe:
    from gradaccum.app.recipes import minilm, minilm_pairs

    return Recipe(
        name="minilm-pairs",
        item="pair",
        summary="pretrained all-MiniLM-L6-v2 fine-tuned contrastively on pairs of stdlib "
        "docstring paragraphs, every other pair of the batch a negative (in-batch, exact)",
        build_model=minilm_pairs.PairEncoder,
        loss_fn=minilm_pairs.LOSS,
        sample_batch=minilm_pairs.sample_batch,
        make_data=minilm_pairs.PairData,
        signature={"recipe": "minilm-pairs", "families": list(minilm.FAMILIES)},
        metrics=("loss", "accuracy"),
        defaults=minilm_pairs.DEFAULTS,
    )


RECIPES["minilm-pairs"] = _minilm_pairs()


def _segmentation(norm: str) -> Recipe:
    from gradaccum.app.recipes import segmentation

    return segmentation.segmentation_recipe(norm)


# The U-Net with GroupNorm (exact under accumulation), and the same network with BatchNorm,
# which shows what accumulation does to it (`gradaccum check --recipe segment-batchnorm`).
RECIPES["segment"] = _segmentation("group")
RECIPES["segment-batchnorm"] = _segmentation("batch")


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(sorted(RECIPES))}")
    return RECIPES[name]
