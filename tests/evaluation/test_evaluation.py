"""Evaluators: settings in config, each built-in's arithmetic on hand-worked cases, the KV-cache
decode path, a user's evaluator by import path, best-K checkpoints, and mode=eval giving the same
numbers on 4 fake devices as training did on 1."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_dir

from runner.errors import ConfigError, UserError
from runner.evaluation import build_evaluators
from runner.evaluation.base import EvalContext
from runner.evaluation.generate import Generate, generate_tokens
from runner.evaluation.heldout import HeldOutLoss
from runner.evaluation.multiple_choice import MultipleChoice
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.models.gpt.model import GPT, GPTConfig
from runner.spec import EvaluatorSpec, ExecutionSpec, register_schema, spec_from_dict
from runner.train.job import JOBS, load_job_modules
from runner.train.state import TrainState
from runner.train.steps import make_val_step, val_step
from tests.conftest import ROOT, TINY, read_metrics, run_runner

register_schema()
load_job_modules()


def spec_for(*overrides: str) -> ExecutionSpec:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=list(overrides)), list(overrides))


class EchoEvaluator:
    """A user's own evaluator (plain class, no runner base): selected by import path in tests."""

    name = "echo"

    def __init__(self, spec: ExecutionSpec, settings: EvaluatorSpec) -> None:
        self.every = settings.every
        self.scale = float(settings.options["scale"])
        self._step = -1

    def evaluate(self, trainer: Any, state: Any) -> Mapping[str, float]:
        self._step = int(state.step)
        total = sum(float(np.abs(leaf).sum()) for leaf in jax.device_get(jax.tree.leaves(state.params)))
        return {"echo/scaled_step": self.scale * self._step, "echo/param_abs_sum": total}

    def texts(self) -> Mapping[str, str]:
        return {"echo/note": f"seen step {self._step}"}


# ----------------------------------------------------------------------------- settings


def test_evaluator_entries_are_names_or_mappings_with_settings() -> None:
    spec = spec_for("eval.every=7", "eval.evaluators=[heldout,{name:generate,prompts:['a b',c],every:3,"
                    "temperature:0.5},{name:'tests.evaluation.test_evaluation:EchoEvaluator',options:{scale:2}}]")
    heldout, gen, echo = spec.eval.evaluators
    assert heldout == EvaluatorSpec(name="heldout")
    assert (gen.name, gen.prompts, gen.every, gen.temperature) == ("generate", ("a b", "c"), 3, 0.5)
    assert echo.options == {"scale": 2}
    hash(spec)
    assert spec_from_dict(spec.to_dict()) == spec  # what checkpoints save comes back the same
    evaluators = build_evaluators(spec)  # each built with (spec, its settings)
    assert [getattr(e, "every", None) for e in evaluators] == [7, 3, None]
    assert isinstance(evaluators[2], EchoEvaluator) and evaluators[2].scale == 2.0
    assert evaluators[0].rows == spec.eval.rows


