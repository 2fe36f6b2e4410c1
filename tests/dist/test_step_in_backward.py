"""optimizer.early_step_in_backward on real MPI ranks: each parameter is updated during backward once its gradient
for the step is final. On a small Qwen3-MoE with load balancing (q/k norms, a router, 8 experts): one process gives
bitwise the losses and weights of the ordinary step without clipping (Adam works element by element), and FSDP 2,
DDP 2, TP 2 (its sequence-parallel norm weights wait for their sum over TP), TP 2 x FSDP 2, DDP 2 x TP 2 and EP 2 x efsdp 2 with
full activation checkpointing give one process's losses and gradient norms within 1e-5 (float32, 6 steps), with
every gradient accumulation each layout implies (4, 2 or 1 micro-batches)."""
import re

import pytest
import torch

from test_qwen3_layouts import MOE, probe
from titan_testing import compare_steps

STEPS = 6
EARLY = MOE + ["--optimizer.early_step_in_backward", "--training.steps", str(STEPS), "--lr_scheduler.total_steps", "12"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 4 micro-batches of 2 per step: only the last one's backward steps."""
    return probe(tmp_path_factory.mktemp("early_single"), "early_single", 1, EARLY + ["--training.local_batch_size", "2"], steps=STEPS)


def test_one_process_equals_the_ordinary_step_bitwise(tmp_path, reference):
    meta, weights, stdout = reference
    assert "Optimizer steps in backward (optimizer.early_step_in_backward)" in stdout, stdout
    assert "gradients are not clipped" in stdout, stdout
    # Every one of the 27 tensors was stepped by its own gradient accumulator's hook in the last micro-batch.
    assert stepped(stdout) == (27, 0), stdout
    plain, plain_weights, _ = probe(tmp_path, "plain", 1, MOE + ["--training.local_batch_size", "2", "--training.max_norm", "1e9",
                                                                 "--lr_scheduler.total_steps", "12"], steps=STEPS)
    assert [s["loss"] for s in meta["steps"]] == [s["loss"] for s in plain["steps"]]
    for mine, ref in zip(meta["steps"], plain["steps"]):
        # The same squares summed in another order (as each gradient became final), in float64.
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-7)
    assert weights.keys() == plain_weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, plain_weights[name]), name


def stepped(stdout):
    """(updated as their gradients became final, updated once every reduction had ended) on rank 0, step 1."""
    m = re.search(r"Optimizer steps in backward: (\d+) of this rank's parameter tensors were updated as their gradients "
                  r"became final, (\d+) once every reduction had ended", stdout)
    return (int(m.group(1)), int(m.group(2))) if m else None


# name: (ranks, data-parallel ranks, options, rank 0's tensors stepped as their gradients became final and after).
# FSDP steps a unit's shards once its reduce-scatter has ended (the embedding's in finish_gradients); DDP a bucket once
# the next one's all-reduce has started (the last one after backward); TP waits for the sums over TP of the 11
# replicated weights (2 x 4 norms, the final norm, 2 routers).
CASES = {
    "fsdp2": (2, 2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"], (27, 0)),
    "ddp2": (2, 2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                    "--training.local_batch_size", "2"], (22, 5)),
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                   "--training.local_batch_size", "4"], (16, 11)),
    "tp2_fsdp2": (4, 2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"], (16, 11)),
    # The TP shards of this small model fit DDP's first bucket (1 MiB), so everything is stepped after backward.
    "ddp2_tp2": (4, 2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4"], (0, 27)),
    "ep2_efsdp2_full_ac": (4, 4, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2",
                                  "--activation_checkpoint.mode", "full"], (27, 0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_one_process(tmp_path, reference, case):
    np, dp, extra, counts = CASES[case]
    ref_meta, _, _ = reference
    meta, _, stdout = probe(tmp_path, case, np, EARLY + extra, steps=STEPS, dp=dp)
    assert meta["world_size"] == np
    assert stepped(stdout) == counts, stdout
    worst = compare_steps(meta, ref_meta, f"early step {case}", check_lr=True)
    print(f"early step {case}: worst relative loss difference {worst:.2e} over {STEPS} steps")
