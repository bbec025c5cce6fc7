"""What `import gradaccum` pulls in: torch and the standard library, nothing else.

Frameworks (transformers, lightning, peft, accelerate, deepspeed, tensorboard) are extras
imported only by the modules that need them, and the library never imports its built-in
recipes. Checked in a fresh interpreter, where nothing else has imported them first."""

import json
import subprocess
import sys

import gradaccum as ga

# torch and what it imports on its own: measured first, so anything new is gradaccum's doing.
TORCH = (
    "import torch, torch.distributed, torch.nn.parallel, torch.utils.checkpoint; "
    "import torch.distributed.fsdp"
)


def test_the_library_imports_only_torch_and_the_standard_library():
    code = (
        f"import json, sys; {TORCH}; before = set(sys.modules); import gradaccum; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out)
    ours = {m for m in loaded if m == "gradaccum" or m.startswith("gradaccum.")}
    assert "gradaccum.engine" in ours  # the check sees what the import brought in
    assert not any(m.startswith("gradaccum.recipes") for m in ours), sorted(ours)
    assert not {"gradaccum.trainer", "gradaccum.cli", "gradaccum.measure"} & ours, sorted(ours)
    roots = {m.split(".")[0] for m in loaded} - {"gradaccum", "torch"}
    third_party = {r for r in roots if r not in sys.stdlib_module_names and not r.startswith("_")}
    assert not third_party, sorted(third_party)


def test_all_lists_the_public_api_only():
    assert "inject_oom" not in ga.__all__ and "format_bytes" not in ga.__all__
    assert all(not name.startswith("_") for name in ga.__all__)
    assert {"Accumulator", "Precision", "OOMReplay", "NoiseScale", "plan", "check"} <= set(
        ga.__all__
    )
    for name in ga.__all__:
        assert getattr(ga, name).__module__.startswith("gradaccum."), name
    json.dumps(ga.__all__)