@pytest.mark.parametrize("value, key, needle", [
    ("[nonesuch]", "eval.evaluators[0].name", "generate, heldout, lm_eval, multiple_choice"),
    ("['no_such_pkg.mod:Eval']", "eval.evaluators[0].name", "generate, heldout, lm_eval, multiple_choice"),
    ("[{name:heldout,evry:3}]", "eval.evaluators[0].evry", "every"),
    ("[{name:heldout,every:soon}]", "eval.evaluators[0].every", "soon"),
    ("[{every:3}]", "eval.evaluators[0]", "name"),
    ("[{name:generate}]", "eval.evaluators[0].prompts", "at least one prompt"),
    ("[{name:multiple_choice,path:missing.jsonl}]", "eval.evaluators[0].path", "no file"),
])
def test_bad_evaluator_settings_name_key_and_fix(value: str, key: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        spec_for(f"eval.evaluators={value}")
    assert info.value.key == key
    assert needle in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize("line, needle", [
    ('{"context": "a", "choices": ["b", "c"], "gold": 0', "not valid JSON"),
    ('{"context": "a", "choices": ["b", "c"], "gold": 2}', "not an index"),
    ('{"context": "a", "choices": ["b"], "gold": 0}', "at least two"),
    ('{"choices": ["b", "c"], "gold": 0}', "lacks 'context'"),
])
def test_malformed_jsonl_line_is_named_by_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    good = '{"context": "a", "choices": ["b", "c"], "gold": 0}'
    path = tmp_path / "mc.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ConfigError) as info:
        spec_for(f"eval.evaluators=[{{name:multiple_choice,path:'{path}'}}]")
    assert f"{path}:3" in str(info.value) and needle in str(info.value)
    assert info.value.key == "eval.evaluators[0].path"


def test_choices_that_start_with_the_delimiter_are_refused(tmp_path: Path) -> None:
    # The old format put lm-eval's delimiter inside the choices; with the delimiter added too they
    # would be scored after two spaces. delimiter='' scores them as written.
    path = tmp_path / "mc.jsonl"
    path.write_text('{"context": "He", "choices": [" ran.", " sat."], "gold": 0}\n')
    with pytest.raises(ConfigError) as info:
        spec_for(f"eval.evaluators=[{{name:multiple_choice,path:'{path}'}}]")
    assert info.value.key == "eval.evaluators[0].path" and "after two" in str(info.value)
    assert "delimiter=''" in str(info.value)
    spec = spec_for(f"eval.evaluators=[{{name:multiple_choice,path:'{path}',delimiter:''}}]")
    assert spec.eval.evaluators[0].delimiter == ""


def test_keep_best_needs_a_metric() -> None:
    with pytest.raises(ConfigError) as info:
        spec_for("checkpoint.keep_best=2")
    assert info.value.key == "checkpoint.best_metric"
    with pytest.raises(ConfigError):
        spec_for("checkpoint.keep_best=2", "checkpoint.best_metric=eval/stdlib/loss", "checkpoint.best_mode=low")


# ----------------------------------------------------------------------------- arithmetic


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A real GPT trainer on the embedded byte-level corpus (one device, no state yet)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RUNNER_CACHE", str(tmp_path_factory.getbasetemp() / "runner-cache"))
    spec = spec_for(*TINY, f"run.dir={tmp_path_factory.mktemp('run')}")
    yield JOBS.get(spec.job.trainer)(spec)
    mp.undo()


def table_model(trainer: Any, logp: np.ndarray) -> tuple[EvalContext, TrainState]:
    """A 'model' whose next-token log-probabilities are row `logp[current token]`, and the small
    context an evaluator sees (the trainer's mesh, data and device placement; this model's
    validation step)."""

    def apply_fn(variables: Any, x: jax.Array, deterministic: bool = True) -> jax.Array:
        return variables["params"]["table"][x]

    state = TrainState.create(apply_fn=apply_fn, params={"table": jnp.asarray(logp, jnp.float32)},
                              tx=optax.sgd(0.0), rng=jax.random.PRNGKey(0))
    replicated = jax.tree.map(lambda _: jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec()), state)
    ctx = EvalContext(spec=trainer.spec, mesh=trainer.mesh, strategy=trainer.strategy,
                      val_step=make_val_step(val_step, replicated, trainer.mesh), to_device=trainer.program.to_device)
    return ctx, state


