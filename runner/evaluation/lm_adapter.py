"""A runner model as an lm-evaluation-harness `LM`, so lm-eval scores runner models.

`RunnerLM(ctx, state)` wraps the state of a running job (runner's `lm_eval` evaluator,
runner.evaluation.harness, in the loop or in mode=eval); its subclass in
runner.main.lm_eval restores a checkpoint for lm-eval's own command line,
`lm_eval --model runner --model_args checkpoint=RUN`.

Requests are scored by runner.evaluation.scoring, the path runner's own `multiple_choice` uses,
so both give the same log-likelihoods for the same text. Sequences are train.seq_len tokens (the
compiled shape): longer contexts are cut from the left, as lm-eval's Hugging Face model does at
its max_length. Every process runs every request (lm-eval sees one rank); each batch is split
over the mesh.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from runner.errors import UserError
from runner.evaluation.base import batch_ways, global_batch, process_batches, replicated, text_tokenizer, to_global
from runner.evaluation.generate import generate_tokens
from runner.evaluation.scoring import Pair, Scorer


def exit_with(err: UserError) -> None:
    """runner's answer to a mistake: one paragraph on stderr, exit code 2, no traceback."""
    print("error: " + " ".join(str(err).split()), file=sys.stderr, flush=True)
    raise SystemExit(2) from None


class RunnerLM(TemplateLM):
    """lm-eval's view of a runner model and its parameters."""

    backend = "causal"
    exit_on_mistakes = False  # True under lm-eval's command line (runner.main.lm_eval)

    def __init__(self, ctx: Any, state: Any, batch_size: Any = None, checkpoint: str = "") -> None:
        """`ctx`: the job's EvalContext; `state`: the parameters to score with (the job's mesh
        context must be active while the model is used); `batch_size`: rows per forward pass
        (default eval.batch_size)."""
        super().__init__()
        self.checkpoint = checkpoint
        self.ctx, self.state = ctx, state
        rows = batch_size if isinstance(batch_size, int) or str(batch_size).isdigit() else None
        unit = math.lcm(batch_ways(ctx), jax.process_count())
        self.batch_size = -(-int(rows) // unit) * unit if rows else ctx.spec.eval.batch_size
        self.tokenizer_ = text_tokenizer(ctx, "the lm-eval model")
        self.scorer = Scorer(ctx, self.batch_size, where="lm-eval's requests")
        self._generators: dict[tuple[int, float], Any] = {}

    # ------------------------------------------------------------------ what lm-eval asks of an LM

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer_.eod_id)

    @property
    def max_length(self) -> int:
        return int(self.ctx.spec.train.seq_len)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer_, "name", type(self.tokenizer_).__name__))

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return [int(t) for t in self.tokenizer_.encode(string)]

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return str(self.tokenizer_.decode(np.asarray(tokens, np.int32)))

    def get_model_info(self) -> dict[str, Any]:
        spec = self.ctx.spec
        return {"runner_checkpoint": self.checkpoint, "runner_job": spec.job.name, "runner_seq_len": spec.train.seq_len,
                "runner_step": int(self.state.step)}

    @contextlib.contextmanager
    def _mistakes(self) -> Iterator[None]:
        """Under lm-eval's command line (a model loaded from a checkpoint), a request runner cannot
        serve ends as runner's paragraph; inside a runner job, runner's command line reports it."""
        try:
            yield
        except UserError as err:
            if not self.exit_on_mistakes:
                raise
            exit_with(err)

    def _score(self, pairs: Sequence[Pair]) -> tuple[np.ndarray, np.ndarray]:
        with self._mistakes():
            return self.scorer.score(self.state, self.scorer.batches(pairs), len(pairs))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        sums, greedy = self._score([(context, continuation) for _, context, continuation in requests])
        answers = [(float(s), bool(g)) for s, g in zip(sums, greedy)]
        for (pair, _, _), answer in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood", pair, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, scored in disjoint windows of at most max_length tokens."""
        pairs, owner = [], []
        for n, request in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(request.args[0]),
                                                prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                                                context_len=1)
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owner.append(n)
        sums = self._score(pairs)[0] if pairs else np.zeros(0)
        totals = np.zeros(len(requests), np.float64)
        np.add.at(totals, np.asarray(owner, np.int64), sums)
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), float(total))
        return [float(t) for t in totals]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with do_sample, sampled) continuations, cut at the first `until` string or the
        end-of-document token; the KV cache is used when the model has one."""
        context_length = int(getattr(self.ctx.model_config, "context_length", 0) or self.max_length)
        groups: dict[tuple[int, float], list[tuple[int, list[int], list[str]]]] = {}
        for n, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", 256))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            if new >= context_length:
                with self._mistakes():
                    raise UserError(f"An lm-eval task asks for max_gen_toks={new}, which leaves no room for the prompt "
                                    f"in the model's context of {context_length} tokens. Fix: lower max_gen_toks "
                                    "(the task's generation_kwargs, or lm_eval --gen_kwargs max_gen_toks=N).")
            ids = (self.tok_encode(context) or [self.eot_token_id])[-(context_length - new):]
            groups.setdefault((new, temperature), []).append((n, ids, until))
        out = [""] * len(requests)
        for (new, temperature), members in groups.items():
            width = max(len(ids) for _, ids, _ in members)
            rows = []
            for j, (_, ids, _) in enumerate(members):
                prompt = np.zeros(width, np.int32)
                prompt[: len(ids)] = ids
                rows.append({"prompt": prompt, "length": np.int32(len(ids)), "id": np.int32(j)})
            made: dict[int, np.ndarray] = {}
            for local in process_batches(rows, global_batch(len(rows), self.ctx, self.batch_size)):
                local["length"] = np.maximum(local["length"], 1)  # blank padding rows stay in range
                tokens, ids = jax.device_get(self._generator(new, temperature)(self.state, to_global(self.ctx, local)))
                made.update({int(i): t for i, t in zip(ids, tokens) if i >= 0})
            for j, (n, _, until) in enumerate(members):
                tokens = made[j]
                stop = np.flatnonzero(tokens == self.eot_token_id)
                text = self.tok_decode(tokens[: stop[0]] if len(stop) else tokens)
                for marker in until:
                    if marker and marker in text:
                        text = text[: text.index(marker)]
                out[n] = text
                self.cache_hook.add_partial("generate_until", requests[n].args, text)
        return out

    def _generator(self, new: int, temperature: float) -> Any:
        key = (new, temperature)
        if key not in self._generators:
            init_cache = getattr(self.ctx.model, "init_cache", None)
            vocab = int(self.ctx.strategy.vocab_size)

            def run(state: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
                tokens = generate_tokens(state.apply_fn, state.variables(), batch["prompt"], batch["length"],
                                         batch["id"], max_new_tokens=new, temperature=temperature, seed=0, vocab=vocab,
                                         init_cache=init_cache)
                return tokens, batch["id"]

            self._generators[key] = jax.jit(run, out_shardings=replicated(self.ctx))
        return self._generators[key]
