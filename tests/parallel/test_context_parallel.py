"""Context parallelism (mesh.context): rows split over the context axis in zig-zag order give the
one-device logits, gradients and losses, for both families, grouped and multi-query attention,
with packed documents whose boundaries fall on and across shard edges; runs resume after
SIGKILL, onto another context size too; what cannot work is refused."""

from __future__ import annotations

import dataclasses
import shutil
import signal

import numpy as np
import pytest

from runner.errors import ConfigError
from tests.conftest import TINY, read_metrics, run_runner
from tests.parallel.equivalence import assert_close_losses, run_script

EQUIVALENCE = """
import json, dataclasses, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from runner.parallel.mesh import make_mesh
from runner.models.llama.model import Llama, LlamaConfig, LlamaFamily
from runner.models.gpt.model import GPT, GPTConfig, GPTFamily
from runner.models.gemma.model import Gemma, GemmaConfig, GemmaFamily
from tests.models.test_moe import moe_config
from tests.parallel.equivalence import logits_and_grads, relative_error

tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 32), 0, 64)
# 4 shards: chunks of 4 tokens, shard i holds chunks i and 7-i; boundaries on a chunk edge (8, 16,
# 24), inside chunks (5, 13, 7), a padded tail; 8 shards: chunks of 2 tokens, edges on chunk edges
# and inside chunks
seg = np.array([[1] * 5 + [2] * 3 + [3] * 5 + [4] * 11 + [5] * 8, [1] * 32, [1] * 16 + [2] * 12 + [0] * 4,
                [1] * 7 + [2] * 25])
starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1) != 0, np.arange(32), 0), axis=1)
positions, seg = jnp.asarray(np.arange(32) - starts), jnp.asarray(seg)
llama = dict(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, head_dim=8, d_ff=48)
models = {"llama_gqa": (Llama, LlamaFamily, LlamaConfig(**llama, n_kv_heads=2)),
          "llama_mqa": (Llama, LlamaFamily, LlamaConfig(**llama, n_kv_heads=1)),
          "gpt": (GPT, GPTFamily, GPTConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4)),
          "moe": (Llama, LlamaFamily, dataclasses.replace(moe_config(n_shared_experts=1), context_length=32)),
          # a sliding window of 5 keys: it crosses the chunks of 4 (context 4) and 8 (context 2) of every shard
          "llama_window": (Llama, LlamaFamily, LlamaConfig(**llama, n_kv_heads=2, window=5)),
          # Gemma 3: windowed layers (5 keys) around a global one, scanned as a period and a tail
          "gemma": (Gemma, GemmaFamily, GemmaConfig(**llama, n_kv_heads=2, window_size=5, global_every=2,
                                                    query_pre_attn_scalar=16))}
# meshes of 4 (on the first 4 devices): every kind; meshes of 8: usp, ulysses and ring beside other axes
fours = ({"data": 1, "fsdp": 1, "context": 4, "tensor": 1}, {"data": 2, "fsdp": 1, "context": 2, "tensor": 1},
         {"data": 1, "fsdp": 2, "context": 2, "tensor": 1}, {"data": 1, "fsdp": 1, "context": 2, "tensor": 2})
cases = {"llama_gqa": [({"context": 8}, "usp", 2), ({"context": 8}, "usp", 4), ({"data": 2, "context": 4}, "usp", 2),
                       ({"context": 4, "tensor": 2}, "usp", 2), ({"data": 2, "context": 4}, "ulysses", 0),
                       ({"fsdp": 2, "context": 4}, "ring", 0)],
         "llama_mqa": [({"context": 8}, "usp", 4), ({"context": 4, "tensor": 2}, "usp", 2)],
         "gpt": [({"context": 8}, "usp", 2), ({"fsdp": 2, "context": 4}, "ulysses", 0)],
         "moe": [({"expert": 2, "context": 4}, "usp", 2), ({"expert": 2, "context": 4}, "ulysses", 0)],
         "llama_window": [({"context": 8}, "usp", 2)],
         "gemma": [({"context": 8}, "allgather", 0), ({"fsdp": 2, "context": 4}, "ring", 0),
                   ({"data": 2, "context": 4}, "ulysses", 0), ({"context": 8}, "usp", 2)]}
out = {"4": {}, "8": {}}
for name, (Model, Family, cfg) in models.items():
    params = nn.unbox(Model(cfg).init(jax.random.PRNGKey(0), tokens)["params"])
    reference = dataclasses.replace(cfg, moe_dispatch="dense") if name == "moe" else cfg
    want, _ = logits_and_grads(Model(reference), params, tokens, seg, positions)  # one device, once a model
    for shape in {"moe": (), "gemma": (), "llama_window": fours[:2]}.get(name, fours):
        for kind in ("allgather", "ring", "ulysses", "usp"):
            if kind == "usp" and shape["context"] < 4:  # groups of 2 and a ring of 2: context 4 at least
                continue
            c = dataclasses.replace(cfg, context_parallel=kind, ulysses_ways=2 if kind == "usp" else 0)
            with jax.set_mesh(make_mesh(shape, jax.devices()[:4])), nn.logical_axis_rules(Family.axis_rules(c, shape)):
                got, text = logits_and_grads(Model(c), params, tokens, seg, positions)
            key = name + "/" + "/".join(f"{k}{v}" for k, v in shape.items() if v > 1) + "/" + kind
            out["4"][key] = {"error": relative_error(got, want),
                             "gather": "all-gather" in text or "all_gather" in text,
                             "permute": "collective-permute" in text or "collective_permute" in text or
                             "ppermute" in text, "all_to_all": "all-to-all" in text or "all_to_all" in text}
    for axes, kind, ways in cases[name]:
        shape = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **axes}
        c = dataclasses.replace(cfg, context_parallel=kind, ulysses_ways=ways)
        with jax.set_mesh(make_mesh(shape)), nn.logical_axis_rules(Family.axis_rules(c, shape)):
            got, text = logits_and_grads(Model(c), params, tokens, seg, positions)
        key = name + "/" + "/".join(f"{k}{v}" for k, v in axes.items()) + "/" + kind + (str(ways) if ways else "")
        out["8"][key] = {"error": relative_error(got, want), "all_to_all": "all-to-all" in text or "all_to_all" in text,
                         "permute": "collective-permute" in text or "collective_permute" in text or "ppermute" in text}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """EQUIVALENCE's results ({"4": meshes of 4, "8": meshes of 8}): one process of 8 CPU devices,
    each model's one-device reference computed once for both tests."""
    return run_script(EQUIVALENCE, tmp_path_factory.mktemp("equivalence"), devices=8)