def test_heldout_loss_perplexity_bits_and_accuracy_by_hand(trainer) -> None:
    # Next token is (t + 1) mod V with probability 1/2, each other token with 1/(2 (V - 1)).
    V = 257
    logp = np.full((V, V), math.log(0.5 / (V - 1)))
    logp[np.arange(V), (np.arange(V) + 1) % V] = math.log(0.5)
    ctx, state = table_model(trainer, logp)
    evaluator = HeldOutLoss(trainer.spec, EvaluatorSpec(name="heldout", rows=10))
    got = evaluator.evaluate(ctx, state)

    windows = trainer.strategy.validation(trainer.spec.train.seq_len, 10)["stdlib"]
    x = np.stack([windows[i]["x"] for i in range(10)])
    y = np.stack([windows[i]["y"] for i in range(10)])
    hits, n = int(np.sum(y == (x + 1) % V)), y.size
    loss = (hits * math.log(2) + (n - hits) * math.log(2 * (V - 1))) / n
    assert got["stdlib/loss"] == pytest.approx(loss, rel=1e-5)
    assert got["stdlib/perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert got["stdlib/bits_per_byte"] == pytest.approx(loss / math.log(2), rel=1e-5)  # 1 byte per token
    assert got["stdlib/accuracy"] == pytest.approx(hits / n)  # the argmax is always t + 1

    trainer.strategy.bytes_per_token = 4.0  # a tokenizer whose tokens average 4 bytes
    try:
        four = evaluator.evaluate(ctx, state)
        assert four["stdlib/bits_per_byte"] == pytest.approx(loss / math.log(2) / 4, rel=1e-5)
        trainer.strategy.bytes_per_token = None  # unknown bytes: bits per token, never mislabelled
        trainer.strategy.tokenizer = "hf"
        unknown = evaluator.evaluate(ctx, state)
        assert "stdlib/bits_per_byte" not in unknown
        assert unknown["stdlib/bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-5)
    finally:
        del trainer.strategy.bytes_per_token
        trainer.strategy.tokenizer = "byte"


def test_val_step_sums_accuracy_over_micro_batches(trainer) -> None:
    rng = np.random.default_rng(0)
    V = 257
    _, state = table_model(trainer, np.log(rng.dirichlet(np.ones(V), size=V)))
    batch = {"x": rng.integers(0, V, (8, 16)), "y": rng.integers(0, V, (8, 16)), "mask": np.ones((8, 16))}
    batch["y"][:, ::2] = np.argmax(np.asarray(state.params["table"]), -1)[batch["x"][:, ::2]]  # half right
    one = jax.jit(type(trainer).val_step)(state, {k: jnp.asarray(v)[None] for k, v in batch.items()})
    four = jax.jit(type(trainer).val_step)(state, {k: jnp.asarray(v).reshape(4, 2, 16) for k, v in batch.items()})
    assert float(one[2]["correct"]) == float(four[2]["correct"]) >= 64
    np.testing.assert_allclose(one[0], four[0], rtol=1e-6)


def test_multiple_choice_sums_and_acc_norm_by_hand(trainer, tmp_path: Path) -> None:
    # Question 1: after "a", "b" has p=.3 and "ccc" has p=.2*.6*.6: the raw sum picks "b",
    # per byte "ccc" wins (-0.877 > -1.204); gold is "ccc", so acc 0 and acc_norm 1.
    # Question 2: "b" (p=.3) against "d" (p=.1): both pick "b", the gold.
    V = 257
    a, b, c, d = (ord(ch) for ch in "abcd")
    p = np.full((V, V), 1.0 / V)  # each row sums to 1, so log p are the log-probabilities
    p[a], p[c] = 0.4 / (V - 3), 0.4 / (V - 1)  # what the named entries leave, spread evenly
    p[a, [b, c, d]], p[c, c] = [0.3, 0.2, 0.1], 0.6
    ctx, state = table_model(trainer, np.log(p))
    path = tmp_path / "tiny.jsonl"
    path.write_text('{"context": "a", "choices": ["b", "ccc"], "gold": 1}\n'
                    '{"context": "a", "choices": ["b", "d"], "gold": 0}\n')
    spec = dataclasses.replace(trainer.spec, eval=dataclasses.replace(
        trainer.spec.eval, evaluators=(EvaluatorSpec(name="multiple_choice", path=str(path), delimiter=""),)))
    evaluator = MultipleChoice(spec, spec.eval.evaluators[0])
    got = evaluator.evaluate(ctx, state)
    np.testing.assert_allclose(evaluator.loglikelihoods[0], [math.log(0.3), math.log(0.2 * 0.6 * 0.6)], rtol=1e-5)
    np.testing.assert_allclose(evaluator.loglikelihoods[1], [math.log(0.3), math.log(0.1)], rtol=1e-5)
    assert got == {"tiny/acc": 0.5, "tiny/acc_norm": 1.0, "tiny/questions": 2.0}


def test_a_prompt_longer_than_the_context_is_a_user_error(trainer) -> None:
    settings = EvaluatorSpec(name="generate", prompts=("x" * 30,), max_new_tokens=8)
    spec = dataclasses.replace(trainer.spec, eval=dataclasses.replace(trainer.spec.eval, evaluators=(settings,)))
    with pytest.raises(UserError) as info:
        Generate(spec, settings).prepare(trainer.eval_context())
    message = str(info.value)
    assert "eval.evaluators[0].prompts" in message and "38 positions" in message and "context of 32" in message
    assert "Fix:" in message


# ----------------------------------------------------------------------------- decoding


def random_params(model: GPT, scale: float, seed: int = 0) -> Any:
    """Random weights of the model's shapes (LayerNorm scales too), without compiling an init."""
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, scale, s.shape), s.dtype), shapes)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_kv_cache_decode_gives_the_full_forward_logits(scan_layers: bool) -> None:
    cfg = GPTConfig(vocab_size=61, context_length=16, d_model=32, n_layers=2, n_heads=4, scan_layers=scan_layers)
    model = GPT(cfg)
    apply = jax.jit(model.apply)
    tokens = jax.random.randint(jax.random.key(0), (3, 12), 0, cfg.vocab_size)
    params = random_params(model, 0.1)
    full = apply({"params": params}, tokens)
    # A 5-token prompt at once (rows starting at different positions), then one token at a time.
    start = jnp.array([0, 0, 0])
    logits, cache = apply({"params": params}, tokens[:, :5], cache=model.init_cache(3, 16), index=start)
    parts = [logits]
    for t in range(5, 12):
        logits, cache = apply({"params": params}, tokens[:, t:t + 1], cache=cache, index=jnp.full(3, t))
        parts.append(logits)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, atol=1e-5)
    assert jax.tree.map(jnp.shape, cache) == {"key": (2, 3, 16, 4, 8), "value": (2, 3, 16, 4, 8)}


