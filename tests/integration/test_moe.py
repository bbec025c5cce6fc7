"""A mixture-of-experts causal LM's router loss under accumulation: transformers' own
test_trainer_moe_loss ported (a tiny Qwen3-MoE with output_router_logits=True, its loss
cross-entropy + router_aux_loss_coef x the load-balancing loss), through gradaccum's Trainer
with 4 micro-batches of uneven token counts, against the model called once on the whole
batch with labels (its own loss, autograd's gradient). The load-balancing loss is a product
of two means over the batch, so a window is exact only with the window's routing: the
refusals where that cannot be had, Lightning's callback, and the audit's cause."""

from __future__ import annotations

import copy

import pytest
import torch
from frameworks import rel_err, stack
from frameworks import trainer_arguments as arguments
from helpers import capture_step_grads

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import gradaccum as ga  # noqa: E402
from gradaccum.integrations.transformers import Trainer  # noqa: E402

VOCAB, SEQ = 64, 16


def tiny_moe(coef: float = 0.07, seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    """Two layers of 8 experts, 2 per token, random init."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=coef,
        max_position_embeddings=SEQ,
    )
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**settings, **overrides}))


def sequences(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of lengths 2..16, right-padded to 16 (mask 0, label -100 there)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, SEQ + 1, (), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return out


def full_batch(model, items) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference, torch and transformers alone: the model once on the whole batch with
    labels, its own loss (cross-entropy + coefficient x load balancing) and its gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(**stack(items)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().item(), grads


def one_window(tmp_path, model, items, trainer_class=Trainer, **kwargs):
    """One window of 4 micro-batches of 4 at learning rate 0: its gradient and logs."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    trainer = trainer_class(
        model=model,
        args=arguments(tmp_path),
        train_dataset=items,
        optimizers=(optimizer, None),
        **kwargs,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return seen, logs, trainer


@pytest.mark.parametrize("coef", [0.01, 0.07])
def test_the_router_loss_is_the_full_batchs(tmp_path, coef):
    model = tiny_moe(coef)
    reference = copy.deepcopy(model)
    items = sequences(16)
    tokens = [int((stack(items[i : i + 4])["labels"][:, 1:] != -100).sum()) for i in (0, 4, 8, 12)]
    want_loss, want = full_batch(reference, items)
    seen, logs, _ = one_window(tmp_path, model, items)
    err = rel_err(seen[0], want)
    loss_err = abs(logs[0]["loss"] - want_loss) / want_loss
    print(
        f"Qwen3-MoE, router_aux_loss_coef {coef}, micro-batches of {tokens} tokens: gradient "
        f"{err:.1e} off, loss {logs[0]['loss']:.6f} against {want_loss:.6f} ({loss_err:.1e})"
    )
    assert len(seen) == 1 and err <= 1e-6 and loss_err <= 1e-6
    assert "loss_ce" in logs[0] and "loss_aux" in logs[0]


def steps_with_fault(tmp_path, calls=None) -> tuple[list[dict[str, torch.Tensor]], list]:
    """Three windows at SGD 0.1: each step's gradient, and the windows replayed so far;
    with ``calls``, the device holds 2 sequences once the first MoE layer has run ``calls``
    forwards in train mode (the routing passes' included)."""
    from support.faults import oom_after

    model = tiny_moe()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = capture_step_grads(optimizer, model)
    fault = None if calls is None else oom_after(model.model.layers[0], calls, 2)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=sequences(48),
        optimizers=(optimizer, None),
        oom=ga.OOMReplay(),
    )
    trainer.train()
    assert fault is None or fault.faults == 1
    return seen, [x.get("oom_replays", 0) for x in trainer.state.log_history if "loss" in x]


