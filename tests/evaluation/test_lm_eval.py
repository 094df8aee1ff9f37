"""lm-evaluation-harness both ways: lm-eval scores runner checkpoints (its own command line and
its Python API, through the adapter it discovers), and runner runs lm-eval tasks as an
evaluator, in the loop and in mode=eval. The same questions give the same acc and acc_norm as
runner's `multiple_choice`, including HellaSwag's delimiter case. Everything is local: task
YAMLs over JSONL files, HF datasets offline."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, TINY, mc_task_yaml, read_metrics, run_runner, runner_env

import lm_eval  # noqa: E402  (the test extra pins lm_eval: a broken install fails, never skips)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from runner.errors import ConfigError, UserError  # noqa: E402
from runner.evaluation.generate import Generate  # noqa: E402
from runner.evaluation.harness import LmEval  # noqa: E402
from runner.evaluation.multiple_choice import MultipleChoice  # noqa: E402
from runner.evaluation.scoring import encode_pair  # noqa: E402
from runner.spec import EvaluatorSpec  # noqa: E402

# HellaSwag-style: a context, then endings of different lengths (so acc_norm can differ from acc),
# written without the leading space that lm-eval's target_delimiter adds.
QUESTIONS = [
    {"context": "A man is sitting on a roof. He", "choices": ["starts pulling up roofing.", "is a cat.",
                                                              "laughs", "begins to import os and sys."], "gold": 0},
    {"context": "def main(", "choices": ["):", "]]]", "argv):", "x"], "gold": 2},
    {"context": "import os\nimport", "choices": ["sys", "zzqx", "os.path"], "gold": 0},
    {"context": "The cat sat on the", "choices": ["mat.", "roof of the house.", "qqq", "dog"], "gold": 0},
    {"context": "for i in", "choices": ["range(10):", "xs:", "!!", "the"], "gold": 0},
    {"context": "", "choices": ["the", "xq"], "gold": 1},
]
GEN_DOCS = [{"context": "def ", "answer": "main"}, {"context": "import", "answer": " os"}]
TEXTS = [{"text": "import os\nimport sys\n"}, {"text": "def main():\n    return 0\n" * 4}]  # the 2nd: 3 windows

TASKS = {
    "mini_gen": """task: mini_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/gen.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 6}}
metric_list: [{{metric: exact_match}}]
""",
    "mini_ppl": """task: mini_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/ppl.jsonl}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
