"""Context parallelism on the torch engine, on CPU processes (gloo): a tiny Llama (seq 64) whose sequences are
split over 2 CP ranks trains as one process does, alone, over FSDP2 with DP2, with TP2 (and sequence
parallelism), with ZeRO-1, checkpointing, the chunked loss and activation offload, and with FSDP2's offload:
the first losses and gradient norms equal the single process's (rel 1e-4; the norm checks the gradients after
the dp x cp reduction, which the losses alone, under AdamW, would not), and the traced peak of a CP rank is
its measured one. Each CP rank reads its two balanced chunks of every sequence with the true next-token
labels, the cp mesh leaves the meshes without CP as they were, and the spec refuses CP where the engine
cannot split the sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hp_tool.contracts.spec import TrialSpec
from hp_tool.errors import ConfigError
from hp_tool.trial.trace.limits import untraceable_reason
from hp_tool.trial.trace.replay import trace_stage
from hp_tool.trial.train import run_trial
from trial_helpers import launched, read_metrics, read_result, tiny_spec, torchrun, write_spec

REL = 1e-4
TRACE_REL = 0.03  # test_memtrace's tolerance for a traced peak against the measured one


def cp_spec(**layout) -> TrialSpec:
    """The tiny Llama for 3 steps, the first two untimed (their tensor peak is measured); ``extra``: the long-
    context fields ``tiny_spec`` does not take."""
    extra = layout.pop("extra", {})
    spec = tiny_spec("llama", max_steps=3, warmup_steps=2, **layout)
    return dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, **extra)) if extra else spec


def run(spec: TrialSpec, folder) -> tuple[list[dict], dict]:
    """(metrics, result) of ``spec`` run in this process (one rank) or under torchrun."""
    folder.mkdir()
    world = spec.resources.gpus_per_node
    if world == 1:
        run_trial(write_spec(spec, folder), str(folder / "out"))
    else:
        proc = torchrun(write_spec(spec, folder), folder / "out", world)
        assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(folder / "out")
    assert result["status"] == "ok", result["reason"]
    return read_metrics(folder / "out"), result


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[dict]:
    """The single process's metrics: the reference every CP layout must reproduce (launched once per session:
    tests/test_trial_layouts.py's Llama reference is the same spec)."""
    launch = launched(tmp_path_factory, cp_spec())
    result = launch.result()
    assert result["status"] == "ok", result["reason"]
    return launch.metrics()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    # the covering set (default run): the ring over the CP ranks holding the same heads with sequence parallelism
    # and FSDP2 on the cp x tp grid; ZeRO-1 (the replicate wrapper over the CP ranks, the optimizer sharded) with
    # the long-context savers. Each parallelism once; the other cells are the matrix tier (-m matrix).
    pytest.param(dict(cp=2, tp=2, zero_stage=3, extra=dict(sequence_parallel=True)), id="cp2-tp2-sp-fsdp"),
    pytest.param(dict(cp=2, zero_stage=1, act_ckpt=2, extra=dict(loss="chunked", loss_chunk_tokens=8,
                                                                 activation_offload=True)),
                 id="cp2-zero1-ckpt-chunked-aoff"),
    # DDP (replicate) over the 2 CP ranks
    pytest.param(dict(cp=2, zero_stage=0), id="cp2-ddp", marks=pytest.mark.matrix),
    # FSDP2 over dp x cp = 4 ranks, 2 replicas
    pytest.param(dict(cp=2, dp=2, zero_stage=3), id="cp2-dp2-fsdp"),
    # the ring over the CP ranks holding the same heads, replicated
    pytest.param(dict(cp=2, tp=2, zero_stage=0), id="cp2-tp2", marks=pytest.mark.matrix),
    pytest.param(dict(cp=2, zero_stage=3, offload="optimizer_and_params"), id="cp2-fsdp-offload",
                 marks=pytest.mark.matrix),
])
def test_context_parallel_trains_as_one_process(tmp_path, single, layout):
    spec = cp_spec(**layout)
    metrics, result = run(spec, tmp_path / "cp")
    assert [m["loss"] for m in metrics[:2]] == pytest.approx([m["loss"] for m in single[:2]], rel=REL)
    assert [m["grad_norm"] for m in metrics[:2]] == pytest.approx([m["grad_norm"] for m in single[:2]], rel=REL)
    if untraceable_reason(spec) is None:  # the pre-launch trace models a CP rank's tensors as it ran
        assert trace_stage(spec).peak_gib == pytest.approx(result["peak_tensor_memory_gib"], rel=TRACE_REL)