@pytest.mark.deep
def test_context_meshes_give_the_one_device_logits_and_gradients(equivalence) -> None:
    """(context 4), (data 2, context 2), (fsdp 2, context 2), (context 2, tensor 2), allgather,
    ring and ulysses (and usp on context 4: groups of 2, a ring of 2), for llama (GQA and MQA, and
    with a sliding window across the shards' chunks on the first two meshes) and gpt: every logit
    and every gradient within float32 rounding. Ulysses there covers both of its
    head layouts: key/value heads that split over the context axis (GQA's 2 over context 2) and
    ones repeated to one per query head (MQA; GQA's 2 over context 4, or 1 per device beside
    tensor 2)."""
    out = equivalence["4"]
    assert len(out) == 46
    for name, result in out.items():
        assert result["error"] < 1e-5, (name, result)
        kind = name.rsplit("/", 1)[1]
        collectives = {"ring": ["permute"], "allgather": ["gather"], "ulysses": ["all_to_all"],
                       "usp": ["all_to_all", "permute"]}[kind]
        assert all(result[c] for c in collectives), (name, result)
        assert result["all_to_all"] == (kind in ("ulysses", "usp")), (name, result)  # heads travel only there


@pytest.mark.deep
def test_on_8_devices_usp_ulysses_and_ring_give_the_one_device_logits_and_gradients(equivalence) -> None:
    """8 CPU devices: usp with groups of 2 (a ring of 4) and of 4 (a ring of 2) over context 8, and
    beside data, tensor and expert axes; ulysses beside data, fsdp and expert; ring beside fsdp;
    for llama (GQA, MQA, a sliding window), gpt, an MoE (against its dense dispatch) and Gemma 3
    (every kind, its windowed and global layers), with packed documents:
    every logit and every gradient within float32 rounding of one device."""
    out = equivalence["8"]
    assert len(out) == 17
    for name, result in out.items():
        assert result["error"] < 1e-5, (name, result)
        kind = name.rsplit("/", 1)[1]
        assert result["all_to_all"] == kind.startswith(("ulysses", "usp")), (name, result)  # heads travel only there
        if kind.startswith(("usp", "ring")):
            assert result["permute"], (name, result)  # the ring between the groups


