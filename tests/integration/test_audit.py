"""ga.audit on trainers as users write them, with no gradaccum in their training code: the
stock Hugging Face Trainer with a per-micro-batch mean compute_loss (the 4x bug), the stock
Trainer as shipped, gradaccum's own Trainer, and plain loops. The large batch's gradient is
computed by the audit from the trainer's own loss; these tests check what it reports."""

from __future__ import annotations

import copy

import pytest
import torch
from frameworks import padded_sequences, tiny_gpt2, token_sum_loss
from frameworks import trainer_arguments as arguments
from helpers import TinyLM, lm_loss, lm_reference, make_model, padded_lm_batch, split_sizes

import gradaccum as ga

transformers = pytest.importorskip("transformers")
from gradaccum.integrations.transformers import Trainer  # noqa: E402


class MeanLossTrainer(transformers.Trainer):
    """A compute_loss that returns each micro-batch's mean and ignores num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_sum, count = token_sum_loss(model, inputs)
        return loss_sum / count


def test_a_per_micro_batch_mean_compute_loss_is_reported_as_4x(tmp_path):
    model = tiny_gpt2()
    before = copy.deepcopy(model.state_dict())
    trainer = MeanLossTrainer(
        model=model, args=arguments(tmp_path), train_dataset=padded_sequences(16)
    )
    result = ga.audit(trainer)
    print(result.summary)
    assert not result.passed and result.ratio == pytest.approx(4.0, rel=0.1)
    assert "the gradient is 3.9" in result.cause or "the gradient is 4.0" in result.cause
    assert "num_items_in_batch" in result.cause
    # what to do, in one line, with the class, the argument and the doc
    assert result.kind == "mean_per_micro_batch" and "\n" not in result.fix
    assert "ExactAccumulationMixin" in result.fix and "items=" in result.fix
    assert "docs/transformers.md" in result.fix
    # the verdict in one short line, then why, what was compared and the fix, indented
    first, *details = result.summary.splitlines()
    assert first.startswith("accumulation audit, relative error 3.") and len(first) < 120
    assert first.endswith(f"FAIL; {result.headline}") and "micro-batches" in first
    assert [d.split(":")[0] for d in details] == ["  why", "  compared", "  fix"]
    assert result.summary.endswith(f"\n  fix: {result.fix}")
    assert result.cause == f"{result.headline}: {details[0].removeprefix('  why: ')}"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_stock_trainer_as_shipped_is_measured(tmp_path):
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=padded_sequences(16)
    )
    result = ga.audit(trainer)
    print(result.summary)
    # transformers counts GPT-2's labels before the causal shift (its loss_type unset): the
    # gradient is the large batch's times the shifted labels over the unshifted ones, here
    # all 16 sequences of the window (sequential), one label fewer each after the shift
    counted = sum(int((item["labels"] != -100).sum()) for item in padded_sequences(16))
    assert not result.passed and result.ratio == pytest.approx((counted - 16) / counted, rel=1e-5)
    assert result.kind == "labels_before_shift" and "before the shift" in result.cause
    assert "gradaccum.integrations.transformers.Trainer" in result.fix
    assert "docs/transformers.md" in result.fix and "\n" not in result.fix


def test_gradaccums_trainer_passes(tmp_path):
    trainer = Trainer(
        model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=padded_sequences(16)
    )
    result = ga.audit(trainer)
    print(result.summary)
    assert result.passed and result.relative_error <= 1e-6
    assert result.ratio == pytest.approx(1.0, abs=1e-5) and "PASS" in result.summary
    assert result.summary.splitlines()[0].endswith(": PASS (within 1e-05)")


def lightning_trainer(exact: bool):
    """A Lightning Trainer as its docs configure accumulation (4 micro-batches per step)
    over the tiny GPT-2, with gradaccum's callback or without."""
    lightning = pytest.importorskip("lightning")
    from test_lightning_callback import LM

    from gradaccum.integrations.lightning import ExactAccumulation

    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=4,
        callbacks=[ExactAccumulation()] if exact else [], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return trainer, LM(tiny_gpt2(), exact=exact)


def padded_loader():
    from frameworks import stack

    return torch.utils.data.DataLoader(padded_sequences(16), batch_size=4, collate_fn=stack)


