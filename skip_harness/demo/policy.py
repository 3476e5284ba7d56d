"""A small causal transformer policy that samples token by token.

Hand-written (pre-LayerNorm blocks, explicit masked attention, no dropout) so that every forward is
a plain sequence of deterministic CPU ops and nothing draws from a global random generator:
initialisation runs under a forked, seeded RNG and sampling uses the ``torch.Generator`` passed in.

Generation recomputes the whole prefix for every new token (no KV cache), as a simple rollout engine
would; that keeps generation the dominant cost of a training step, which is what the demo is about.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from skip_harness.demo.task import EOS, PAD, VOCAB_SIZE


@dataclass(frozen=True)
class PolicyConfig:
    max_len: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if min(self.max_len, self.d_model, self.n_layers, self.n_heads, self.vocab_size) < 1:
            raise ValueError(f"every size in {self} must be >= 1")


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Policy(nn.Module):
    """Token ids [B, T] -> next-token logits [B, T, vocab]."""

    def __init__(self, config: PolicyConfig, *, seed: int):
        super().__init__()
        self.config = config
        # Build and initialise under a forked RNG: deterministic in `seed`, global state untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok = nn.Embedding(config.vocab_size, config.d_model)
            self.pos = nn.Embedding(config.max_len, config.d_model)
            self.blocks = nn.ModuleList(_Block(config.d_model, config.n_heads) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab_size)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear):
                    nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"sequence of {t} tokens is longer than max_len={self.config.max_len}")
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = self.tok(ids) + self.pos.weight[:t]
        for block in self.blocks:
            x = block(x, future)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        max_new_tokens: int,
        n: int = 1,
        temperature: float = 1.0,
        generator: Optional[torch.Generator] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample ``n`` responses per prompt, token by token.

        Returns ``(responses LongTensor[B*n, R], logprobs FloatTensor[B*n, R], mask BoolTensor[B*n, R])``
        with the n samples of a prompt consecutive. ``logprobs`` are those of the sampled tokens under
        the sampling distribution (logits / temperature). Tokens after the first EOS are replaced by
        PAD, get logprob 0 and mask False. ``temperature <= 0`` decodes greedily (no generator needed);
        otherwise ``generator`` is required, so sampling never draws from the global RNG.
        """
        greedy = temperature <= 0
        if not greedy and generator is None:
            raise ValueError("sampling needs an explicit torch.Generator (or temperature <= 0 for greedy)")
        ids = prompts.repeat_interleave(n, dim=0)
        picked, picked_logprobs = [], []
        for _ in range(max_new_tokens):
            logits = self(ids)[:, -1, :]
            if greedy:
                logp = logits.log_softmax(dim=-1)
                token = logp.argmax(dim=-1, keepdim=True)
            else:
                logp = (logits / temperature).log_softmax(dim=-1)
                token = torch.multinomial(logp.exp(), 1, generator=generator)
            picked.append(token)
            picked_logprobs.append(logp.gather(1, token))
            ids = torch.cat([ids, token], dim=1)
        responses = torch.cat(picked, dim=1)
        logprobs = torch.cat(picked_logprobs, dim=1)
        mask = response_mask(responses)
        return responses.masked_fill(~mask, PAD), logprobs.masked_fill(~mask, 0.0), mask

    def logprobs(self, prompts: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Teacher-forced logprobs of ``responses`` given ``prompts`` (rows aligned), FloatTensor[N, R]."""
        return sequence_logprobs(self, prompts, responses, temperature)


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """True up to and including the first EOS of each row."""
    is_eos = responses == EOS
    eos_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    return ~eos_before


def sequence_logprobs(
    model: nn.Module, prompts: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs of ``responses`` under ``model`` (a Policy or a DDP wrapper of one), with gradients.

    Called through ``model(...)`` so that a distributed wrapper sees the forward.
    """
    ids = torch.cat([prompts, responses], dim=1)
    logits = model(ids)[:, prompts.shape[1] - 1 : -1, :]
    if temperature > 0:
        logits = logits / temperature
    return logits.log_softmax(dim=-1).gather(2, responses.unsqueeze(-1)).squeeze(-1)