def test_greedy_generation_is_the_argmax_of_the_full_forward() -> None:
    cfg = GPTConfig(vocab_size=64, context_length=24, d_model=32, n_layers=2, n_heads=4)
    model = GPT(cfg)
    params = random_params(model, 0.3)  # large weights, sharp logits: no near-ties
    prompts = jnp.array([[5, 9, 2, 0, 0], [7, 1, 3, 3, 8]], jnp.int32)  # lengths 3 and 5, right-padded
    lengths, ids = jnp.array([3, 5]), jnp.arange(2)

    def generator(cache: bool, temperature: float) -> Any:
        return jax.jit(lambda p, seed: generate_tokens(model.apply, {"params": p}, prompts, lengths, ids,
                                                       max_new_tokens=6, vocab=50, temperature=temperature, seed=seed,
                                                       init_cache=model.init_cache if cache else None))

    greedy = generator(True, 0.0)
    tokens = np.asarray(greedy(params, 0))
    np.testing.assert_array_equal(tokens, greedy(params, 1))  # deterministic; the seed plays no part
    np.testing.assert_array_equal(tokens, generator(False, 0.0)(params, 0))  # KV cache == full forward each step
    full = jax.jit(model.apply)
    for row, length in enumerate([3, 5]):
        seq = np.zeros((1, 11), np.int32)
        seq[0, :length] = prompts[row, :length]
        for i, token in enumerate(tokens[row]):
            logits = full({"params": params}, seq)[0, length + i - 1, :50]  # causal: later zeros don't matter
            assert token == int(jnp.argmax(logits))
            seq[0, length + i] = token
    sample = generator(True, 1.0)
    sampled = np.asarray(sample(params, 0))
    np.testing.assert_array_equal(sampled, sample(params, 0))  # the same seed, the same samples
    assert not np.array_equal(sampled, sample(params, 1))
    assert sampled.max() < 50 and not np.array_equal(sampled, tokens)


# ----------------------------------------------------------------------------- end to end


MC_LINES = [
    {"context": "import os\nimport", "choices": ["sys", "zzqx"], "gold": 0},
    {"context": "def main(", "choices": ["):", "]]]"], "gold": 0},
    {"context": "", "choices": ["the", "xq"], "gold": 1},
]
# Sampled (not greedy) text: its keys must not depend on the topology's padding or row layout.
EVALUATORS = ("eval.evaluators=[heldout,{name:multiple_choice,path:mc.jsonl,every:2},"
              "{name:generate,prompts:['def ','import','x'],temperature:1.0,max_new_tokens:6,every:0},"
              "{name:'tests.evaluation.test_evaluation:EchoEvaluator',every:1,options:{scale:3}}]")