def test_stock_lightning_on_a_padded_batch_is_measured_and_its_cause_named():
    """Lightning's recipe (each micro-batch's token mean, accumulate_grad_batches=4) on
    padded sequences of 4..64 tokens: micro-batches weighted equally whatever their token
    counts; the weights as they were."""
    trainer, module = lightning_trainer(exact=False)
    before = copy.deepcopy(module.state_dict())
    result = ga.audit(trainer, module=module, data=padded_loader())
    print(result.summary)
    assert not result.passed and 0.05 < result.relative_error < 1.0
    assert result.micro_batches == 4 and "weighted equally" in result.cause
    assert "ExactAccumulation()" in result.fix and "exact_output" in result.fix
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


def test_a_ragged_lightning_window_is_named_with_its_fix():
    """12 sequences, accumulate_grad_batches=4: the epoch's one window has 3 micro-batches,
    each micro-batch's mean divided by 4 (Lightning's recipe): 3/4 of the micro-batches'
    means averaged. With gradaccum's callback the same window passes."""
    from frameworks import stack

    loader = torch.utils.data.DataLoader(padded_sequences(12), batch_size=4, collate_fn=stack)
    trainer, module = lightning_trainer(exact=False)
    result = ga.audit(trainer, module=module, data=loader)
    print(result.summary)
    assert result.micro_batches == 3 and result.kind == "ragged_window"
    assert "divided by the configured accumulation steps, not by 3" in result.cause
    assert "ExactAccumulation()" in result.fix
    trainer, module = lightning_trainer(exact=True)
    assert ga.audit(trainer, module=module, data=loader).passed


def test_lightning_with_gradaccums_callback_passes():
    trainer, module = lightning_trainer(exact=True)
    result = ga.audit(trainer, module=module, data=padded_loader())
    print(result.summary)
    assert result.passed and result.relative_error <= 1e-6 and result.micro_batches == 4


def test_a_lightning_audit_without_its_module_and_data_is_refused_in_one_line():
    trainer, _ = lightning_trainer(exact=False)
    with pytest.raises(TypeError, match="needs module=.*data="):
        ga.audit(trainer)


def test_plain_loops_are_audited_too():
    batch = padded_lm_batch(seed=3)
    micro_batches = split_sizes(batch, [1, 5, 3, 4])
    model = make_model(TinyLM)

    def naive(model, mbs):  # the textbook loop: each micro-batch's mean / N
        for mb in mbs:
            loss_sum, count = lm_loss(model, mb)
            (loss_sum / count / len(mbs)).backward()

    def exact(model, mbs):  # sums, divided once by the window's count
        total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
        for mb in mbs:
            (lm_loss(model, mb)[0] / total).backward()

    wrong = ga.audit(step=naive, loss=lm_reference, model=model, micro_batches=micro_batches)
    right = ga.audit(step=exact, loss=lm_reference, model=model, micro_batches=micro_batches)
    print(wrong.summary)
    assert not wrong.passed and "weighted equally" in wrong.cause
    assert right.passed and right.relative_error <= 1e-6
    with pytest.raises(TypeError, match="needs loss, model"):
        ga.audit(step=naive)

    def skewed(model, mbs):  # weights 1, 2, 3, 4 by position: no cause the audit knows
        for i, mb in enumerate(mbs):
            loss_sum, count = lm_loss(model, mb)
            ((i + 1) * loss_sum / count / len(mbs)).backward()

    unknown = ga.audit(step=skewed, loss=lm_reference, model=model, micro_batches=micro_batches)
    print(unknown.summary)
    assert unknown.kind == "unknown" and unknown.cause.startswith("no known cause matched: ")
    assert "\n  compared: one window of 4 micro-batches, run as the trainer" in unknown.summary
    assert "not a multiple of the large batch's gradient" in unknown.cause
    assert "ga.check(" in unknown.fix and "docs/losses.md" in unknown.fix


TRAINER_FILE = """
import sys

sys.path.insert(0, {tests!r})  # the tests' tiny GPT-2 and data

import transformers
from frameworks import padded_sequences, tiny_gpt2, token_sum_loss
from frameworks import trainer_arguments as arguments


class MeanLossTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_sum, count = token_sum_loss(model, inputs)
        return loss_sum / count


def make_trainer():
    args = transformers.TrainingArguments(
        output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=4,
        report_to=[], use_cpu=True, save_strategy="no", train_sampling_strategy="sequential",
    )
    return MeanLossTrainer(model=tiny_gpt2(), args=args, train_dataset=padded_sequences(16))
"""