""",
}
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
LM_EVALUATORS = ("eval.evaluators=[{name:multiple_choice,path:mc.jsonl,label:mc},"
                 "{name:lm_eval,tasks:[mini_mc],include_path:tasks,label:harness}]")


def write_lines(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 30-step tiny run whose evaluations include lm-eval's task and runner's own copy of it;
    the working directory also holds the task YAMLs and their data."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    write_lines(tmp / "mc.jsonl", QUESTIONS)
    write_lines(tmp / "gen.jsonl", GEN_DOCS)
    write_lines(tmp / "ppl.jsonl", TEXTS)
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "mini_mc.yaml").write_text(mc_task_yaml("mini_mc", tmp / "mc.jsonl"))
    for name, text in TASKS.items():
        (tmp / "tasks" / f"{name}.yaml").write_text(text.format(dir=tmp))
    done = run_runner([*TINY, "run.dir=run", "train.steps=30", "eval.every=15", "optimizer.lr=1e-2", LM_EVALUATORS],
                      tmp, HF_HOME=str(tmp / "hf"), **OFFLINE)
    assert done.returncode == 0, done.stderr[-3000:]
    # no third-party noise: datasets' progress bar, lm-eval's notes on the defaults it filled in
    for noise in ("Generating test split", "examples/s", "aggregation is not", "higher_is_better is not", "\x1b["):
        assert noise not in done.stderr, done.stderr[-3000:]
    return tmp


@pytest.fixture(scope="module")
def model(trained: Path, monkeypatch_module: Any) -> Any:
    """The final checkpoint as lm-eval's model, built the way lm-eval's registry builds it."""
    for key, value in {**OFFLINE, "HF_HOME": str(trained / "hf")}.items():
        monkeypatch_module.setenv(key, value)
    monkeypatch_module.chdir(trained)
    from lm_eval.api.registry import get_model

    lm = get_model("runner").create_from_arg_string(
        f"checkpoint={trained / 'run'},overrides=run.compile_cache=none", {"batch_size": 4})
    yield lm
    lm.close()  # leaves the job's mesh context: later tests in this process start clean


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.deep
def test_lm_eval_in_the_loop_equals_runners_multiple_choice(trained: Path) -> None:
    evals = [r for r in read_metrics(trained / "run") if "eval/mc/acc" in r]
    assert [r["step"] for r in evals] == [0, 15, 30]
    for r in evals:
        assert r["eval/harness/mini_mc/acc"] == r["eval/mc/acc"]
        assert r["eval/harness/mini_mc/acc_norm"] == r["eval/mc/acc_norm"]
    assert len({(r["eval/mc/acc"], r["eval/mc/acc_norm"]) for r in evals}) > 1, "training changed nothing"


@pytest.mark.deep
def test_runner_and_lm_eval_score_the_same_choices_alike(model: Any, trained: Path) -> None:
    # One forward path (runner.evaluation.scoring) behind both, and lm-eval's own tokenization
    # rules: the per-choice log-likelihoods agree, so acc and acc_norm must.
    spec = model.ctx.spec
    ours = MultipleChoice(spec, EvaluatorSpec(name="multiple_choice", path=str(trained / "mc.jsonl")))
    got = ours.evaluate(model.ctx, model.state)
    out = lm_eval.simple_evaluate(model=model, tasks=["mini_mc"], bootstrap_iters=0, log_samples=True,
                                  task_manager=TaskManager(include_path=str(trained / "tasks"), include_defaults=False))
    theirs = out["results"]["mini_mc"]
    assert (theirs["acc,none"], theirs["acc_norm,none"]) == (got["mc/acc"], got["mc/acc_norm"])
    samples = sorted(out["samples"]["mini_mc"], key=lambda s: s["doc_id"])
    for sample, lls in zip(samples, ours.loglikelihoods, strict=True):
        np.testing.assert_allclose([float(r[0][0]) for r in sample["resps"]], lls, rtol=1e-6)
    # The scores differ by choice (no degenerate model), and acc_norm differs from acc somewhere.
    assert len({round(float(x), 4) for lls in ours.loglikelihoods for x in lls}) > 10

    # The old format put the delimiter into the choices (delimiter=''): the same text is scored,
    # so the log-likelihoods are the same, but acc_norm then counts the space in each length.
    spaced = trained / "mc_spaced.jsonl"
    write_lines(spaced, [{**q, "choices": [" " + c for c in q["choices"]]} for q in QUESTIONS])
    old = MultipleChoice(spec, EvaluatorSpec(name="multiple_choice", path=str(spaced), delimiter=""))
    old.evaluate(model.ctx, model.state)
    for a, b in zip(old.loglikelihoods, ours.loglikelihoods):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.deep
def test_generation_and_rolling_loglikelihood_match_runners_own(model: Any) -> None:
    # generate_until: the same greedy text as runner's `generate` evaluator.
    prompts = ["def ", "import", "The cat"]
    settings = EvaluatorSpec(name="generate", prompts=tuple(prompts), max_new_tokens=6, temperature=0.0)
    generate = Generate(model.ctx.spec, settings)
    generate.evaluate(model.ctx, model.state)
    requests = [Instance("generate_until", {}, (p, {"until": ["\x00"], "max_gen_toks": 6}), i)
                for i, p in enumerate(prompts)]
    made = model.generate_until(requests)
    assert [p + m for p, m in zip(prompts, made)] == [generate.texts()[f"generate/sample_{i}"] for i in range(3)]

    # loglikelihood_rolling: the sum over lm-eval's disjoint windows, computed here by a plain
    # forward pass per window (seq_len 32; 100 tokens: predictions 0-31, 32-63, 64-95, 96-99).
    text = TEXTS[1]["text"]
    tokens = model.tok_encode(text)
    assert len(tokens) == 100
    eot, params, apply = model.eot_token_id, model.state.params, model.state.apply_fn

    def window(inputs: list[int], targets: list[int]) -> float:
        logits = apply({"params": params}, jnp.asarray([inputs], jnp.int32), deterministic=True)[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))[-len(targets):]
        return float(jnp.sum(logp[jnp.arange(len(targets)), jnp.asarray(targets)]))

    by_hand = (window([eot] + tokens[:31], tokens[:32]) + window(tokens[31:63], tokens[32:64])
               + window(tokens[63:95], tokens[64:96]) + window(tokens[67:99], tokens[96:100]))
    got = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert math.isclose(got[0], by_hand, rel_tol=1e-5)


@pytest.mark.deep
def test_lm_evals_command_line_scores_a_runner_checkpoint(trained: Path) -> None:
    # On 2 devices: the same numbers as the 1-device run's own evaluation.
    out = trained / "lm_eval_out"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lm_eval"), "--model", "runner", "--model_args",
         "checkpoint=run,overrides=topology=cpu-2", "--tasks", "mini_mc,mini_gen,mini_ppl", "--include_path",
         "tasks", "--batch_size", "4", "--output_path", str(out)],
        cwd=trained, env=runner_env(trained, devices=2, HF_HOME=str(trained / "hf"), **OFFLINE), capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    final = [r for r in read_metrics(trained / "run") if "eval/mc/acc" in r][-1]
    assert results["mini_mc"]["acc,none"] == final["eval/mc/acc"]
    assert results["mini_mc"]["acc_norm,none"] == final["eval/mc/acc_norm"]
    assert 0.0 <= results["mini_gen"]["exact_match,none"] <= 1.0
    assert 0.0 < results["mini_ppl"]["bits_per_byte,none"] < 16.0

    # mode=eval runs the same evaluator on the same checkpoint.
    evaluated = run_runner(["mode=eval", "eval.checkpoint=run", "logging.wandb=disabled", LM_EVALUATORS], trained,
                           HF_HOME=str(trained / "hf"), **OFFLINE)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    record = json.loads((trained / "run" / "checkpoints" / "30" / "eval_results.json").read_text())
    assert record["metrics"]["eval/harness/mini_mc/acc"] == results["mini_mc"]["acc,none"]
    assert record["metrics"]["eval/harness/mini_mc/acc_norm"] == results["mini_mc"]["acc_norm,none"]


@pytest.mark.deep
def test_lm_eval_mistakes_are_one_paragraph(trained: Path, model: Any, capsys: Any) -> None:
    # A bad checkpoint through lm-eval's command line: runner's paragraph, exit 2, no traceback.
    done = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "--model", "runner", "--model_args",
                           "checkpoint=nowhere", "--tasks", "mini_mc", "--include_path", "tasks"],
                          cwd=trained, env=runner_env(trained, HF_HOME=str(trained / "hf"), **OFFLINE),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: mode=eval found no checkpoint" in done.stderr and "Traceback" not in done.stderr

    # A request the model cannot serve, under lm-eval's command line: the same paragraph and exit 2.
    with pytest.raises(SystemExit) as stopped:
        model.generate_until([Instance("generate_until", {}, ("def ", {"max_gen_toks": 40}), 0)])
    assert stopped.value.code == 2
    assert "max_gen_toks=40" in capsys.readouterr().err

    # A task whose data is on the hub: the evaluator downloads nothing, and says so before training.
    hub = trained / "hub_tasks"
    hub.mkdir(exist_ok=True)
    (hub / "hub_mc.yaml").write_text(mc_task_yaml("hub_mc", trained / "mc.jsonl", "no_such_org/no_such_dataset"))
    done = run_runner([*TINY, "run.dir=hub_run", "train.steps=2",
                       "eval.evaluators=[{name:lm_eval,tasks:[hub_mc],include_path:hub_tasks}]"], trained,
                      HF_HOME=str(trained / "hf"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "could not load the tasks eval.evaluators[0].tasks=['hub_mc']" in done.stderr
    assert "HF_DATASETS_OFFLINE=0" in done.stderr and "Traceback" not in done.stderr
    assert not list((trained / "hub_run").glob("checkpoints/[0-9]*"))  # stopped before training

    # A task name that is nowhere: named, with the fix, before anything is evaluated.
    settings = EvaluatorSpec(name="lm_eval", tasks=("mini_mcc",), include_path=str(trained / "tasks"))
    with pytest.raises(UserError) as info:
        LmEval(model.ctx.spec, settings).prepare(model.ctx)
    assert "'mini_mcc'" in str(info.value) and "lm_eval ls tasks" in str(info.value)
    for bad, key in ((EvaluatorSpec(name="lm_eval"), "tasks"),
                     (EvaluatorSpec(name="lm_eval", tasks=("x",), include_path="no/such/dir"), "include_path")):
        with pytest.raises(ConfigError) as err:
            LmEval.check(model.ctx.spec, bad, "eval.evaluators[0]")
        assert err.value.key == f"eval.evaluators[0].{key}" and "Fix:" in str(err.value)


class _Pairs(TemplateLM):
    """lm-eval's own _encode_pair over a tokenizer whose tokens depend on their neighbours."""

    def __init__(self, encode: Any) -> None:
        super().__init__()
        self.encode = encode

    eot_token_id = 0

    def tok_encode(self, string: str, add_special_tokens: Any = None, **kwargs: Any) -> list[int]:
        return self.encode(string)

    def _loglikelihood_tokens(self, requests: Any, **kwargs: Any) -> Any:
        return [(req[1], req[2]) for req in requests]

    def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any: ...

    def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any: ...


