"""A small byte-level GPT: causal self-attention blocks, learned positions, tied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.validate import int_problem


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Vocabulary size; 256 covers every byte."""
    max_len: int = 128
    """Longest sequence the position table holds."""
    d_model: int = 64
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_layers: int = 2
    """Transformer blocks."""
    dropout: float = 0.0
    """Dropout after attention and MLP."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "max_len", "d_model", "n_heads", "n_layers"):
            if (problem := int_problem(getattr(self, name), name)) is not None:
                problems.append(problem)
        if not problems and self.d_model % self.n_heads:
            problems.append(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: fewer parameters for a tiny model
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # GPT-2's scale: with the default N(0, 1) embedding, the tied head starts with huge
        # logits and a loss far above log(vocab).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.cfg.max_len:
            raise ValueError(
                f"sequence length {ids.shape[1]} exceeds the model's max_len {self.cfg.max_len}"
            )
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class GPTStage(nn.Module):
    """Stage ``index`` of ``stages`` of a GPT, for a pipeline (``gradaccum.pipeline``): its
    share of the blocks (split evenly, earlier stages taking any extra), the embeddings on
    the first stage, the final norm and the head on the last. The modules are ``model``'s
    own, and the parameter names are the full model's (``blocks.2.ln1.weight``), so the
    stages' state_dicts together are the GPT's.

    The head is tied to the token embedding: with two or more stages the first and the last
    stage each hold a copy; ``tied()`` names it, for ``PipelineWindow(tied=...)`` to sum its
    two gradients and keep the copies equal."""

    def __init__(self, model: GPT, index: int, stages: int) -> None:
        super().__init__()
        n = model.cfg.n_layers
        if not 1 <= stages <= n:
            raise ValueError(f"a GPT of {n} blocks splits into 1 to {n} stages, not {stages}")
        if not 0 <= index < stages:
            raise ValueError(f"stage index must be in [0, {stages}), got {index}")
        self.cfg, self.index, self.stages = model.cfg, index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        lo = index * (n // stages) + min(index, n % stages)
        hi = lo + n // stages + (index < n % stages)
        if self.is_first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.is_last:
            self.ln, self.head = model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # token ids in, the residual stream out
            if x.shape[1] > self.cfg.max_len:
                raise ValueError(
                    f"sequence length {x.shape[1]} exceeds the model's max_len {self.cfg.max_len}"
                )
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln(x)) if self.is_last else x

    def tied(self) -> list[nn.Parameter]:
        """This stage's copy of the tied embedding and head, when another stage holds the
        other copy (the first and the last stage of two or more)."""
        if self.stages == 1:
            return []
        if self.is_first:
            return [self.tok.weight]
        return [self.head.weight] if self.is_last else []

    def sample_input(self, n: int) -> torch.Tensor:
        """``n`` inputs at the longest shape: token ids on the first stage, else the
        residual stream another stage sends."""
        if self.is_first:
            return torch.zeros(n, self.cfg.max_len, dtype=torch.long)
        return torch.randn(n, self.cfg.max_len, self.cfg.d_model)
