"""Sampling one token from a logits row on PyTorch, shared by both Torch decoders.

A leaf module (torch only): the generic decoder (`torch_runtime`) and the Phi fast path
(`torch_fast`) both sample through it, so neither has to import the other for it.
"""

from __future__ import annotations

import secrets

import torch

from backends import Sampling


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token id from a 1-D logits vector: greedy at temperature 0, else top-p sampling."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() * sampling.scale, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p
        outside[0] = False  # the most likely token always stays
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A sequence's own random generator: its samples do not depend on what else runs."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator
