"""Multiple-choice accuracy by log-likelihood, as lm-evaluation-harness scores HellaSwag.

The data is a local JSONL file (the evaluator's `path`), one question per line:
``{"context": "A man is sitting on a roof. He", "choices": [" starts pulling up roofing.", ...],
"gold": 0}``. Each choice is scored by the sum of the log-probabilities of its tokens given
the context (the context is cut from the left if context + choice exceed train.seq_len).
`acc` is how often the highest sum is the gold choice; `acc_norm` divides each sum by the
choice's length in UTF-8 bytes first (lm-eval divides by its length in characters, the same
for ASCII), which removes the bias towards short choices. The first `rows` questions of the
file are used, in file order: the same ones every time. Metrics are `<label>/acc`,
`<label>/acc_norm` and `<label>/questions`, the label defaulting to the file's stem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from runner.errors import ConfigError, UserError
from runner.evaluation.base import (EVALUATORS, EvaluatorBase, global_batch, process_batches, replicated,
                                    text_tokenizer, to_global)
from runner.spec import EvaluatorSpec, ExecutionSpec

Question = dict[str, Any]  # {"context": str, "choices": [str, ...], "gold": int}


def read_questions(path: str | Path, key: str) -> list[Question]:
    """Parse and check a multiple-choice JSONL file; a bad line is named by file and line number."""
    file = Path(path).expanduser()
    if not str(path):
        raise ConfigError(key, str(path), "multiple_choice needs a JSONL file of questions.",
                          f"set {key}=<file.jsonl> with lines like "
                          '{"context": "...", "choices": ["...", "..."], "gold": 0}.')
    if not file.is_file():
        raise ConfigError(key, str(path), f"there is no file at {file.resolve()}.",
                          "fix the path (relative paths are from the directory you run in).")
    questions: list[Question] = []
    for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            q = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(key, str(path), f"line {lineno} ({where}) is not valid JSON: {err.msg} at column "
                              f"{err.colno}.", "fix that line; each line is one JSON object.") from None
        problem = _question_problem(q)
        if problem:
            raise ConfigError(key, str(path), f"line {lineno} ({where}) {problem}.",
                              'write each line as {"context": "...", "choices": ["...", "..."], "gold": <index>}.')
        questions.append(q)
    if not questions:
        raise ConfigError(key, str(path), "the file holds no questions.", "add at least one line.")
    return questions


def _question_problem(q: Any) -> str:
    if not isinstance(q, dict):
        return "is not a JSON object"
    missing = [k for k in ("context", "choices", "gold") if k not in q]
    if missing:
        return f"lacks {', '.join(repr(k) for k in missing)}"
    if not isinstance(q["context"], str):
        return "has a `context` that is not a string"
    choices = q["choices"]
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        return "needs `choices`: a list of at least two non-empty strings"
    if isinstance(q["gold"], bool) or not isinstance(q["gold"], int) or not 0 <= q["gold"] < len(choices):
        return f"has `gold`={q['gold']!r}, which is not an index into its {len(choices)} choices"
    return ""


def choice_rows(context: list[int], choice: list[int], seq_len: int, eod_id: int) -> dict[str, np.ndarray]:
    """One scored row: inputs, targets and a mask over the choice's tokens (right-padded)."""
    if not context:  # lm-eval's rule: an empty context is the end-of-document token
        context = [eod_id]
    whole = (list(context) + list(choice))[-(seq_len + 1):]
    x, y = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32)
    mask = np.zeros(seq_len, np.float32)
    n = len(whole) - 1
    x[:n], y[:n] = whole[:-1], whole[1:]
    mask[n - len(choice): n] = 1.0
    return {"x": x, "y": y, "mask": mask}


def choice_scores(state: Any, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(sum of log p(target) over each row's masked tokens, the row ids), per row."""
    logits = state.apply_fn({"params": state.params}, batch["x"], deterministic=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]
    return jnp.sum(target * batch["mask"], axis=-1), batch["id"]


def accuracies(loglikelihoods: Sequence[Sequence[float]], choices: Sequence[Sequence[str]],
               gold: Sequence[int]) -> tuple[float, float]:
    """(acc, acc_norm) as lm-eval computes them; ties go to the first choice (argmax)."""
    acc = norm = 0.0
    for lls, texts, g in zip(loglikelihoods, choices, gold):
        lls = np.asarray(lls, np.float64)
        lengths = np.array([len(t.encode("utf-8")) for t in texts], np.float64)
        acc += float(np.argmax(lls) == g)
        norm += float(np.argmax(lls / lengths) == g)
    n = max(len(gold), 1)
    return acc / n, norm / n


@EVALUATORS.register("multiple_choice")
class MultipleChoice(EvaluatorBase):
    name = "multiple_choice"

    def __init__(self, spec: ExecutionSpec, settings: Optional[EvaluatorSpec] = None) -> None:
        super().__init__(spec, settings)
        self.label = self.settings.label or Path(self.settings.path).stem or "multiple_choice"
        self._questions: list[Question] | None = None
        self._batches: list[dict[str, np.ndarray]] = []
        self._fn: Any = None
        self.loglikelihoods: list[np.ndarray] = []

    @classmethod
    def check(cls, spec: ExecutionSpec, settings: EvaluatorSpec, key: str) -> None:
        read_questions(settings.path, f"{key}.path")

    def prepare(self, ctx: Any) -> None:
        if self._questions is not None:
            return
        key = self.config_key
        questions = read_questions(self.settings.path, f"{key}.path")[: self.rows]
        tokenizer = text_tokenizer(ctx, key)
        seq_len = self.spec.train.seq_len
        rows = []
        for n, q in enumerate(questions):
            context = [int(t) for t in tokenizer.encode(q["context"])]
            for j, choice in enumerate(q["choices"]):
                ids = [int(t) for t in tokenizer.encode(choice)]
                if len(ids) > seq_len:
                    raise UserError(
                        f"Choice {j} of question {n + 1} in {self.settings.path} ({key}.path) is {len(ids)} tokens, "
                        f"longer than train.seq_len={seq_len}, so it cannot be scored. Fix: shorten it, or "
                        "raise train.seq_len."
                    )
                rows.append({**choice_rows(context, ids, seq_len, tokenizer.eod_id), "id": np.int32(len(rows))})
        self._questions = questions
        self._batches = process_batches(rows, global_batch(len(rows), ctx, self.spec.eval.batch_size))

    def evaluate(self, ctx: Any, state: Any) -> Mapping[str, float]:
        self.prepare(ctx)
        assert self._questions is not None
        if self._fn is None:
            self._fn = jax.jit(choice_scores, out_shardings=replicated(ctx))
        scores = np.zeros(sum(len(q["choices"]) for q in self._questions), np.float64)
        for local in self._batches:
            sums, ids = jax.device_get(self._fn(state, to_global(ctx, local)))
            keep = ids >= 0
            scores[ids[keep]] = sums[keep]
        lls, start = [], 0
        for q in self._questions:
            lls.append(scores[start: start + len(q["choices"])])
            start += len(q["choices"])
        self.loglikelihoods = lls  # per question, per choice: kept for inspection
        acc, acc_norm = accuracies(lls, [q["choices"] for q in self._questions], [q["gold"] for q in self._questions])
        return {self.key("acc"): acc, self.key("acc_norm"): acc_norm, self.key("questions"): float(len(lls))}