SPLASH_EQUIVALENCE = """
import json, dataclasses, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
import runner.models.attention.splash as splash
import runner.models.attention.splash_ring as splash_ring
from runner.parallel.mesh import make_mesh
from runner.models.llama.model import Llama, LlamaConfig, LlamaFamily
from runner.models.gpt.model import GPT, GPTConfig, GPTFamily
from tests.parallel.equivalence import logits_and_grads, relative_error

KINDS, T = ("allgather", "ulysses"), 512  # the ring test replaces this line
built = []  # the shards each splash kernel was built for: proof the kernel ran, not the XLA blocks
kernel, ring_kernels, rows_kernel = splash.zigzag_causal_kernel, splash_ring.kernels, splash.causal_kernel
splash.zigzag_causal_kernel = lambda *a, **k: built.append(a[2]) or kernel(*a, **k)
splash_ring.kernels = lambda *a, **k: built.append(T // a[1]) or ring_kernels(*a, **k)
splash.causal_kernel = lambda *a, **k: built.append(a[1]) or rows_kernel(*a, **k)  # whole rows (ulysses)
tokens = jax.random.randint(jax.random.PRNGKey(3), (2, T), 0, 64)
# chunks of 64 tokens (context 4) or 128 (context 2) at T 512, 128 or 256 at 1024: document edges
# on chunk edges (64, 128, 256) and inside chunks (100, 300), a padded tail; the second row one
# document across shards
seg = np.zeros((2, T), np.int32)
for row, cuts in enumerate(([0, 64, 100, 128, 256, 300, 480], [0, 200, T])):
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        seg[row, a:b] = i + 1
starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1) != 0, np.arange(T), 0), axis=1)
positions, seg = jnp.asarray(np.arange(T) - starts), jnp.asarray(seg)
llama = dict(vocab_size=64, context_length=T, d_model=32, n_layers=1, n_heads=4, head_dim=8, d_ff=48)
models = {"llama_gqa": (Llama, LlamaFamily, LlamaConfig(**llama, n_kv_heads=2)),
          "llama_mqa": (Llama, LlamaFamily, LlamaConfig(**llama, n_kv_heads=1)),
          "gpt": (GPT, GPTFamily, GPTConfig(vocab_size=64, context_length=T, d_model=32, n_layers=1, n_heads=4)),
          # a sliding window of 100 keys: the kernel's windowed mask, blocks out of reach skipped (not under ring)
          "llama_window": (Llama, LlamaFamily, LlamaConfig(**llama, n_kv_heads=2, window=100))}
meshes = {"llama_gqa": ({"context": 4}, {"data": 2, "context": 2}, {"fsdp": 2, "context": 2},
                        {"context": 2, "tensor": 2}),
          "llama_mqa": ({"context": 2, "tensor": 2},), "gpt": ({"context": 4},),
          "llama_window": ({"context": 4},)}
ring_only = {"gpt": ({"context": 4, "docs": 0},)}  # rows without documents: no segment ids at all
out = {kind: {} for kind in KINDS}
for name, (Model, Family, cfg) in models.items():
    params = nn.unbox(Model(cfg).init(jax.random.PRNGKey(0), tokens)["params"])
    wants = {}  # one device's xla attention, once a model for each of the rows (with documents, without)
    for kind in KINDS:
        for axes in (meshes[name] if kind != "ring" or name != "llama_window" else ()) + (
                ring_only.get(name, ()) if kind == "ring" else ()):
            docs = (seg, positions) if axes.get("docs", 1) else (None, None)
            if axes.get("docs", 1) not in wants:
                wants[axes.get("docs", 1)] = logits_and_grads(Model(cfg), params, tokens, *docs)[0]
            want = wants[axes.get("docs", 1)]
            shape = {"data": 1, "fsdp": 1, "context": 1, "tensor": 1, **axes}
            shape.pop("docs", None)
            c = dataclasses.replace(cfg, attention="splash_interpret", context_parallel=kind)
            before = len(built)
            with jax.set_mesh(make_mesh(shape)), nn.logical_axis_rules(Family.axis_rules(c, shape)):
                got, text = logits_and_grads(Model(c), params, tokens, *docs)
            key = name + "/" + "/".join(f"{k}{v}" for k, v in axes.items())
            out[kind][key] = {"error": relative_error(got, want), "kernels": built[before:],
                              "gather": "all-gather" in text or "all_gather" in text,
                              "permute": "collective-permute" in text or "collective_permute" in text or
                              "ppermute" in text}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def splash_512(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """SPLASH_EQUIVALENCE's results for allgather and ulysses, which take the same 512-token rows on
    the same meshes: one process, one reference a model."""
    return run_script(SPLASH_EQUIVALENCE, tmp_path_factory.mktemp("splash"))


@pytest.mark.deep
def test_the_splash_kernel_per_shard_gives_the_one_device_logits_and_gradients(splash_512) -> None:
    """attention=splash (Pallas interpret mode on CPU) with allgather: each shard's queries against
    the gathered keys and values in one kernel call whose mask knows the zig-zag order. 512-token
    packed rows on (context 4), (data 2, context 2), (fsdp 2, context 2), (context 2, tensor 2) for
    llama GQA, MQA with split heads, gpt, and llama with a sliding window of 100 keys (the kernel's
    windowed mask): logits and gradients within float32 rounding of one device's XLA attention."""
    out = splash_512["allgather"]
    assert len(out) == 7
    for name, result in out.items():
        assert result["error"] < 1e-5, (name, result)
        assert result["gather"], (name, result)
        ways = int(name.split("context")[1].split("/")[0])
        assert result["kernels"] and set(result["kernels"]) == {ways}, (name, result)  # split over the context axis


