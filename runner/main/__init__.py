"""Entry points: the command (cli), config composition, sweeps, export, plot, mode=eval, and
lm-eval's `--model runner`. The top layer: nothing in runner imports from here."""
