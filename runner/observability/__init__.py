"""What a run shows and records: the progress line and metrics (jsonl, wandb, TensorBoard),
throughput and MFU, goodput, the run card, profiling and per-layer debug figures."""