@pytest.mark.slow  # three fresh processes that import transformers: the slow tier
def test_the_command_audits_a_trainer_from_a_file_and_exits_1_on_failure(tmp_path):
    from pathlib import Path

    from helpers import cli

    tests = str(Path(__file__).resolve().parents[1])
    (tmp_path / "train.py").write_text(TRAINER_FILE.format(tests=tests))
    proc = cli("audit", tmp_path / "train.py:make_trainer", cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "FAIL; the gradient is 3.9" in proc.stdout or "FAIL; the gradient is 4.0" in proc.stdout
    assert "\n  fix: put gradaccum's ExactAccumulationMixin first in your Trainer" in proc.stdout
    proc = cli("audit", tmp_path / "train.py:nothing", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("has no function 'nothing'")
    assert "Traceback" not in proc.stderr
    (tmp_path / "broken.py").write_text("import no_such_module\n")
    proc = cli("audit", tmp_path / "broken.py:make", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "broken.py failed to load: ModuleNotFoundError" in proc.stderr


LIGHTNING_FILE = """
import sys

sys.path.insert(0, {tests!r})  # the tests' tiny GPT-2, data and LightningModule
sys.path.insert(0, {integration!r})

import lightning
import torch
from frameworks import padded_sequences, stack, tiny_gpt2
from test_lightning_callback import LM


def make():
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(padded_sequences(16), batch_size=4, collate_fn=stack)
    return trainer, LM(tiny_gpt2(), exact=False), data
"""


@pytest.mark.slow  # a fresh process that imports Lightning and transformers
def test_the_command_audits_a_lightning_trainer_from_a_file(tmp_path):
    from pathlib import Path

    from helpers import cli

    here = Path(__file__).resolve()
    text = LIGHTNING_FILE.format(tests=str(here.parents[1]), integration=str(here.parent))
    (tmp_path / "fit.py").write_text(text)
    proc = cli("audit", tmp_path / "fit.py:make", cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "FAIL; micro-batches are weighted equally" in proc.stdout
    assert "\n  fix: add gradaccum's callback, Trainer(callbacks=[ExactAccumulation" in proc.stdout


PLAIN_LOOP_FILE = """
import torch
import torch.nn.functional as F


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.rnn = torch.nn.Embedding(40, 12), torch.nn.GRU(12, 12, batch_first=True)
        self.head = torch.nn.Linear(12, 40)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


def batches():
    g, out = torch.Generator().manual_seed(1), []
    for n, longest in ((3, 9), (2, 17), (4, 5)):
        ids = torch.randint(1, 40, (n, longest), generator=g)
        ids[0, longest // 2 :] = 0  # one padded sequence per micro-batch
        labels = ids.roll(-1, 1)
        labels[:, -1] = -100
        labels[labels == 0] = -100
        out.append((ids, labels))
    return out


def loss(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)


def step(model, micro_batches):
    for mb in micro_batches:
        (loss(model, mb) / len(micro_batches)).backward()


def make_loop():
    torch.manual_seed(0)
    return {{"step": step, "loss": loss, "model": LM(), "micro_batches": batches()}}
"""


def test_the_command_audits_a_plain_loop_and_points_at_its_loss_line(tmp_path):
    from test_faults import in_process

    (tmp_path / "loop.py").write_text(PLAIN_LOOP_FILE.format())
    done = in_process("audit", tmp_path / "loop.py:make_loop")
    assert done.returncode == 1, done.stderr
    first, *rest = done.stdout.splitlines()
    assert first.endswith("FAIL; micro-batches are weighted equally whatever their item counts")
    fix = next(line for line in rest if line.startswith("  fix: "))
    assert fix.endswith(f"your loop's backward, {tmp_path / 'loop.py'}:35:")
    diff = rest[rest.index(fix) + 1 :]
    loop = tmp_path / "loop.py"
    assert diff[:3] == [f"    --- {loop}", f"    +++ {loop}", "    @@ -35 +35 @@"]
    assert diff[3] == "    -        (loss(model, mb) / len(micro_batches)).backward()"
    assert diff[4].startswith("    +        (loss_sum / window_items).backward()  # loss_sum: ")