def merging_encode(text: str) -> list[int]:
    """Bytes, but " t" and "he" are single tokens: a pair's tokens depend on where it is split."""
    out, i = [], 0
    while i < len(text):
        two = text[i:i + 2]
        out.append({" t": 300, "he": 301}.get(two, ord(text[i])))
        i += 2 if two in (" t", "he") else 1
    return out


@pytest.mark.parametrize("context, continuation", [
    ("Hello", " the end"), ("Hello ", "the end"), ("Hello  ", " the"), ("t", "he"), ("", " the"), ("", "\x00the"),
])
def test_encode_pair_is_lm_evals_rule(context: str, continuation: str) -> None:
    theirs = _Pairs(merging_encode)  # "\x00" is token 0, the end-of-document token here
    expected = theirs.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])[0]
    assert encode_pair(merging_encode, context, continuation, 0) == expected


@pytest.mark.deep
def test_lm_eval_finds_runner_and_keeps_its_own_models(tmp_path: Path) -> None:
    # A fresh interpreter: the installed runner-lm-eval.pth registered "runner" lazily, and
    # lm-eval's built-in models are all still there.
    code = ("from lm_eval.api.registry import get_model, model_registry; from lm_eval.models import MODEL_MAPPING; "
            "assert set(MODEL_MAPPING) <= set(model_registry), 'built-ins lost'; "
            "import sys; assert 'runner.main.lm_eval' not in sys.modules; "
            "print(get_model('runner').__module__, get_model('dummy').__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["runner.main.lm_eval", "DummyLM"]


@pytest.mark.deep
def test_a_built_wheel_carries_the_lm_eval_hook(tmp_path: Path) -> None:
    # pip install . (the Docker image) builds a wheel: the .pth and its module must be at its root.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("runner", "jobs"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "_runner_lm_eval.py", "runner-lm-eval.pth"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("runner-*.whl"))).namelist()
    assert "runner-lm-eval.pth" in names and "_runner_lm_eval.py" in names

