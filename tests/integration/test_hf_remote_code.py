"""--hf-model never runs a model folder's own code: a folder whose config.json or
tokenizer_config.json has ``auto_map`` (custom code, transformers' trust_remote_code) is
refused in one line naming auto_map and the file, exit status 2, before transformers is
asked anything: no "Do you wish to run the custom code? [y/N]" prompt, even with "y" waiting
on stdin, and the folder's Python files are never imported (each would leave a marker file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from gradaccum.app.recipes import hf_recipe

pytest.importorskip("transformers")

GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256}


def custom_code_folder(root, config, tokenizer_config=None):
    """A model folder under ``root`` whose Python files, if ever imported, write
    ``root/imported``."""
    folder = root / "custom"
    folder.mkdir(parents=True)
    marker = root / "imported"
    for module in ("configuration_x", "modeling_x", "tokenization_x"):
        (folder / f"{module}.py").write_text(
            f"from pathlib import Path\nPath({str(marker)!r}).write_text({module!r})\n"
        )
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder, marker


CUSTOM = {  # a model type transformers does not know, its code in the folder
    "model_type": "x-custom",
    "auto_map": {
        "AutoConfig": "configuration_x.XConfig",
        "AutoModelForCausalLM": "modeling_x.XForCausalLM",
    },
    "vocab_size": 256,
}


@pytest.mark.parametrize("command", ["train", "check"])
def test_a_folder_with_auto_map_is_refused_in_one_line_and_its_code_never_runs(tmp_path, command):
    folder, marker = custom_code_folder(tmp_path, CUSTOM)
    args = [command, "--hf-model", str(folder)]
    if command == "train":
        args += ["--steps", "1", "--out", str(tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", *args],
        input="y\n",  # what a prompt would take as consent
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert "Do you wish" not in said and "[y/N]" not in said, said
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, said
    assert "auto_map" in lines[0] and str(folder / "config.json") in lines[0], lines
    assert not marker.exists(), f"the folder's {marker.read_text()}.py was imported"
    assert not (tmp_path / "run").exists()


def test_auto_map_in_a_known_model_or_its_tokenizer_config_is_refused_too(tmp_path):
    """A GPT-2 config (a class transformers ships) whose auto_map points the causal LM at the
    folder's code, and a clean config whose tokenizer_config.json has auto_map: each refused
    by name, in process, and nothing imported."""
    mapped = {**GPT2, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    folder, marker = custom_code_folder(tmp_path / "a", mapped)
    with pytest.raises(ValueError) as err:
        hf_recipe(str(folder))
    assert "auto_map" in str(err.value) and str(folder / "config.json") in str(err.value)
    tokenizer = {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}
    other, marker_b = custom_code_folder(tmp_path / "b", GPT2, tokenizer)
    with pytest.raises(ValueError) as err:
        hf_recipe(str(other))
    assert "auto_map" in str(err.value) and str(other / "tokenizer_config.json") in str(err.value)
    assert "\n" not in str(err.value)
    # a config file given by itself: the same check
    with pytest.raises(ValueError, match="auto_map"):
        hf_recipe(str(folder / "config.json"))
    assert not marker.exists() and not marker_b.exists()
