"""lm-eval's `--model runner` (runner.main.lm_eval) in-process, over the fast tier's own checkpoint.
(lm-eval's command line on it, and its agreement with runner's evaluators: tests/evaluation/test_lm_eval.py.)"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from lm_eval.api.instance import Instance  # the test extra pins lm_eval: a broken install fails


def test_a_checkpoint_as_lm_evals_model_in_process(trained_run) -> None:
    """runner.main.lm_eval's CheckpointLM (lm-eval's `--model runner`) over the fast tier's own
    checkpoint: a continuation's log-likelihood is the sum of a plain forward pass's log-probs."""
    from runner.main.lm_eval import CheckpointLM

    _, run_dir = trained_run
    lm = CheckpointLM(checkpoint=str(run_dir), overrides="run.compile_cache=none", batch_size=4)
    try:
        context, continuation = "def add(a, b):", " return a + b"
        (got, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
        tokens = lm.tok_encode(context + continuation)
        n = len(lm.tok_encode(continuation))
        logits = lm.state.apply_fn({"params": lm.state.params}, jnp.asarray([tokens[:-1]], jnp.int32),
                                   deterministic=True)[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))[-n:]
        by_hand = float(jnp.sum(logp[jnp.arange(n), jnp.asarray(tokens[-n:])]))
        assert math.isclose(got, by_hand, rel_tol=1e-5) and got < 0 and isinstance(greedy, bool)
        info = lm.get_model_info()
        assert info["runner_step"] == 4 and info["runner_checkpoint"].endswith("checkpoints/4")
    finally:
        lm.close()
