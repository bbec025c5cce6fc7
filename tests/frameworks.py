"""The setting the framework integrations are measured in: a tiny GPT-2 (2 layers, d 64,
vocabulary 256), right-padded sequences of lengths 4..64 (padding labelled -100), and the
independent full-batch reference (token-summed cross-entropy over the shifted labels that
count, divided by their number; one backward). Nothing here calls gradaccum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SEQ = 64
VOCAB = 256


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    return GPT2LMHeadModel(config)


def padded_sequences(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of lengths spread over 4..64, right-padded to 64."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(4, SEQ, n).round().long()
    lengths = lengths[torch.randperm(n, generator=g)]
    out = []
    for length in lengths.tolist():
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[:length] = 1
        labels = ids.clone()
        labels[length:] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def stack(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def token_sum_loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the shifted labels that count, and their number."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    return loss, (labels != -100).sum()


def full_batch_grads(model, items) -> dict[str, torch.Tensor]:
    """The reference: one backward of the whole batch's per-token mean."""
    model.zero_grad(set_to_none=True)
    loss, count = token_sum_loss(model, stack(items))
    (loss / count).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Relative error of the whole gradient (all parameters as one vector)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    num = sum(float((got[k].double() - want[k].double()).square().sum()) for k in want)
    den = sum(float(want[k].double().square().sum()) for k in want)
    return (num / den) ** 0.5


class RecordingSGD(torch.optim.SGD):
    """SGD that records the gradient each step applies (after a closure has run: Lightning
    hands the window's last micro-batch to ``step`` as a closure)."""

    def __init__(self, params, names: dict[int, str], lr: float) -> None:
        super().__init__(params, lr=lr)
        self.names = names
        self.seen: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.seen.append(
            {
                self.names[id(p)]: p.grad.detach().clone()
                for group in self.param_groups
                for p in group["params"]
                if p.grad is not None
            }
        )
        super().step()
        return loss


class Regression:
    """Linear regression with a known gradient noise scale (tests/unit/test_noise.py): y =
    x.w* + eps, x ~ N(0, I_d), eps ~ N(0, s^2), loss (x.w - y)^2 / 2 at w = w* + delta, so
    B_simple = d + 1 + d s^2 / |delta|^2. ``windows`` windows of 128 samples."""

    d, s, delta_norm = 10, 1.5, 0.8

    def __init__(self, windows: int = 400) -> None:
        self.analytic = self.d + 1 + self.d * self.s**2 / self.delta_norm**2
        torch.manual_seed(0)
        self.w_star = torch.randn(self.d)
        delta = torch.randn(self.d)
        self.delta = delta / delta.norm() * self.delta_norm
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(windows * 128, self.d, generator=g)
        self.y = self.x @ self.w_star + self.s * torch.randn(windows * 128, generator=g)

    def model(self) -> torch.nn.Linear:
        """The model at w* + delta."""
        model = torch.nn.Linear(self.d, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_((self.w_star + self.delta)[None])
        return model

    @staticmethod
    def loss(model, x, y):
        import gradaccum as ga

        return ga.sample_mean(0.5 * (model(x).squeeze(1) - y) ** 2)

    @staticmethod
    def noise() -> object:
        """The estimator for this stationary problem: every window averaged (horizon 1)."""
        import gradaccum as ga

        return ga.NoiseScale(horizon=1.0)

    def accumulator_b_simple(self) -> float:
        """The Accumulator's B_simple on the same windows, in micro-batches of 16."""
        import gradaccum as ga

        model = self.model()
        acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), noise=self.noise())
        for i in range(len(self.x) // 128):
            window = (self.x[128 * i : 128 * (i + 1)], self.y[128 * i : 128 * (i + 1)])
            result = acc.step(ga.split(window, 16), lambda m, mb: self.loss(m, *mb))
        return result.noise_scale


def trainer_arguments(tmp_path, **overrides):
    """TrainingArguments for the integration tests: CPU, no saving, no reports, sequential
    windows (a window's items are known, for the reference), clipping off."""
    import transformers

    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_train_epochs=1,
        max_grad_norm=0.0,  # clipping off: the captured gradient is the accumulated one
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        train_sampling_strategy="sequential",  # windows of known items, for the reference
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**settings, **overrides})
