"""Hugging Face in and out, against transformers itself (PyTorch on CPU, models built from configs
with random weights, no downloads): import -> runner's logits equal transformers'; a runner
checkpoint -> runner.export -> transformers' logits equal runner's; export -> import is bitwise;
greedy decoding by runner's generate equals transformers' generate(do_sample=False)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extra installs torch and transformers
import transformers
from hydra import compose, initialize_config_dir

from runner.errors import ConfigError, UserError
from runner.evaluation.generate import generate_tokens
from runner.main.cli import CONF_DIR, CONFIG_NAME
from runner.main.config import build_spec
from runner.main.export import export
from runner.models import family_for
from runner.models.hf import mapping as hf
from runner.spec import register_schema
from runner.train.job import JOBS, load_job_modules
from tests.conftest import TINY, read_metrics, run_runner

register_schema()
load_job_modules()
TOL = 1e-4

# What the llama-family variants share, as transformers config arguments (runner's: TINY plus
# each variant's overrides)
DECODER = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=32)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1e6}

# runner settings (job.model.*) and the transformers config of the same model
VARIANTS: dict[str, tuple[list[str], Any]] = {
    "gpt2": (["job.model.family=gpt", "job.model.tie_embeddings=false", "job.model.context_length=64"],
             lambda: transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                             tie_word_embeddings=False, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)),
    "llama_gqa_llama3_rope": (
        ["job.model.family=llama", "job.model.n_heads=4", "job.model.n_kv_heads=2", "job.model.head_dim=12",
         "job.model.d_ff=48", "job.model.tie_embeddings=false", "job.model.rope.theta=500000",
         "job.model.rope.scaling=llama3", "job.model.rope.original_context=16"],
        lambda: transformers.LlamaConfig(
            **DECODER, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen3_mqa_qk_norm_tied": (
        ["job.model.family=llama", "job.model.n_heads=4", "job.model.n_kv_heads=1", "job.model.head_dim=16",
         "job.model.d_ff=48", "job.model.tie_embeddings=true", "job.model.qk_norm=true", "job.model.norm_eps=1e-6",
         "job.model.rope.theta=1000000"],
        lambda: transformers.Qwen3Config(**DECODER, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                                         tie_word_embeddings=True, rope_parameters=DEFAULT_ROPE)),
    "qwen2_bias": (
        ["job.model.family=llama", "job.model.n_heads=4", "job.model.n_kv_heads=2", "job.model.head_dim=8",
         "job.model.d_ff=48", "job.model.tie_embeddings=false", "job.model.qkv_bias=true", "job.model.norm_eps=1e-6",
         "job.model.rope.theta=1000000"],
        lambda: transformers.Qwen2Config(**DECODER, num_key_value_heads=2, rms_norm_eps=1e-6,
                                         tie_word_embeddings=False, rope_parameters=DEFAULT_ROPE)),
}
CASES = [(name, scan) for name in VARIANTS for scan in (True, False)]


def spec_for(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return build_spec(compose(CONFIG_NAME, overrides=list(overrides)), list(overrides))


def hf_model(name: str, std: float = 0.02) -> Any:
    config = VARIANTS[name][1]()
    config.initializer_range = std
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def runner_job(tmp_path: Path, name: str, scan: bool, *extra: str) -> Any:
    overrides = [*TINY, *VARIANTS[name][0], f"job.model.scan_layers={str(scan).lower()}",
                 f"run.dir={tmp_path / 'run'}", *extra]
    return JOBS.get("lm")(spec_for(*overrides))


TOKENS = np.random.default_rng(0).integers(0, 320, (2, 16))


@pytest.mark.parametrize("name,scan", CASES)
def test_import_gives_transformers_logits_and_export_round_trips(tmp_path: Path, name: str, scan: bool) -> None:
    model = hf_model(name)
    model.save_pretrained(tmp_path / "hf")
    job = runner_job(tmp_path, name, scan, f"run.init_from=hf:{tmp_path / 'hf'}")
    job.load()  # a fresh run, initialised from the Hugging Face model
    ours = np.asarray(job.model.apply({"params": job.state.params}, jnp.asarray(TOKENS)))
    assert np.abs(ours - hf_logits(model, TOKENS)).max() < TOL

    job.save()  # a runner checkpoint of those parameters -> export -> transformers
    report = export(tmp_path / "run", tmp_path / "out")
    job.close()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(loaded).__name__ == type(model).__name__ == report["architecture"]
    assert np.abs(hf_logits(loaded.eval(), TOKENS) - ours).max() < TOL

    # export -> import: bitwise the same parameters
    again = runner_job(tmp_path / "again", name, scan, f"run.init_from=hf:{tmp_path / 'out'}")
    again.load()
    for a, b in zip(jax.tree.leaves(again.state.params), jax.tree.leaves(job.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again.close()


def assert_greedy_as_transformers(module: Any, params: Any, model: Any) -> None:
    """32 greedy tokens after each of two prompts of different lengths: runner's (KV cache) are
    transformers' `generate`'s."""
    prompt = np.array([[5, 17, 200, 3, 0, 0], [9, 8, 7, 6, 5, 4]], np.int32)
    lengths = np.array([4, 6], np.int32)
    ours = np.asarray(generate_tokens(module.apply, {"params": params}, jnp.asarray(prompt), jnp.asarray(lengths),
                                      jnp.arange(2), max_new_tokens=32, temperature=0.0, seed=0, vocab=320,
                                      init_cache=module.init_cache))
    for row in range(2):
        ids = torch.tensor(prompt[row:row + 1, :lengths[row]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        np.testing.assert_array_equal(ours[row], out[0, lengths[row]:].numpy())


def perturbed_export(spec: Any, tmp_path: Path, scale: float, tokens: np.ndarray) -> tuple[np.ndarray, Any, dict, dict]:
    """A run of `spec` whose parameters are moved off their initial values by `scale` x noise
    (norms, biases, routers included), saved and exported: (runner's logits on `tokens`, the
    export loaded by transformers, its loading info, the export's report)."""
    job = JOBS.get("lm")(spec)
    job.load()
    params = jax.tree.map(lambda p: p + scale * jax.random.normal(jax.random.key(1), p.shape, p.dtype),
                          job.state.params)
    job.state = job.state.replace(params=params)
    job.save()
    ours = np.asarray(job.model.apply({"params": job.state.params}, jnp.asarray(tokens)))
    job.close()
    report = export(spec.run.dir, tmp_path / "out")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    return ours, loaded.eval(), info, report


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_generation_equals_transformers(tmp_path: Path, name: str) -> None:
    model = hf_model(name, std=0.3)  # large weights: sharp logits, no near-ties to break differently
    model.save_pretrained(tmp_path / "hf")
    spec = spec_for(*TINY, *VARIANTS[name][0], f"run.init_from=hf:{tmp_path / 'hf'}",
                    "job.model.context_length=64", f"run.dir={tmp_path / 'run'}")
    family = family_for(spec)
    config = family.config(spec.job.model)
    module = family.module(config)
    shapes = {tuple(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape) for path, leaf in
              jax.tree_util.tree_flatten_with_path(nn.unbox(jax.eval_shape(
                  module.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"])[0]}
    params = hf.import_params(family.hf.layout(config), hf.hf_tensor_reader(tmp_path / "hf"), shapes,
                              config.scan_layers, tmp_path / "hf")
    assert_greedy_as_transformers(module, params, model)


@pytest.mark.e2e
def test_a_trained_run_exports_through_the_command_line_and_imports_in_one_launch(tmp_path: Path) -> None:
    args = [*TINY, "job=llama_tiny", "train.steps=3", "eval.every=0", "run.dir=run"]
    trained = run_runner(args, tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    import subprocess
    import sys

    from tests.conftest import fork_server, runner_env
    from tests.forked import run

    def export_cli(*extra: str) -> subprocess.CompletedProcess:
        """Forked (tests/forked.py): JAX_PLATFORMS set as the other processes have it."""
        return run(fork_server(), "module", "runner.export", ["run", "hf", *extra], tmp_path, runner_env(tmp_path),
                   600)

    # a fresh interpreter, as a user runs it: the command itself keeps to the CPU before JAX loads
    env = runner_env(tmp_path)
    del env["JAX_PLATFORMS"]
    out = subprocess.run([sys.executable, "-m", "runner.export", "run", "hf"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip() == "", out.stderr[-3000:]  # no libtpu, absl or orbax noise on a CPU machine
    # into a non-empty directory: refused, nothing touched; --overwrite clears the old weights first
    again = export_cli("--max-shard-size", "100KB")
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr
    assert (tmp_path / "hf" / hf.SINGLE_FILE).is_file() and not (tmp_path / "hf" / hf.INDEX_FILE).exists()
    out = export_cli("--max-shard-size", "100KB", "--overwrite")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert hf.SINGLE_FILE in report["removed"] and not (tmp_path / "hf" / hf.SINGLE_FILE).exists()
    assert len(report["shards"]) > 1 and (tmp_path / "hf" / hf.INDEX_FILE).is_file()  # sharded, with an index
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == 256  # the byte tokenizer's end of document
    assert read_metrics(tmp_path / "run")

    # the default job imports the Llama in one launch: its family and dims from config.json (a
    # command-line key that contradicts them is refused: tests/models/test_hf_config.py, in-process
    # for each key, and end to end with exit 2 and no run directory)
    ok = run_runner([*TINY, "run.dir=gpt", "run.init_from=hf:hf", "train.steps=1", "eval.every=0"], tmp_path)
    assert ok.returncode == 0 and "LlamaForCausalLM" in ok.stdout, ok.stderr[-2000:]


def test_import_errors_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        spec_for(*TINY, f"run.init_from=hf:{tmp_path}")
    assert info.value.key == "run.init_from" and "config.json" in str(info.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError):
        spec_for(*TINY, f"run.init_from=hf:{tmp_path}")


@pytest.mark.deep
def test_export_carries_a_hugging_face_tokenizer_and_reads_a_checkpoint_saved_on_a_mesh(tmp_path: Path) -> None:
    """Data tokenized by a trained BPE (a Hugging Face tokenizer), a run on a (1, 2, 2) mesh of 4
    devices; the export, on this one CPU device, loads in transformers with the same tokenizer."""
    import sysconfig

    from runner.data.prepare import main as prepare_main
    from runner.data.store import TokenStore

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, source in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]):
        (docs / f"{i:02d}.txt").write_text(source.read_text(encoding="utf-8", errors="replace")[:20000])
    store = tmp_path / "store"
    assert prepare_main([str(docs / "*.txt"), "-o", str(store), "--tokenizer", "train-bpe:400", "--val-fraction",
                         "0.1", "--workers", "1", "--progress", "none"]) == 0
    trained = run_runner([*TINY, "job=llama_tiny", "job.model.vocab_size=448", f"data.sources=[{{path:{store}}}]",
                          "train.steps=2", "eval.every=0", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                          "run.dir=run"], tmp_path, devices=4)
    assert trained.returncode == 0, trained.stderr[-3000:]
    report = export(tmp_path / "run", tmp_path / "hf")
    assert report["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def main(argv):\n    return sorted(argv)\n"
    ours = TokenStore.open(store).load_tokenizer()
    assert tokenizer.encode(text, add_special_tokens=False) == [int(t) for t in ours.encode(text)]
    assert tokenizer.eos_token_id == ours.eod_id == model.config.eos_token_id
