"""runner: a job-spec driven, restorable pretraining runner for JAX language models."""

__version__ = "0.1.0"