@pytest.mark.deep
def test_the_splash_kernel_on_whole_rows_under_ulysses_gives_the_one_device_logits_and_gradients(splash_512) -> None:
    """attention=splash with ulysses: after the all-to-all each device runs the ordinary splash
    kernel on whole 512-token rows (built for 512, not a shard's share) for its share of the
    heads, key/value heads repeated where they do not split (GQA over context 4 or beside tensor
    2, MQA; a sliding window); the same meshes as allgather: logits and gradients within float32
    rounding of one device's XLA attention."""
    out = splash_512["ulysses"]
    assert len(out) == 7
    for name, result in out.items():
        assert result["error"] < 1e-5, (name, result)
        assert result["kernels"] and set(result["kernels"]) == {512}, (name, result)  # whole rows


@pytest.mark.deep
def test_the_splash_kernel_per_ring_block_gives_the_one_device_logits_and_gradients(tmp_path) -> None:
    """attention=splash with ring: every ring step one splash call (the own block causal, the
    others' half blocks unmasked), merged by the kernels' log-sum-exps; the gradient by splash's
    backward kernels with the merged softmax, key/value gradients travelling the ring home.
    1024-token packed rows (each shard's half row fills the kernel's 128 tiles at context 4) on
    the same meshes as allgather, and rows without documents: logits and gradients within float32
    rounding of one device."""
    out = run_script(SPLASH_EQUIVALENCE.replace('("allgather", "ulysses"), 512', '("ring",), 1024'), tmp_path)["ring"]
    assert len(out) == 7 and "gpt/context4/docs0" in out  # and one mesh with unpacked rows
    for name, result in out.items():
        assert result["error"] < 1e-5, (name, result)
        assert result["permute"] and not result["gather"], (name, result)  # blocks passed, never gathered
        ways = int(name.split("context")[1].split("/")[0])
        assert result["kernels"] and set(result["kernels"]) == {ways}, (name, result)


def test_the_zigzag_layout_gives_every_shard_the_same_causal_work() -> None:
    from runner.models.attention.context import zigzag_order

    order = zigzag_order(32, 4)
    assert sorted(order) == list(range(32)) and list(order[:8]) == [0, 1, 2, 3, 28, 29, 30, 31]
    work = [sum(int(i) + 1 for i in part) for part in order.reshape(4, 8)]  # keys each shard's queries see
    assert len(set(work)) == 1, work
    contiguous = [sum(int(i) + 1 for i in part) for part in np.arange(32).reshape(4, 8)]
    assert max(contiguous) > 3 * min(contiguous)


RUN = [*TINY, "job=llama_tiny", "job.model.n_kv_heads=2", "job.model.head_dim=16", "data.document_mask=true",
       "train.steps=30", "checkpoint.every_steps=10", "eval.every=15"]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.e2e