PYTHONPATH = {"PYTHONPATH": str(ROOT)}  # so `tests.evaluation.test_evaluation` imports in the subprocesses


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """A 4-step run on 1 device with every kind of evaluator: (its directory, eval records by step)."""
    tmp = tmp_path_factory.mktemp("evaluated")
    (tmp / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in MC_LINES))
    train = run_runner([*TINY, "run.dir=run", "train.steps=4", "eval.every=2", "checkpoint.every_steps=2",
                        "optimizer.lr=1e-2", EVALUATORS, "checkpoint.keep=1", "checkpoint.keep_best=1",
                        "checkpoint.best_metric=stdlib/loss", "checkpoint.best_mode=max"], tmp, **PYTHONPATH)
    assert train.returncode == 0, train.stderr[-3000:]
    evals = {r["step"]: r for r in read_metrics(tmp / "run") if any(k.startswith("eval/") for k in r)}
    return tmp, evals


@pytest.mark.e2e
def test_each_evaluator_runs_at_its_cadence_and_best_k_is_kept(trained) -> None:
    tmp, evals = trained
    has = lambda key: sorted(s for s, r in evals.items() if key in r)
    assert has("eval/echo/scaled_step") == [0, 1, 2, 3, 4]  # each evaluator at its own cadence
    assert has("eval/stdlib/loss") == [0, 2, 4] and has("eval/mc/acc_norm") == [0, 2, 4]
    assert has("eval/generate/sample_0") == has("eval/generate/sample_2") == [0, 4]  # start and end only
    assert evals[3]["eval/echo/scaled_step"] == 9.0 and evals[3]["eval/echo/note"] == "seen step 3"
    assert evals[4]["eval/generate/sample_1"].startswith("import")

    # Best-K: the newest checkpoint (keep=1) plus the one with the highest held-out loss; the
    # final checkpoint carries the final evaluation's value.
    best_step = max((2, 4), key=lambda s: evals[s]["eval/stdlib/loss"])
    checkpoints = tmp / "run" / "checkpoints"
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == sorted({best_step, 4})
    for step in {best_step, 4}:
        saved = json.loads((checkpoints / str(step) / "metrics" / "metrics").read_text())
        assert saved == {"eval/stdlib/loss": evals[step]["eval/stdlib/loss"]}
    meta = json.loads((checkpoints / "4" / "meta" / "metadata").read_text())
    assert meta["best"] == {"metric": "eval/stdlib/loss", "mode": "max", "step": best_step,
                            "value": evals[best_step]["eval/stdlib/loss"]}


def assert_same_as_training(record: dict[str, Any], evals: dict[int, dict[str, Any]]) -> None:
    """mode=eval's results equal the 1-device evaluation at the end of training."""
    trained = {k: v for k, v in evals[4].items() if k != "step"}
    assert record["step"] == 4
    assert set(record["metrics"]) | set(record["texts"]) == set(trained)
    for key, value in record["metrics"].items():
        assert value == pytest.approx(trained[key], rel=1e-5, abs=1e-6), key
    assert record["texts"] == {k: v for k, v in trained.items() if isinstance(v, str)}


@pytest.mark.deep
def test_mode_eval_on_four_devices_gives_the_training_numbers(trained) -> None:
    # Parameters only (the model comes from the checkpoint, not TINY); a stale file is replaced.
    tmp, evals = trained
    results = tmp / "run" / "checkpoints" / "4" / "eval_results.json"
    results.write_text("stale")
    again = run_runner(["mode=eval", "eval.checkpoint=run", "topology=cpu-4", "mesh.data=2", "mesh.fsdp=2",
                        "eval.rows=16", "eval.batch_size=8", "logging.wandb=disabled", EVALUATORS],
                       tmp, devices=4, **PYTHONPATH)
    assert again.returncode == 0, again.stderr[-3000:]
    record = json.loads(results.read_text())
    assert (record["devices"], record["processes"]) == (4, 1)
    assert_same_as_training(record, evals)
    assert "Evaluated" in again.stdout and not (tmp / "run" / "checkpoints" / "5").exists()


