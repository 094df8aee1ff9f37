"""Samples: the model continues each configured prompt; the text is logged, not scored.

Settings (an `eval.evaluators` entry): `prompts`, `max_new_tokens`, `temperature` (0 is
greedy decoding; above 0 samples from softmax(logits / temperature)) and `seed`. Sampling keys
depend only on (seed, token position, prompt index), so the same weights give the same text on
any topology and after a resume. A model with `init_cache(batch, length)` whose call accepts
`cache=` and `index=` (runner.models.gpt.model.GPT does) decodes with a KV cache: the prompt is fed
once, then one token per step. Other models are run on the whole sequence at every step.

Texts: `<label>/sample_<i>` is prompt i followed by its continuation (cut at the first
end-of-document token); they are logged to metrics.jsonl as strings and to wandb as a table.
Metric: `<label>/new_tokens`, the mean continuation length before end-of-document.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from runner.errors import ConfigError, UserError
from runner.evaluation.base import (
    EVALUATORS,
    EvaluatorBase,
    global_batch,
    process_batches,
    replicated,
    text_tokenizer,
    to_global,
)
from runner.spec import EvaluatorSpec, ExecutionSpec


def generate_tokens(apply_fn: Callable[..., Any], variables: Any, prompt: jax.Array, length: jax.Array,
                    row_ids: jax.Array, *, max_new_tokens: int, temperature: float, seed: int, vocab: int,
                    init_cache: Optional[Callable[[int, int], Any]] = None) -> jax.Array:
    """`max_new_tokens` tokens after each row's prompt (prompt[b, :length[b]]), (B, max_new_tokens).

    `variables`: what the model is applied to (TrainState.variables()). Only the first `vocab`
    logits compete (a model's output layer may be padded wider than the
    tokenizer). With `init_cache`, decoding uses the model's KV cache; without, the full forward.
    """
    batch, prompt_len = prompt.shape
    rows = jnp.arange(batch)
    base = jax.random.key(seed)

    def pick(logits: jax.Array, t: jax.Array) -> jax.Array:
        logits = logits[:, :vocab].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, t), r))(row_ids)
        return jax.vmap(lambda k, lg: jax.random.categorical(k, lg / temperature))(keys, logits).astype(jnp.int32)

    out = jnp.zeros((batch, max_new_tokens), jnp.int32)
    if init_cache is not None:
        cache = init_cache(batch, prompt_len + max_new_tokens)
        logits, cache = apply_fn(variables, prompt, cache=cache, index=jnp.zeros(batch, jnp.int32))
        token = pick(logits[rows, length - 1], jnp.int32(0))
        out = out.at[:, 0].set(token)

        def step(t: jax.Array, carry: tuple[jax.Array, Any, jax.Array]) -> tuple[jax.Array, Any, jax.Array]:
            token, cache, out = carry  # `token` sits at position length + t - 1
            logits, cache = apply_fn(variables, token[:, None], cache=cache, index=length + t - 1)
            token = pick(logits[:, 0], t)
            return token, cache, out.at[:, t].set(token)

        return jax.lax.fori_loop(1, max_new_tokens, step, (token, cache, out))[2]

    buffer = jnp.zeros((batch, prompt_len + max_new_tokens), jnp.int32).at[:, :prompt_len].set(prompt)

    def full_step(t: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        buffer, out = carry
        logits = apply_fn(variables, buffer)
        token = pick(logits[rows, length + t - 1], t)
        return buffer.at[rows, length + t].set(token), out.at[:, t].set(token)

    return jax.lax.fori_loop(0, max_new_tokens, full_step, (buffer, out))[1]


@EVALUATORS.register("generate")
class Generate(EvaluatorBase):
    """Samples: the model continues each of `prompts`; the text is logged, not scored."""

    name = "generate"
    metrics = ("new_tokens",)
    default_label = "generate"

    def __init__(self, spec: ExecutionSpec, settings: Optional[EvaluatorSpec] = None) -> None:
        super().__init__(spec, settings)
        self._prompts: list[list[int]] | None = None
        self._batches: list[dict[str, np.ndarray]] = []
        self._fn: Any = None
        self._tokenizer: Any = None

    @classmethod
    def check(cls, spec: ExecutionSpec, settings: EvaluatorSpec, key: str) -> None:
        if not settings.prompts:
            raise ConfigError(f"{key}.prompts", [], "generate needs at least one prompt.",
                              "set it, e.g. eval.evaluators=[heldout,{name:generate,prompts:['def main(']}].")

    def prepare(self, ctx: Any) -> None:
        if self._prompts is not None:
            return
        key = self.config_key
        self.check(self.spec, self.settings, key)
        self._tokenizer = text_tokenizer(ctx, key)
        context = _context_length(ctx)
        new = self.settings.max_new_tokens
        prompts = []
        for j, text in enumerate(self.settings.prompts):
            ids = [int(t) for t in self._tokenizer.encode(text)] or [self._tokenizer.eod_id]
            if len(ids) + new > context:
                raise UserError(
                    f"Prompt {j} of {key}.prompts ({text[:40]!r}...) is {len(ids)} tokens; with {key}.max_new_tokens="
                    f"{new} that needs {len(ids) + new} positions, more than the model's context of {context} "
                    f"(job.model.context_length). Fix: shorten the prompt to at most {max(context - new, 0)} tokens, "
                    f"or lower {key}.max_new_tokens to at most {max(context - len(ids), 0)}."
                )
            prompts.append(ids)
        width = max(len(p) for p in prompts)
        rows = []
        for i, ids in enumerate(prompts):
            padded = np.zeros(width, np.int32)
            padded[: len(ids)] = ids
            rows.append({"prompt": padded, "length": np.int32(len(ids)), "id": np.int32(i)})
        self._prompts = prompts
        self._batches = process_batches(rows, global_batch(len(rows), ctx))
        for b in self._batches:  # blank padding rows: a one-token prompt, so indexing stays in range
            b["length"] = np.maximum(b["length"], 1)

    def evaluate(self, ctx: Any, state: Any) -> Mapping[str, float]:
        self.prepare(ctx)
        assert self._prompts is not None
        if self._fn is None:
            model = getattr(ctx, "model", None)
            init_cache = getattr(model, "init_cache", None)
            settings, vocab = self.settings, int(ctx.strategy.vocab_size)

            def run(state: Any, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
                tokens = generate_tokens(state.apply_fn, state.variables(), batch["prompt"], batch["length"],
                                         batch["id"], max_new_tokens=settings.max_new_tokens,
                                         temperature=settings.temperature, seed=settings.seed, vocab=vocab,
                                         init_cache=init_cache)
                return tokens, batch["id"]

            self._fn = jax.jit(run, out_shardings=replicated(ctx))
        continuations: dict[int, np.ndarray] = {}
        for local in self._batches:
            tokens, ids = jax.device_get(self._fn(state, to_global(ctx, local)))
            continuations.update({int(i): t for i, t in zip(ids, tokens) if i >= 0})
        eod = self._tokenizer.eod_id
        lengths, texts = [], {}
        for i, prompt in enumerate(self.settings.prompts):
            tokens = continuations[i]
            stop = np.flatnonzero(tokens == eod)
            tokens = tokens[: stop[0]] if len(stop) else tokens
            lengths.append(len(tokens))
            texts[self.key(f"sample_{i}")] = prompt + self._tokenizer.decode(tokens)
        self._texts = texts
        return {self.key("new_tokens"): float(np.mean(lengths))}


def _context_length(ctx: Any) -> int:
    """The model's longest sequence: its config's context_length, else train.seq_len."""
    config = getattr(ctx, "model_config", None)
    return int(getattr(config, "context_length", 0) or ctx.spec.train.seq_len)
