"""The --hf-model recipe read from a config.json (app/recipes/__init__.py)."""

import json

import pytest

pytest.importorskip("transformers")


def test_a_config_without_a_vocabulary_is_read_for_the_estimate(tmp_path):
    """The estimate of an image classifier reads its recipe without building a causal LM
    (build_check=False); the recipe then read the vocabulary at once, and a ViT config has
    none: 'ViTConfig' object has no attribute 'vocab_size'. The vocabulary is read when
    tokens are made, which an image model never asks for."""
    from gradaccum.app.recipes import hf_recipe

    config = {
        "model_type": "vit", "architectures": ["ViTForImageClassification"],
        "image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = hf_recipe(str(tmp_path), build_check=False)
    assert callable(recipe.loss_fn)


def test_a_multimodal_config_makes_tokens_in_its_language_models_vocabulary(tmp_path):
    """A gemma3 config holds its vocabulary in text_config: tokens are taken modulo it."""
    from gradaccum.app.recipes import hf_recipe

    config = {"model_type": "gemma3", "text_config": {
        "vocab_size": 97, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 64}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    batch = hf_recipe(str(tmp_path), build_check=False).sample_batch(2)
    assert batch["input_ids"].shape == (2, 64)
    assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < 97
