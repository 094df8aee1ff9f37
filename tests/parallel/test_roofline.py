"""The roofline of a compiled step (runner.parallel.roofline) against hand-computed cases: a pure
data-parallel step, an FSDP step, a pipeline bubble, the network between slices, the loops' traffic."""

from __future__ import annotations

import pytest

from runner.models.common.pipeline import Schedule
from runner.parallel import roofline
from runner.parallel.topology import CHIPS

V5P = roofline.Rates.of(CHIPS["v5p"])
assert V5P is not None
LINK = 1.2e12 / 6  # one v5p port, both directions


def test_each_collective_receives_what_its_ring_moves() -> None:
    """A device of a group of 4: an all-gather receives the 3 shards it lacks, an all-reduce twice
    that (reduce-scatter, then all-gather), a reduce-scatter the 3 other devices' copies of its share."""
    assert roofline.received_bytes("all-gather", 400, 4) == 300
    assert roofline.received_bytes("all-reduce", 400, 4) == 600
    assert roofline.received_bytes("reduce-scatter", 100, 4) == 300
    assert roofline.received_bytes("all-to-all", 400, 4) == 300
    assert roofline.received_bytes("collective-permute", 400, 2) == 400
    assert roofline.received_bytes("all-gather", 400, 1) == 0


def test_a_group_uses_one_ring_per_grid_dimension_it_spreads_over() -> None:
    coords = [(x, y, z) for z in range(2) for y in range(2) for x in range(2)]
    assert roofline.dims_spanned([0, 1], coords) == 1
    assert roofline.dims_spanned([0, 1, 2, 3], coords) == 2
    assert roofline.dims_spanned(list(range(8)), coords) == 3
    assert roofline.dims_spanned([0, 1], [None, None]) == 1  # devices without coordinates


DATA_PARALLEL = """HloModule step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[1000000]) -> f32[1000000] {
  %p = f32[1000000]{0} parameter(0)
  ROOT %ar = f32[1000000]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
}
"""

FSDP = """HloModule step

%body (x: (s32[], bf16[1048576])) -> (s32[], bf16[1048576]) {
  %x = (s32[], bf16[1048576]{0}) parameter(0)
  %w = bf16[131072]{0} parameter(1)
  %ags = bf16[1048576]{0} all-gather-start(%w), replica_groups=[1,8]<=[8], dimensions={0}
  %ag = bf16[1048576]{0} all-gather-done(%ags)
  ROOT %t = (s32[], bf16[1048576]{0}) tuple(%i, %ag)
}

%cond (x: (s32[], bf16[1048576])) -> pred[] {
  %x = (s32[], bf16[1048576]{0}) parameter(0)
  %n = s32[] constant(32)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p: bf16[131072]) -> bf16[1048576] {
  %p = bf16[131072]{0} parameter(0)
  ROOT %loop = (s32[], bf16[1048576]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_pure_data_parallel_step_is_its_gradient_all_reduce_over_one_ring() -> None:
    """4 devices in a row reduce a 4 MB gradient: each receives 2 x 3/4 x 4 MB over one ring."""
    coords = [(x, 0, 0) for x in range(4)]
    seconds, received = roofline.ici_seconds(DATA_PARALLEL, V5P, coords)
    assert received == pytest.approx(2 * 0.75 * 4e6)
    assert seconds == pytest.approx(2 * 0.75 * 4e6 / LINK)


def test_an_fsdp_step_gathers_each_layer_in_the_scan_over_the_dimensions_its_group_spans() -> None:
    """8 devices of a 2x2x2 cube gather a 2 MiB layer 32 times (the scan's trips): 7/8 of it each
    time, over three rings at once."""
    coords = [(x, y, z) for z in range(2) for y in range(2) for x in range(2)]
    seconds, received = roofline.ici_seconds(FSDP, V5P, coords)
    layer = 1048576 * 2
    assert received == pytest.approx(32 * layer * 7 / 8)
    assert seconds == pytest.approx(32 * layer * 7 / 8 / (3 * LINK))
    # the same group across two slices is the network's, not the links'
    assert roofline.ici_seconds(FSDP, V5P, coords, slice_of=[0, 0, 0, 0, 1, 1, 1, 1]) == (0.0, 0.0)


def test_the_estimate_is_the_slowest_term_stretched_by_the_bubble() -> None:
    """6e15 model FLOPs on 8 v5p devices with full remat: 8e15 / 8 / 459e12 s of compute; a pipeline
    of 4 stages and 8 microbatches idles (4-1)/(8+4-1) of each stage's iterations."""
    kwargs = dict(rates=V5P, model_flops=6e15, devices=8, chips=8, tokens=8 * 4096, bytes_accessed=None,
                  loops=1.0, dcn_bytes=0.0)
    flat = roofline.estimate_step(remat="full", ici=(0.5, 1e9), bubble=0.0, **kwargs)
    compute = 8e15 / 8 / 459e12
    assert flat.compute_s == pytest.approx(compute) and flat.bound == "compute"
    assert flat.step_s == pytest.approx(compute)
    assert flat.mfu == pytest.approx(6e15 / (compute * 459e12 * 8))  # 3/4: the recomputed forward is not model work
    bubble = Schedule(stages=4, microbatches=8).bubble
    assert bubble == pytest.approx(3 / 11)
    piped = roofline.estimate_step(remat="full", ici=(0.5, 1e9), bubble=bubble, **kwargs)
    assert piped.step_s == pytest.approx(compute / (1 - 3 / 11))
    network = roofline.estimate_step(remat="none", ici=(0.0, 0.0), bubble=0.0,
                                     **{**kwargs, "dcn_bytes": 6.25e9 * 10})
    assert network.bound == "DCN" and network.dcn_s == pytest.approx(10.0)
    # XLA counted the scan's body once: its bytes go up by what the loops repeat, and add to the compute
    scaled = roofline.estimate_step(remat="none", ici=(0.0, 0.0), bubble=0.0,
                                    **{**kwargs, "bytes_accessed": 1e9, "loops": 32.0})
    assert scaled.hbm_bytes == pytest.approx(32e9)
    assert scaled.step_s == pytest.approx(6e15 / 8 / 459e12 + 32e9 / 2.765e12)


def test_the_loops_repeat_the_traffic_of_their_bodies() -> None:
    """The FSDP program above: a parameter read and the gathered layer written 32 times (the
    collectives themselves are the ICI term's), against once: a factor of 32 on what the body moves."""
    tuple_ = roofline.loop_factor(FSDP.replace("ROOT %t = (s32[], bf16[1048576]{0}) tuple(%i, %ag)",
                                               "ROOT %t = bf16[1048576]{0} negate(%ag)"))
    assert tuple_ == pytest.approx(32.0)
    assert roofline.loop_factor(DATA_PARALLEL) == 1.0  # no loop: no repeats