def test_each_cp_rank_reads_its_balanced_chunks_with_true_next_token_labels():
    """Rank r of CP2 holds chunks r and 3-r of the 4 quarters of every sequence, inputs and labels alike, and
    the label of each of its tokens is the whole sequence's next token (also at a chunk's end)."""
    from hp_tool.trial.data import TokenBatches

    cpu = torch.device("cpu")
    (whole,), labels = TokenBatches(cp_spec(), 0, cpu).replica_batch(0)
    quarter = whole.shape[1] // 4
    for rank in (0, 1):
        (mine,), my_labels = TokenBatches(cp_spec(cp=2), 0, cpu, rank).replica_batch(0)
        chunks = [slice(q * quarter, (q + 1) * quarter) for q in (rank, 3 - rank)]
        assert torch.equal(mine, torch.cat([whole[:, c] for c in chunks], dim=1))
        assert torch.equal(my_labels, torch.cat([labels[:, c] for c in chunks], dim=1))
    assert torch.equal(labels[:, :-1], whole[:, 1:])


def test_the_cp_mesh_flattens_dp_and_cp_and_leaves_other_meshes_alone():
    """On a fake process group of 8 ranks: CP2 x DP2 x TP2 is (pp, dp, cp, tp), the data-parallel wrappers'
    dp_cp spans the 4 ranks of a TP coordinate; without CP the mesh is (pp, dp, tp) as before."""
    import torch.distributed as dist

    from hp_tool.trial.dist import DistEnv, build_mesh, weight_dp_dim
    from hp_tool.trial.dist import fake_group

    fake_group(8)
    try:
        cpu = torch.device("cpu")
        spec = tiny_spec("llama", dp=2, tp=2, cp=2).parallel
        mesh = build_mesh(spec, DistEnv(0, 8, 0), cpu)
        assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp") and weight_dp_dim(spec) == "dp_cp"
        assert mesh["dp_cp"].mesh.tolist() == [0, 2, 4, 6] and mesh["cp"].mesh.tolist() == [0, 2]
        plain = tiny_spec("llama", dp=4, tp=2).parallel
        mesh = build_mesh(plain, DistEnv(0, 8, 0), cpu)
        assert mesh.mesh_dim_names == ("pp", "dp", "tp") and weight_dp_dim(plain) == "dp"
        assert mesh["dp"].mesh.tolist() == [0, 2, 4, 6]
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_a_cp2_rank_traces_below_a_whole_sequence_rank():
    """At the same sequence length and with the weights replicated (DDP), a CP2 rank's traced peak is positive
    and lower than one rank's holding the whole sequence: half the activations and logits."""
    whole = trace_stage(cp_spec(zero_stage=0)).peak_bytes
    split = trace_stage(cp_spec(cp=2, zero_stage=0)).peak_bytes
    assert 0 < split < whole


@pytest.mark.parametrize("family, layout, why", [
    ("gpt3", dict(cp=2), "ring attention"),
    ("llama", dict(cp=3), "2*CP=6 equal chunks"),  # 64 tokens
    ("llama", dict(cp=2, pp=2), "without pipeline stages"),
])
def test_cp_is_refused_where_the_engine_cannot_split_the_sequence(family, layout, why):
    with pytest.raises(ConfigError, match=why) as refused:
        tiny_spec(family, **layout)
    assert refused.value.key == "parallel.cp"
