"""Hugging Face models, configurations and tokenizers read from local folders: what the
command's ``--hf-model`` and its minilm recipes load. Files only, never the hub, never a
folder's own code (``trust_remote_code=False`` throughout).

Apart from ``transformers.py`` (the Trainer integration), this is the one module that
imports transformers; it stays light (no Trainer), so loading a model does not load the
Trainer's machinery. Importing it without transformers installed raises ImportError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

__all__ = ["TASKS", "adafactor", "bert_encoder", "causal_lm", "config", "for_task", "tokenizer"]

# a task head by the Auto class that builds it from a configuration
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "image-classification": "AutoModelForImageClassification",
}


def config(path: str | Path) -> Any:
    """The configuration in ``path`` (a folder or a config.json); OSError or ValueError when
    it is not one."""
    return transformers.AutoConfig.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=False
    )


def causal_lm(model_config: Any = None, folder: str | Path | None = None) -> Any:
    """A causal LM: from ``folder``'s weights when given, else freshly initialised from
    ``model_config``."""
    auto = transformers.AutoModelForCausalLM
    if folder is None:
        return auto.from_config(model_config, trust_remote_code=False)
    return auto.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def for_task(model_config: Any, task: str, attn_implementation: str | None = None) -> Any:
    """A model with ``task``'s head (a key of ``TASKS``), freshly initialised from
    ``model_config``; ``attn_implementation`` as transformers names it (None: its choice)."""
    auto = getattr(transformers, TASKS[task])
    how = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return auto.from_config(model_config, trust_remote_code=False, **how)


def adafactor(params: Any, **kwargs: Any) -> Any:
    """transformers' Adafactor over ``params``."""
    from transformers.optimization import Adafactor

    return Adafactor(params, **kwargs)


def tokenizer(folder: str | Path) -> Any:
    """The folder's tokenizer, from its files alone, none of its code."""
    return transformers.AutoTokenizer.from_pretrained(
        str(folder), local_files_only=True, trust_remote_code=False
    )


def bert_encoder(folder: str | Path, **kwargs: Any) -> Any:
    """``BertModel`` from ``folder`` (``kwargs`` to ``from_pretrained``, e.g.
    ``add_pooling_layer=False``), with transformers' loading report and progress bar kept
    off the terminal while it loads."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        return transformers.BertModel.from_pretrained(str(folder), local_files_only=True, **kwargs)
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()