def test_context_meshes_train_the_one_device_curve_and_resume_onto_another_context_size(tmp_path) -> None:
    """30 steps of packed documents through `python -m runner`: (data 2, context 2) by allgather
    and by ulysses, both with the loss and the feed-forward in 2 tiles (runner.models.common.tiling),
    (context 4) by ring and by usp (groups of 2, a ring of 2: the ways usp picks for 2 heads),
    untiled, match one untiled device; a run killed at step 22 resumes bit-exact on the same mesh
    (allgather and ulysses tiled, usp), and a tiled one (a copy of the killed allgather run) on an
    untiled (context 4) onto the same curve. Runs on one mesh shape share a sweep, one process."""
    from tests.train.test_restore import params_of

    one = run_runner([*RUN, "run.dir=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    want = losses(tmp_path / "one")
    assert sorted(want) == list(range(1, 31)) and want[30] < want[1]
    tiles = ["job.model.loss_tiles=2", "job.model.mlp_tiles=2"]
    pairs, fours = ["mesh.data=2", "mesh.context=2", *tiles], ["mesh.data=1", "mesh.context=4"]
    for sweep, mesh, kinds in (("pairs", pairs, "allgather,ulysses"), ("fours", fours, "ring,usp")):
        done = run_runner(["-m", *RUN, *mesh, f"job.model.context_parallel={kinds}", f"run.sweep={sweep}",
                           "run.dir=whole/${job.model.context_parallel}"], tmp_path, devices=4)
        assert done.returncode == 0, done.stderr[-3000:]
    for kind in ("allgather", "ulysses", "ring", "usp"):
        got = losses(tmp_path / "whole" / kind)
        assert got.keys() == want.keys(), kind
        assert_close_losses(got, want, range(1, 31), kind)
    assert "(ulysses)" in (tmp_path / "whole" / "ulysses" / "RUN_CARD.md").read_text()
    assert "tiles: output head and loss over 2 tiles" in (tmp_path / "whole" / "allgather" / "RUN_CARD.md").read_text()
    assert "(usp): all-to-all within groups of 2 shards" in (tmp_path / "whole" / "usp" / "RUN_CARD.md").read_text()

    for kind, mesh in (("allgather", pairs), ("ulysses", pairs), ("usp", fours)):
        killed = run_runner([*RUN, f"run.dir=killed/{kind}", *mesh, f"job.model.context_parallel={kind}"], tmp_path,
                            devices=4, RUNNER_FAULT="kill_at_step:22")
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # the tiled allgather run killed at 22, once: a copy of its directory is the one moved to (context 4)
    shutil.copytree(tmp_path / "killed" / "allgather", tmp_path / "killed" / "moved")
    for resumed, extra in ((2, ["-m", *RUN, *pairs, "job.model.context_parallel=allgather,ulysses", "run.sweep=again",
                                "run.dir=killed/${job.model.context_parallel}"]),
                           (1, [*RUN, *fours, "job.model.context_parallel=usp", "run.dir=killed/usp"]),
                           (1, [*RUN, *fours, "job.model.context_parallel=allgather", "run.dir=killed/moved"])):
        again = run_runner(extra, tmp_path, devices=4)
        assert again.returncode == 0, again.stderr[-3000:]
        assert again.stdout.count("resumed from step 20 ") == resumed, again.stdout[-3000:]
    for kind in ("allgather", "ulysses", "usp"):  # uninterrupted, on the same mesh
        for a, b in zip(params_of(tmp_path / "killed" / kind, 30), params_of(tmp_path / "whole" / kind, 30),
                        strict=True):
            np.testing.assert_array_equal(a, b)
    assert_close_losses(losses(tmp_path / "killed" / "moved"), want, range(21, 31), "moved")


SPLASH_CARDS = {
    "allgather": "splash_interpret kernel on each shard's rows, keys and values gathered over mesh.context=2",
    "ring": "splash_interpret kernel per block, key/value blocks passed around mesh.context=2 (ring)",
    "ulysses": "splash_interpret on whole rows, 1 head per device, heads and sequence exchanged by all-to-all over "
               "mesh.context=2 (ulysses); key/value heads repeated to one per query head (1 on a device do not "
               "split 2 ways)"}


@pytest.mark.deep
def test_a_splash_run_split_over_context_trains_the_one_device_curve(tmp_path) -> None:
    """`python -m runner job.model.attention=splash mesh.context=2` (Pallas interpret mode on this
    CPU) on packed rows, allgather, ring and ulysses: the kernel runs per shard, per block or on
    whole rows (the run card says so) and the losses are one device's XLA attention's. (The kinds
    at one length, 512 tokens, the shortest ring's half blocks fill: one sweep, one reference.)"""
    kinds = "allgather,ulysses,ring"
    run = [*RUN, "job.model.n_kv_heads=1", "train.seq_len=512", "job.model.context_length=512",
           "train.steps=4", "train.batch_size=4", "eval.every=0", "checkpoint.every_steps=0"]
    one = run_runner([*run, "run.dir=one", "job.model.attention=xla"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    want = losses(tmp_path / "one")
    split = run_runner(["-m", *run, "mesh.data=2", "mesh.context=2", "job.model.attention=splash",
                        f"job.model.context_parallel={kinds}", "run.sweep=split",
                        "run.dir=split/${job.model.context_parallel}"], tmp_path, devices=4)
    assert split.returncode == 0, split.stderr[-3000:]
    for kind in kinds.split(","):
        got = losses(tmp_path / "split" / kind)
        assert got.keys() == want.keys(), kind
        assert_close_losses(got, want, range(1, 5), kind)
        text = (tmp_path / "split" / kind / "RUN_CARD.md").read_text()
        assert f"attention: {SPLASH_CARDS[kind]}" in text, text[:2000]


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_the_state_is_split_over_context_too_and_activations_keep_their_layout(family: str) -> None:
    import flax.linen as nn

    from runner.models.gpt.model import GPTConfig, GPTFamily
    from runner.models.llama.model import LlamaConfig, LlamaFamily

    sizes = dict(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4)
    llama = LlamaConfig(**sizes, head_dim=8, d_ff=48, n_kv_heads=2)
    rules_of = {"llama": lambda shape: LlamaFamily.axis_rules(llama, shape),
                "gpt": lambda shape: GPTFamily.axis_rules(GPTConfig(**sizes), shape)}[family]
    split = rules_of({"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1})
    whole = rules_of({"data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1})
    P = nn.logical_to_mesh_axes
    assert P(("embed", "mlp"), split) == jax_spec(("fsdp", "context"), "tensor")  # a weight: fsdp x context
    assert P(("embed", "mlp"), whole) == jax_spec("fsdp", "tensor")  # no context axis: as before
    assert P(("batch", "length", "embed"), split) == jax_spec(("data", "fsdp", "expert"), "context", None)


def jax_spec(*axes):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*axes)


def test_what_cannot_run_context_parallel_is_refused() -> None:
    from runner.parallel.mesh import check_spec
    from runner.spec import ExecutionSpec, MeshSpec, ModelSpec, TrainSpec, validate

    spec = dataclasses.replace(ExecutionSpec(topology="cpu-4"), mesh=MeshSpec(data=1, context=4),
                               train=TrainSpec(seq_len=36, batch_size=8))
    with pytest.raises(ConfigError, match=r"train.seq_len=36.*8 equal chunks.*multiple of 8"):
        check_spec(spec)
    splash = dataclasses.replace(spec, train=TrainSpec(seq_len=256, batch_size=8), job=dataclasses.replace(
        spec.job, model=ModelSpec(attention="splash")))
    with pytest.raises(ConfigError, match=r"train.seq_len=256.*256 / 4 tokens.*blocks of 128.*multiple of 512"):
        check_spec(splash)
    check_spec(dataclasses.replace(splash, train=TrainSpec(seq_len=512, batch_size=8)))  # 128 per shard: the kernel
    check_spec(dataclasses.replace(splash, job=ExecutionSpec().job))  # auto: xla blocks where splash cannot
    ring = dataclasses.replace(splash, train=TrainSpec(seq_len=512, batch_size=8), job=dataclasses.replace(
        spec.job, model=ModelSpec(attention="splash", context_parallel="ring")))
    with pytest.raises(ConfigError, match=r"train.seq_len=512.*context_parallel=ring, ring's blocks are halves of "
                       r"each shard's 512 / 4 tokens.*blocks of 128.*multiple of 1024"):
        check_spec(ring)
    check_spec(dataclasses.replace(ring, train=TrainSpec(seq_len=1024, batch_size=8)))  # 128-token half blocks
    cudnn = dataclasses.replace(splash, job=dataclasses.replace(spec.job, model=ModelSpec(attention="cudnn")))
    with pytest.raises(ConfigError, match=r"job.model.attention='cudnn'.*no context-parallel form"):
        check_spec(cudnn)
    with pytest.raises(ConfigError, match=r"job.model.context_parallel.*ulysses"):  # named among the choices
        validate(dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=ModelSpec(
            context_parallel="megatron"))))


def test_ulysses_refuses_heads_that_do_not_split_over_the_context_axis_and_says_when_it_repeats_kv() -> None:
    """Ulysses hands each context shard whole rows for a share of the heads a device holds (after
    mesh.tensor): 4 heads split 4 or 2 ways; 6 do not split 4 ways, nor 2 (of 4) 4 ways beside
    tensor 2 (refused, naming the key and the fix). Key/value heads that do not split are
    repeated, and the launch's attention line says so; cuDNN is allowed (whole rows)."""
    from runner.parallel.compile import ulysses_summary
    from runner.parallel.mesh import check_spec
    from runner.spec import ExecutionSpec, MeshSpec, ModelSpec, TrainSpec

    def spec_of(heads: int, kv: int, **mesh: int) -> ExecutionSpec:
        spec = ExecutionSpec(topology="cpu-4")
        return dataclasses.replace(spec, mesh=MeshSpec(data=1, **mesh), train=TrainSpec(seq_len=64, batch_size=8),
                                   job=dataclasses.replace(spec.job, model=ModelSpec(
                                       family="llama", n_heads=heads, n_kv_heads=kv, context_parallel="ulysses")))

    check_spec(spec_of(4, 2, context=4))
    check_spec(spec_of(4, 4, context=2, tensor=2))
    with pytest.raises(ConfigError, match=r"ulysses splits every device's heads over mesh.context=4.*6 query heads"
                       r".*use a mesh.context that divides 6, or job.model.context_parallel=allgather or ring"):
        check_spec(spec_of(6, 6, context=4))
    with pytest.raises(ConfigError, match=r"each device holds 2 of the 4 query heads.*after mesh.tensor=2"):
        check_spec(dataclasses.replace(spec_of(4, 4, context=4, tensor=2), topology="cpu-8"))
    cudnn = spec_of(4, 2, context=4)
    check_spec(dataclasses.replace(cudnn, job=dataclasses.replace(cudnn.job, model=dataclasses.replace(
        cudnn.job.model, attention="cudnn"))))  # (the platform check is attention's own)
    config = spec_of(4, 2, context=4).job.model
    line = ulysses_summary(config, "xla", {"context": 4, "tensor": 1})
    assert line == ("xla on whole rows, 1 head per device, heads and sequence exchanged by all-to-all over "
                    "mesh.context=4 (ulysses); key/value heads repeated to one per query head (2 on a device do "
                    "not split 4 ways)"), line
    assert "repeated" not in ulysses_summary(config, "splash", {"context": 2, "tensor": 1})


def test_usp_takes_the_largest_group_that_fits_or_the_one_asked_and_refuses_what_cannot_split() -> None:
    """usp: all-to-all groups of job.model.ulysses_ways shards (0: the largest divisor of
    mesh.context below it that divides the heads a device holds), a ring between them. A group
    size that does not divide the axis or the heads, a context axis with no group size (2, or
    prime), ulysses_ways under another kind, and the splash or cuDNN kernel (usp's ring is XLA
    blocks here) are refused naming the key and the fix; the launch line names the groups."""
    from runner.models import model_config
    from runner.parallel.compile import ulysses_summary
    from runner.parallel.mesh import check_spec, usp_ways
    from runner.spec import ExecutionSpec, MeshSpec, ModelSpec, TrainSpec, validate

    def spec_of(heads: int, ways: int = 0, kind: str = "usp", attention: str = "auto", topology: str = "cpu-8",
                **mesh: int) -> ExecutionSpec:
        spec = ExecutionSpec(topology=topology)
        return dataclasses.replace(spec, mesh=MeshSpec(data=1, **mesh), train=TrainSpec(seq_len=64, batch_size=8),
                                   job=dataclasses.replace(spec.job, model=ModelSpec(
                                       family="llama", n_heads=heads, n_kv_heads=2, context_parallel=kind,
                                       ulysses_ways=ways, attention=attention)))

    assert usp_ways(spec_of(8, context=8), 8) == 4  # 2 and 4 fit: the largest
    assert usp_ways(spec_of(8, 2, context=8), 8) == 2
    assert usp_ways(spec_of(4, context=4, tensor=2), 4) == 2  # 2 heads a device
    check_spec(spec_of(4, context=8))
    assert model_config(spec_of(4, context=8)).ulysses_ways == 4 and model_config(spec_of(4, context=8)).attention \
        == "xla"
    with pytest.raises(ConfigError, match=r"job.model.ulysses_ways.*usp splits mesh.context=8.*divide the 4 query "
                       r"heads.*use job.model.ulysses_ways=2 or 4"):
        check_spec(spec_of(4, 8, context=8))
    with pytest.raises(ConfigError, match=r"ulysses_ways.*mesh.context=2.*use context_parallel=ring or ulysses"):
        check_spec(spec_of(4, context=2, topology="cpu-2"))
    with pytest.raises(ConfigError, match=r"job.model.ulysses_ways.*only context_parallel=usp.*it is ring"):
        validate(spec_of(4, 2, kind="ring", context=8))
    for attention in ("splash", "cudnn"):
        with pytest.raises(ConfigError, match=r"job.model.attention.*under usp.*XLA blocks.*auto or xla"):
            check_spec(spec_of(4, attention=attention, context=8))
    config = model_config(spec_of(4, context=8))
    assert ulysses_summary(config, "xla", {"context": 8, "tensor": 1}, "usp") == (
        "xla blocks, rows split over mesh.context=8 (usp): all-to-all within groups of 4 shards, 1 head per device, "
        "a ring of 2 groups; key/value heads repeated to one per query head (2 on a device do not split 4 ways)")


@pytest.mark.parametrize("kind, seq_len, attention", [("auto", 512, "splash"), ("ring", 1024, "splash"),
                                                     ("ring", 512, "xla"), ("allgather", 256, "xla")])
def test_auto_on_a_tpu_takes_the_splash_kernel_where_its_tiles_fit_the_shards(kind: str, seq_len: int,
                                                                               attention: str) -> None:
    """attention=auto on a TPU topology with mesh.context=4: the splash kernel when each shard's
    share of a row (allgather) or each half of it (ring) fills 128-token tiles, else XLA blocks."""
    from runner.models import model_config
    from runner.spec import ExecutionSpec, MeshSpec, ModelSpec, TrainSpec

    spec = dataclasses.replace(ExecutionSpec(topology="v5p-8"), mesh=MeshSpec(data=1, context=4),
                               train=TrainSpec(seq_len=seq_len, batch_size=8))
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=ModelSpec(context_parallel=kind)))
    assert model_config(spec).attention == attention


@pytest.mark.deep
def test_the_long_context_recipe_runs_end_to_end(tmp_path) -> None:
    """docs/long-context.md's recipe, its two phases: a short-context run, then a new run
    warm-started from it at 4x the sequence length with Llama 3's rotary scaling, rows split over
    mesh.context=2, documents masked, and the held-out evaluation at the long length."""
    short = [*TINY, "job=llama_tiny", "job.model.n_kv_heads=2", "job.model.head_dim=16", "data.document_mask=true",
             "train.steps=20", "checkpoint.every_steps=20", "eval.every=0"]
    first = run_runner([*short, "run.dir=short"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    long = [*short, "job.model.context_length=128", "train.seq_len=128", "train.steps=6", "eval.every=6",
            "job.model.rope.scaling=llama3", "job.model.rope.factor=4", "job.model.rope.original_context=32",
            "mesh.data=1", "mesh.context=2", "topology=cpu-2"]
    warm = run_runner([*long, "run.init_from=short", "run.dir=long"], tmp_path, devices=2)
    assert warm.returncode == 0, warm.stderr[-3000:]
    cold = run_runner([*long, "run.dir=cold"], tmp_path, devices=2)
    assert cold.returncode == 0, cold.stderr[-3000:]
    warm_records, cold_records = read_metrics(tmp_path / "long"), read_metrics(tmp_path / "cold")
    assert [r["loss"] for r in warm_records if r.get("step") == 1][0] < \
        [r["loss"] for r in cold_records if r.get("step") == 1][0] - 1.0  # it starts from what the short run learned
    evals = [r for r in warm_records if "eval/stdlib/loss" in r]
    assert evals and evals[-1]["step"] == 6 and np.isfinite(evals[-1]["eval/stdlib/loss"])


@pytest.mark.parametrize("topology, seq_len, n_heads, kind, why", [
    ("h100-8", 4096, 8, "ulysses", "on a GPU only ulysses attends by cuDNN's fused kernel"),
    ("h100-8", 4096, 2, "usp", "the 2 heads a device holds do not split 4 ways; usp exchanges them in groups of 2"),
    ("h100-8", 4096, 1, "ring", "no all-to-all group splits the 1 heads a device holds"),
    ("v5p-8", 131072, 8, "ulysses", "splash's tables for whole 131,072-token rows fit scalar memory"),
    ("v5p-8", 1048576, 8, "ring", "splash's tables for whole 1,048,576-token rows exceed scalar memory; ring runs"),
    ("v5p-8", 4096, 2, "ring", "the 2 heads a device holds do not split 4 ways; ring runs the splash kernel"),
    ("v5p-8", 1536, 2, "allgather", "ring's half blocks do not fill splash's 128-token tiles"),
    ("cpu-4", 512, 4, "allgather", "XLA blocks run every kind alike"),
])
def test_auto_picks_the_context_split_per_platform_and_shape_and_says_why(topology: str, seq_len: int, n_heads: int,
                                                                          kind: str, why: str) -> None:
    """context_parallel=auto over mesh.context=4: on a GPU ulysses (cuDNN on whole rows) when the
    heads split, else usp, else ring; on a TPU ulysses while whole rows' splash tables fit scalar
    memory, else ring (splash per block), else allgather; on a CPU allgather. The model runs what
    was chosen, and the reason is what the launch's attention line adds."""
    from runner.models import context_choice, model_config
    from runner.models.attention.context import whole_row_tables_fit
    from runner.spec import ExecutionSpec, MeshSpec, ModelSpec, TrainSpec

    spec = dataclasses.replace(ExecutionSpec(topology=topology), mesh=MeshSpec(data=1, context=4),
                               train=TrainSpec(seq_len=seq_len, batch_size=8))
    model = ModelSpec(family="llama", n_heads=n_heads, d_model=64 * n_heads, context_length=seq_len)
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=model))
    chosen, reason = context_choice(spec)
    assert chosen == kind and why in reason, reason
    assert model_config(spec).context_parallel == kind
    assert whole_row_tables_fit(370688) and not whole_row_tables_fit(370689)  # 724 blocks of 512 a side: 1 MiB
    named = dataclasses.replace(spec, job=dataclasses.replace(spec.job, model=dataclasses.replace(
        model, context_parallel="ring")))
    assert context_choice(named) == ("ring", "")


NO_WHOLE_ROWS = r"""
import json, re
from hydra import compose, initialize_config_dir
from runner.main.cli import CONF_DIR, CONFIG_NAME, prepare
from runner.main.config import build_spec
from runner.train.job import JOBS
prepare()
found = {}
for kind in ("allgather", "ring", "ulysses"):
    ov = ["job=llama_tiny", "topology=cpu-4", "mesh.data=1", "mesh.context=4", "train.seq_len=1024",
          "job.model.context_length=1024", "job.model.d_model=192", "train.batch_size=1", "train.accumulate_steps=1",
          "eval.batch_size=1", "job.model.attention=xla", "data.strategy=synthetic", "logging.wandb=disabled",
          f"job.model.context_parallel={kind}"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        spec = build_spec(compose(CONFIG_NAME, overrides=ov), ov)
    job = JOBS.get(spec.job.trainer)(spec)
    abstract, job.program.state_sharding = job.program.abstract_state()
    with job.program.context():
        text = job.program.train_step.lower(abstract, job.program.abstract_batch()).compile().as_text()
    kinds = "(?:all-gather|all-to-all|collective-permute)(?:-start)?"
    moved = re.findall(r"= ([a-z0-9]+\[[0-9,]*\])[^=\n]*? " + kinds + r"\(", text)
    found[kind] = sorted({shape for shape in moved if re.search(r"\b1024,192\]", shape)})
print(json.dumps(found))
"""


@pytest.mark.deep
def test_no_device_gathers_whole_rows_of_hidden_states(tmp_path) -> None:
    """The zig-zag order is put on a row's integers (tokens, positions, segments, targets) and
    taken off each token's loss: the compiled step of every kind on (context 4) moves no whole row
    of hidden states (B, T, d_model), as it did when the order was put on the embedded row and
    taken off the final one (64 GiB a device at 4,194,304 tokens of Llama 3 8B)."""
    assert run_script(NO_WHOLE_ROWS, tmp_path) == {"allgather": [], "ring": [], "ulysses": []}