@pytest.mark.parametrize("calls", [10, 13], ids=["in the routing pass", "in training"])
def test_out_of_memory_mid_window_keeps_the_router_loss_exact(tmp_path, calls):
    """Each window runs its 4 micro-batches twice, the routing pass and training: the 11th
    forward is the second window's routing pass, the 14th its training. Either replays the
    window at 2 sequences, the same steps as without the fault."""
    clean, _ = steps_with_fault(tmp_path / "clean")
    seen, replays = steps_with_fault(tmp_path / "fault", calls)
    errors = [rel_err(a, b) for a, b in zip(seen, clean, strict=True)]
    print(f"out of memory after {calls} forwards: steps {[f'{e:.1e}' for e in errors]}")
    assert len(seen) == 3 and max(errors) <= 1e-6 and replays == [0, 1, 1]


@pytest.mark.slow
def test_two_ranks_match_the_full_batch(tmp_path):
    """torchrun, 2 ranks on gloo, each routing its own micro-batches: after 3 SGD steps the
    parameters match the model's own loss over each step's 32 sequences as one batch."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from helpers import max_rel_err

    worker = Path(__file__).parent / "distributed" / "moe_worker.py"
    out = tmp_path / "params.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    proc = subprocess.run(
        [*torchrun, str(worker), str(out)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model, items = tiny_moe(), sequences(96)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        model(**stack(items[32 * step : 32 * (step + 1)])).loss.backward()
        optimizer.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    got = {k.removeprefix("module."): v for k, v in torch.load(out, weights_only=True).items()}
    err = max_rel_err(got, want)
    print(f"Qwen3-MoE under torchrun, 2 ranks: parameters after 3 steps {err:.1e}")
    assert err <= 1e-5


def ce_only(model, inputs):
    """A loss_fn that leaves the router loss out: the token loss alone."""
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return ga.causal_lm_loss(logits, inputs["labels"])


def test_the_audit_names_the_router_loss_left_out(tmp_path):
    items = sequences(16)
    args = arguments(tmp_path)
    exact = ga.audit(Trainer(model=tiny_moe(), args=args, train_dataset=items))
    left_out = ga.audit(Trainer(model=tiny_moe(), args=args, train_dataset=items, loss_fn=ce_only))
    print(f"the model's own loss: {exact.summary}\nCE alone as loss_fn: {left_out.summary}")
    assert exact.passed
    assert not left_out.passed
    assert left_out.cause.startswith("the model's auxiliary loss is not in the trained loss")


class MyMoe(Qwen3MoeForCausalLM):
    """A class gradaccum does not know, whose forward adds a router loss."""


class ZLossMoe(Qwen3MoeForCausalLM):
    """A known class name whose aux_loss is not the load-balancing loss alone (a router
    z-loss added to it)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids, attention_mask, labels=labels, **kwargs)
        if out.aux_loss is not None:
            z = sum(torch.logsumexp(r, dim=-1).square().mean() for r in out.router_logits)
            out.aux_loss = out.aux_loss + 1e-3 * z
        return out


ZLossMoe.__name__ = "Qwen3MoeForCausalLM"


def _refusal(tmp_path, model) -> str:
    trainer = Trainer(model=model, args=arguments(tmp_path), train_dataset=sequences(16))
    with pytest.raises(ValueError) as error:
        trainer.train()
    message = str(error.value)
    print(message)
    assert "\n" not in message
    return message


def test_a_router_loss_that_cannot_be_counted_is_refused_in_one_line(tmp_path):
    setting = "output_router_logits=True, router_aux_loss_coef=0.07"
    config = tiny_moe().config
    message = _refusal(tmp_path, MyMoe(config))
    assert f"MyMoe adds an auxiliary loss to its own ({setting})" in message
    message = _refusal(tmp_path, tiny_moe(attention_dropout=0.1))
    assert "draws random numbers in training (attention_dropout=0.1)" in message
    message = _refusal(tmp_path, ZLossMoe(config))
    assert "Qwen3MoeForCausalLM's aux_loss differs from transformers' load_balancing" in message


def test_without_the_router_loss_nothing_changes(tmp_path):
    """output_router_logits=False: the token loss alone, as before (the model's own loss
    is then cross-entropy alone)."""
    model = tiny_moe(output_router_logits=False)
    items = sequences(16)
    _, want = full_batch(copy.deepcopy(model), items)
    seen, logs, _ = one_window(tmp_path, model, items)
    assert rel_err(seen[0], want) <= 1e-6 and "loss_aux" not in logs[0]


