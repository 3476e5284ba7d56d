"""The demo's toy task: sort a short sequence of digits.

A prompt is ``[BOS, d_1 .. d_L, SEP]`` with L = ``prompt_length - 2`` random digits; the correct
response is the digits in ascending order followed by EOS (then EOS as padding). The reward is the
fraction of scored positions that are right (the L digits and the EOS, as far as the response length
reaches), so a policy gets partial credit long before it sorts: putting small digits first and large
ones last already beats chance, which gives GRPO a signal from a random initialisation.

The data stream is a pure function of (seed, step): each step's prompts come from their own
``torch.Generator``, so "advancing the stream" is just drawing a step's prompts, and skipping or
replaying a step never shifts another one. No global random state is touched.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

NUM_DIGITS = 10
BOS = 10
SEP = 11
EOS = 12
PAD = EOS
VOCAB_SIZE = 13

#: Mixed into the seed of the held-out validation prompts, so they never coincide with a training step's.
VALIDATION_SALT = 0x5EED


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from a tuple of ints; different tuples give unrelated seeds."""
    blob = struct.pack(f"<{len(parts)}q", *(int(p) for p in parts))
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class SortTask:
    """Sort ``prompt_length - 2`` digits; responses are ``response_length`` tokens long."""

    prompt_length: int
    response_length: int

    def __post_init__(self) -> None:
        if self.prompt_length < 3:
            raise ValueError(f"prompt_length must be >= 3 (BOS, a digit, SEP), got {self.prompt_length}")
        if self.response_length < 1:
            raise ValueError(f"response_length must be >= 1, got {self.response_length}")

    @property
    def num_digits(self) -> int:
        return self.prompt_length - 2

    @property
    def scored_length(self) -> int:
        """How many response positions the reward looks at: the digits and the EOS, if they fit."""
        return min(self.num_digits + 1, self.response_length)

    def make_prompts(self, seed: int, step: int, count: int) -> torch.Tensor:
        """The data stream: ``count`` prompts of step ``step``, LongTensor[count, prompt_length]."""
        gen = torch.Generator().manual_seed(derive_seed(seed, step))
        digits = torch.randint(0, NUM_DIGITS, (count, self.num_digits), generator=gen)
        bos = torch.full((count, 1), BOS, dtype=torch.long)
        sep = torch.full((count, 1), SEP, dtype=torch.long)
        return torch.cat([bos, digits, sep], dim=1)

    def validation_prompts(self, seed: int, count: int) -> torch.Tensor:
        """A fixed held-out set, drawn from a stream keyed apart from the training one."""
        return self.make_prompts(seed ^ VALIDATION_SALT, 0, count)

    def targets(self, prompts: torch.Tensor) -> torch.Tensor:
        """The correct responses, LongTensor[count, response_length]."""
        digits = prompts[:, 1 : 1 + self.num_digits]
        ordered = torch.sort(digits, dim=1, stable=True).values
        eos = torch.full((prompts.shape[0], 1), EOS, dtype=torch.long)
        full = torch.cat([ordered, eos], dim=1)
        if full.shape[1] >= self.response_length:
            return full[:, : self.response_length]
        pad = torch.full((prompts.shape[0], self.response_length - full.shape[1]), PAD, dtype=torch.long)
        return torch.cat([full, pad], dim=1)

    def reward(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """FloatTensor[count] in [0, 1]: the fraction of scored positions answered correctly.

        ``responses`` may hold several samples per prompt (``count * n`` rows, the n samples of a
        prompt consecutive); the prompts are then repeated to match.
        """
        if responses.shape[0] != prompts.shape[0]:
            if responses.shape[0] % prompts.shape[0]:
                raise ValueError(
                    f"{responses.shape[0]} responses do not divide evenly over {prompts.shape[0]} prompts"
                )
            prompts = prompts.repeat_interleave(responses.shape[0] // prompts.shape[0], dim=0)
        m = self.scored_length
        right = responses[:, :m] == self.targets(prompts)[:, :m]
        return right.float().mean(dim=1)
