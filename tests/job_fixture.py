"""A job whose model has no weight matrix (a learned unigram), for optimizer checks at config time."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jobs.gpt import GPTTrainer


class Unigram(nn.Module):
    """Next-token logits that ignore the context: one bias vector over the vocabulary."""

    vocab_size: int

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool = True, **_: Any) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",))
        bias = self.param("bias", init, (self.vocab_size,))
        return jnp.broadcast_to(bias, (*tokens.shape, self.vocab_size))


class UnigramTrainer(GPTTrainer):
    @classmethod
    def build_model(cls, config: Any) -> Unigram:  # type: ignore[override]
        return Unigram(config.vocab_size)