def test_the_mixin_over_trls_sft_trainer_trains_the_router_loss(tmp_path):
    """SFTTrainer's own loss (cross-entropy + its router_aux_loss_coef x aux_loss) over the
    window's 16 prompt-completion pairs as one batch, against the mixin's window."""
    trl = pytest.importorskip("trl")
    from test_trl import config, prompts_and_completions, tokenizer

    from gradaccum.integrations.transformers import ExactAccumulationMixin

    class ExactSFT(ExactAccumulationMixin, trl.SFTTrainer):
        pass

    trainer = ExactSFT(
        model=tiny_moe(vocab_size=256, max_position_embeddings=64),
        args=config(tmp_path),
        train_dataset=prompts_and_completions(),
        processing_class=tokenizer(),
    )
    result = ga.audit(trainer, tolerance=1e-6)
    print(f"ExactAccumulationMixin over SFTTrainer, Qwen3-MoE: {result.summary}")
    assert trainer.aux_loss_enabled and result.passed


lightning = pytest.importorskip("lightning")
from frameworks import RecordingSGD  # noqa: E402

from gradaccum.integrations.lightning import ExactAccumulation, exact_output  # noqa: E402


class LM(lightning.LightningModule):
    """The tiny MoE, its token loss through exact_output."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return exact_output(self, *ga.causal_lm_loss(logits.logits, batch["labels"]))

    def configure_optimizers(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.optimizer = RecordingSGD(self.model.parameters(), names, lr=0.0)
        return self.optimizer


def lightning_fit(module, items, callback=None):
    loader = torch.utils.data.DataLoader(items, batch_size=4, collate_fn=stack)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=4,
        callbacks=[callback or ExactAccumulation()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)


@pytest.mark.parametrize(("coef", "n"), [(0.01, 16), (0.07, 16), (0.07, 12)])
def test_lightnings_callback_trains_the_router_loss_exactly(coef, n):
    """The module's training_step returns the token loss alone (exact_output); the callback
    adds the model's router term over the whole window at its end. The step's gradient and
    the window's loss against the model called once on the 16 sequences with labels (its
    own cross-entropy + coefficient x load balancing, autograd's gradient). 12 sequences:
    one ragged window of 3 micro-batches, which Lightning still divides by 4."""
    model = tiny_moe(coef)
    items = sequences(n)
    want_loss, want = full_batch(copy.deepcopy(model), items)
    module, callback = LM(model), ExactAccumulation()
    lightning_fit(module, items, callback)
    err = rel_err(module.optimizer.seen[0], want)
    loss_err = abs(callback.last.loss - want_loss) / want_loss
    print(
        f"Lightning, Qwen3-MoE, router_aux_loss_coef {coef}, {n} sequences: gradient "
        f"{err:.1e} off, loss "
        f"{callback.last.loss:.6f} against {want_loss:.6f} ({loss_err:.1e})"
    )
    assert len(module.optimizer.seen) == 1 and err <= 1e-6 and loss_err <= 1e-6
    assert set(callback.last.terms) == {"ce", "aux"}


def test_lightnings_callback_refuses_a_router_loss_it_cannot_count_in_one_line():
    """A class gradaccum does not know: refused, naming the model and the setting. With the
    router loss off, the same module is exact on the token loss alone."""
    with pytest.raises(ValueError) as error:
        lightning_fit(LM(MyMoe(tiny_moe().config)), sequences(16))
    message = str(error.value)
    print(message)
    assert "\n" not in message
    assert "MyMoe adds an auxiliary loss to its own (output_router_logits=True" in message
    model = tiny_moe(output_router_logits=False)
    items = sequences(16)
    _, want = full_batch(copy.deepcopy(model), items)
    module = LM(model)
    lightning_fit(module, items)
    err = rel_err(module.optimizer.seen[0], want)
    print(f"Lightning, output_router_logits=False: {err:.1e}")
    assert err <= 1e-6
