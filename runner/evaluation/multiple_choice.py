"""Multiple-choice accuracy by log-likelihood, exactly as lm-evaluation-harness scores HellaSwag.

The data is a local JSONL file (the evaluator's `path`), one question per line:
``{"context": "A man is sitting on a roof. He", "choices": ["starts pulling up roofing.", ...],
"gold": 0}``. Each choice is scored as lm-eval scores a `multiple_choice` task: the sum of the
log-probabilities of the tokens of `delimiter + choice` given the context (`delimiter` is an
evaluator setting, lm-eval's `target_delimiter`, default one space; write the choices without
it), tokenized by lm-eval's rules (runner.evaluation.scoring.encode_pair), the context cut from
the left if both exceed train.seq_len. `acc` is how often the highest sum is the gold choice;
`acc_norm` divides each sum by the choice's length in characters, without the delimiter, as
lm-eval does, which removes the bias towards short choices. A choice that itself starts with
the (whitespace) delimiter is refused: it would be scored after two spaces. The first `rows`
questions of the file are used, in file order: the same ones every time. Metrics are
`<label>/acc`, `<label>/acc_norm` and `<label>/questions`, the label defaulting to the file's stem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from runner.errors import ConfigError
from runner.evaluation.base import EVALUATORS, EvaluatorBase, text_tokenizer
from runner.evaluation.scoring import Scorer, encode_pair
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


def delimiter_problem(questions: Sequence[Question], delimiter: str) -> str:
    """Why the choices and the delimiter do not go together ('' if they do)."""
    if not delimiter or delimiter.strip():
        return ""
    for n, q in enumerate(questions, start=1):
        for choice in q["choices"]:
            if choice[:1].isspace():
                return (f"choice {choice!r} of question {n} starts with whitespace, and the delimiter "
                        f"{delimiter!r} is put before every choice")
    return ""


def accuracies(loglikelihoods: Sequence[Sequence[float]], choices: Sequence[Sequence[str]],
               gold: Sequence[int]) -> tuple[float, float]:
    """(acc, acc_norm) as lm-eval computes them (acc_norm: per character of the choice); ties go
    to the first choice (argmax)."""
    acc = norm = 0.0
    for lls, texts, g in zip(loglikelihoods, choices, gold):
        lls = np.asarray(lls, np.float64)
        lengths = np.array([len(t) for t in texts], np.float64)
        acc += float(np.argmax(lls) == g)
        norm += float(np.argmax(lls / lengths) == g)
    n = max(len(gold), 1)
    return acc / n, norm / n


@EVALUATORS.register("multiple_choice")
class MultipleChoice(EvaluatorBase):
    """Multiple-choice accuracy by log-likelihood on a local JSONL file (`path`), as lm-eval scores it."""

    name = "multiple_choice"
    metrics = ("acc", "acc_norm", "questions")

    def __init__(self, spec: ExecutionSpec, settings: Optional[EvaluatorSpec] = None) -> None:
        super().__init__(spec, settings)
        self._questions: list[Question] | None = None
        self._batches: list[dict[str, np.ndarray]] = []
        self._scorer: Scorer | None = None
        self.loglikelihoods: list[np.ndarray] = []

    @classmethod
    def label_for(cls, settings: EvaluatorSpec) -> str:
        return settings.label or Path(settings.path).stem or "multiple_choice"

    @classmethod
    def check(cls, spec: ExecutionSpec, settings: EvaluatorSpec, key: str) -> None:
        problem = delimiter_problem(read_questions(settings.path, f"{key}.path"), settings.delimiter)
        if problem:
            raise ConfigError(f"{key}.path", settings.path, problem + ", so it would be scored after two.",
                              f"write the choices without the leading space (as lm-eval's doc_to_choice gives them), "
                              f"or set {key}.delimiter='' to score them as written.")

    def prepare(self, ctx: Any) -> None:
        if self._questions is not None:
            return
        key = self.config_key
        questions = read_questions(self.settings.path, f"{key}.path")[: self.rows]
        tokenizer = text_tokenizer(ctx, key)
        pairs = [encode_pair(tokenizer.encode, q["context"], self.settings.delimiter + choice, tokenizer.eod_id)
                 for q in questions for choice in q["choices"]]
        self._scorer = Scorer(ctx, self.spec.eval.batch_size, where=f"the questions of {self.settings.path} ({key})")
        self._batches = self._scorer.batches(pairs)
        self._questions = questions

    def evaluate(self, ctx: Any, state: Any) -> Mapping[str, float]:
        self.prepare(ctx)
        assert self._questions is not None and self._scorer is not None
        scores, _ = self._scorer.score(state, self._batches, sum(len(q["choices"]) for q in self._questions))
        lls, start = [], 0
        for q in self._questions:
            lls.append(scores[start: start + len(q["choices"])])
            start += len(q["choices"])
        self.loglikelihoods = lls  # per question, per choice: kept for inspection
        acc, acc_norm = accuracies(lls, [q["choices"] for q in self._questions], [q["gold"] for q in self._questions])
        return {self.key("acc"): acc, self.key("acc_norm"): acc_norm, self.key("questions"): float(len(lls))}
