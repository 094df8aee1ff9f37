"""A user's own model family, selected by import path (`job.model.family=tests.family_fixture:UnigramFamily`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.models.gpt.model import LOGICAL_AXIS_RULES
from tests.job_fixture import Unigram


@dataclass(frozen=True)
class UnigramConfig:
    vocab_size: int


class UnigramFamily:
    name = "unigram"

    @staticmethod
    def config(model: Any) -> UnigramConfig:
        return UnigramConfig(model.vocab_size)

    @staticmethod
    def module(config: UnigramConfig) -> Unigram:
        return Unigram(config.vocab_size)

    @staticmethod
    def axis_rules(config: UnigramConfig, mesh_shape: Any) -> Any:
        return LOGICAL_AXIS_RULES

    @staticmethod
    def param_count(config: UnigramConfig) -> int:
        return config.vocab_size

    @staticmethod
    def flops_per_token(config: UnigramConfig, seq_len: int) -> float:
        return 6.0 * config.vocab_size
