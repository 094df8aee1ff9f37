"""runner: a job-spec driven, restorable pretraining runner for JAX language models."""

from runner.checkpoint.storage import configure_endpoint

__version__ = "0.1.0"

configure_endpoint()  # STORAGE_EMULATOR_HOST reaches every storage client, before any is imported