@pytest.mark.deep
def test_mode_eval_in_two_processes_gives_the_training_numbers(trained) -> None:
    from tests.train.test_multiprocess import finish, launch

    tmp, evals = trained
    results = tmp / "run" / "checkpoints" / "4" / "eval_results.json"
    results.unlink(missing_ok=True)
    outcomes = finish(launch(["mode=eval", "run.dir=run", "mesh.data=2", "mesh.fsdp=2", "eval.rows=16",
                              "eval.batch_size=8", "logging.wandb=disabled", EVALUATORS], tmp, **PYTHONPATH))
    for code, _, stderr in outcomes:
        assert code == 0, stderr[-3000:]
    record = json.loads(results.read_text())
    assert (record["devices"], record["processes"]) == (4, 2)
    assert_same_as_training(record, evals)
    assert "Evaluated" in outcomes[0][1] and "Evaluated" not in outcomes[1][1]  # one writer


@pytest.mark.parametrize("args, needle", [
    (["mode=eval", "run.dir=nowhere"], "mode=eval found no checkpoint"),
    (["eval.evaluators=[{name:multiple_choice,path:bad.jsonl}]"], "bad.jsonl:2"),
])
@pytest.mark.deep
def test_eval_user_errors_exit_2_without_traceback(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n{"context": \n')
    result = run_runner([*TINY, *args], tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert needle in result.stderr and "Fix:" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_best_k_ranking_survives_reopening_the_checkpoints(tmp_path: Path) -> None:
    from runner.checkpoint.checkpointer import Checkpointer
    from runner.spec import CheckpointSpec

    spec = CheckpointSpec(every_steps=0, keep=1, keep_best=2, best_metric="stdlib/loss", best_mode="min")
    state = {"x": jnp.ones(3)}

    def save(checkpointer: Checkpointer, step: int, loss: float | None) -> None:
        if loss is not None:  # an evaluation of the best metric at this step
            checkpointer.policy.note_evaluation(step, {"eval/stdlib/loss": loss}, complete=True)
        assert checkpointer.save(step, state, lambda: {})

    first = Checkpointer(tmp_path, spec)
    for step, loss in [(1, 3.0), (2, 1.0), (3, None), (4, 2.0)]:  # step 3: saved between evaluations
        save(first, step, loss)
    first.close()
    assert first.steps() == [2, 4]  # the two lowest losses; 4 is also the newest
    again = Checkpointer(tmp_path, spec)  # a resumed run: the ranking is read back from disk
    save(again, 5, 5.0)
    again.close()
    assert again.steps() == [2, 4, 5]
    again = Checkpointer(tmp_path, spec)
    save(again, 6, 0.5)
    again.close()
    assert again.steps() == [2, 6]


def test_run_objective_must_be_a_metric_the_run_logs(tmp_path: Path) -> None:
    """A sweep's objective that nothing logs would make every member return NaN: refused before
    training, naming the evaluators that would log it; what is logged is accepted."""
    spec = spec_for
    questions = tmp_path / "hella.jsonl"
    questions.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    with pytest.raises(ConfigError) as info:
        spec("run.objective=eval/mc/acc")  # docs/sweeps.md's example, without its evaluator
    assert info.value.key == "run.objective" and "multiple_choice" in str(info.value)
    assert "eval/stdlib/loss" in str(info.value)  # what the configured ones log
    for ok in ("eval/stdlib/loss", "eval/stdlib/perplexity", "loss", "mfu", "goodput/percent"):
        assert spec(f"run.objective={ok}").run.objective == ok
    mc = f"eval.evaluators=[heldout,{{name:multiple_choice,path:{questions}}}]"
    assert spec(mc, "run.objective=eval/hella/acc_norm")  # the label is the file's stem
    labelled = f"eval.evaluators=[{{name:multiple_choice,path:{questions},label:mc}}]"
    assert spec(labelled, "run.objective=eval/mc/acc")
    for bad in ("eval/hella/accuracy", "eval/mc/acc", "lss"):
        with pytest.raises(ConfigError) as info:
            spec(mc, f"run.objective={bad}")
        assert info.value.key == "run.objective"
    # an evaluator that does not say what it logs (a user's) may log anything
    echo = "eval.evaluators=[heldout,{name:'tests.evaluation.test_evaluation:EchoEvaluator',options:{scale:2}}]"
    assert spec(echo, "run.objective=eval/echo/scaled_step")
