"""Tensor parallelism (+ sequence parallel, loss parallel) alone and with FSDP, DDP and HSDP on real MPI ranks
against one process at the same global batch: 6 float32 steps give the same losses and gradient norms (1e-5
relative) and final weights; every layout starts from bitwise the same weights (layout-independent init); each
rank holds exactly its share of the parameters and optimizer state; bad degrees are clear errors."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from titan_testing import binary, run, compare_steps

STEPS = 6
COMMON = ["--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.steps", str(STEPS),
          "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.global_batch_size", "8",
          "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "3",
          "--training.max_norm", "0.5", "--debug.seed", "0", "--metrics.log_freq", "100", "--metrics.disable_color_printing",
          "--training.data_lanes", "4", "--activation_checkpoint.mode", "none"]


def mpirun(np):
    return [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(np)]


def probe(tmp_path, name, np, extra, dp=None):
    out = tmp_path / name
    dp = dp or 1
    validation = ["--probe.validate", "--validation.enable", "--validation.dataset", "fortunes", "--validation.seq_len", "64",
                  "--validation.local_batch_size", str(8 // dp), "--validation.steps", "2"]
    cmd = ([] if np == 1 else mpirun(np)) + [binary("titan_train_probe"), "--probe.out", str(out),
                                             "--job.dump_folder", str(tmp_path / "dump"), *COMMON, *validation, *extra]
    run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    return (json.loads((out / "metrics.json").read_text()), load_file(str(out / "initial.safetensors")),
            load_file(str(out / "final.safetensors")))


MODELS = {  # the one-process reference each case compares with
    "mha": [],
    "gqa": ["--model.flavor", "debugmodel_gqa"],
    "block_causal": ["--model.attn_mask_type", "block_causal"],
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = probe(tmp_path_factory.mktemp(f"single_{model}"), "single", 1, MODELS[model])
        return cache[model]
    return get


def degrees(tp, shard=1, replicate=1):
    return ["--parallelism.tensor_parallel_degree", str(tp), "--parallelism.data_parallel_shard_degree", str(shard),
            "--parallelism.data_parallel_replicate_degree", str(replicate)]


# name: (reference model, ranks, tp, dp_shard, dp_replicate, extra)
CASES = {
    "tp2": ("mha", 2, 2, 1, 1, []),
    # Each of these also runs an activation checkpointing mode (the reference runs none).
    "tp4_ac_full": ("mha", 4, 4, 1, 1, ["--activation_checkpoint.mode", "full"]),
    "tp2_fsdp2": ("mha", 4, 2, 2, 1, []),
    "ddp2_tp2_ac_op": ("mha", 4, 2, 1, 2, ["--activation_checkpoint.mode", "selective",
                                           "--activation_checkpoint.selective_ac_option", "op"]),
    "hsdp2x2_tp2": ("mha", 8, 2, 2, 2, []),
    "tp2_no_loss_parallel": ("mha", 2, 2, 1, 1, ["--parallelism.disable_loss_parallel"]),
    "gqa_tp2": ("gqa", 2, 2, 1, 1, MODELS["gqa"]),
    "gqa_tp4_fsdp2": ("gqa", 8, 4, 2, 1, MODELS["gqa"] + ["--parallelism.fsdp_reshard_after_forward", "always"]),
    "block_causal_tp2_fsdp2": ("block_causal", 4, 2, 2, 1, MODELS["block_causal"]),
    # Async TP: batch slices with their sequence collectives in the background (local batch 2: two slices).
    "tp2_fsdp2_async_ac_full": ("mha", 4, 2, 2, 1, ["--parallelism.enable_async_tensor_parallel",
                                                    "--activation_checkpoint.mode", "full"]),
    "block_causal_tp2_async": ("block_causal", 2, 2, 1, 1, MODELS["block_causal"] + ["--parallelism.enable_async_tensor_parallel"]),
}


def expected_local_elements(layouts_of_rank0, tp, shard):
    """Rank 0's parameter elements from the shapes alone: TP splits every matrix (dim 0 for column-parallel wq,
    wk, wv, w1, w3, the embedding and the output; dim 1 for wo, w2) and leaves norms whole; FSDP then takes
    ceil(rows / shard) rows of what is left."""
    total = 0
    for name, info in layouts_of_rank0.items():
        shape = list(info["global_shape"])
        if len(shape) == 2:
            dim = 1 if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0
            shape[dim] //= tp
        if shard > 1:
            shape[0] = math.ceil(shape[0] / shard)
        total += math.prod(shape)
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(tmp_path, references, case):
    model, np_, tp, shard, replicate, extra = CASES[case]
    ref_meta, ref_initial, ref_final = references(model)
    meta, initial, final = probe(tmp_path, case, np_, degrees(tp, shard, replicate) + extra, dp=shard * replicate)
    RUNS[case] = meta
    assert meta["world_size"] == np_
    # Layout-independent initialisation: the same global weights, bitwise, on every layout.
    for name, ref in ref_initial.items():
        assert torch.equal(initial[name], ref), f"{case}: initial {name} differs"
    worst = compare_steps(meta, ref_meta, case, check_lr=True)
    for name, ref in ref_final.items():
        torch.testing.assert_close(final[name], ref, rtol=1e-4, atol=3e-5, msg=lambda m: f"{case} {name}: {m}")
    # Exactly 1/(tp x dp_shard) of every sharded tensor (FSDP rows padded up) plus the whole norms, for the
    # parameters and for each of AdamW's two moments.
    shapes = {name: {"global_shape": list(t.shape)} for name, t in ref_final.items()}
    expected = expected_local_elements({to_titan(n): s for n, s in shapes.items()}, tp, shard)
    assert meta["local_parameter_elements"] == expected, (meta["local_parameter_elements"], expected)
    assert meta["optimizer_state_elements"] == 2 * expected
    print(f"{case}: worst relative loss difference {worst:.2e} over {STEPS} steps; rank 0 holds "
          f"{meta['local_parameter_elements'] / ref_meta['local_parameter_elements']:.3f} of the parameters; "
          f"wq placed {meta['layouts']['layers.0.attention.wq.weight']['placement']}")


def to_titan(hf_name):
    """HF parameter names back to titan's (only the suffix matters for the placement rule)."""
    table = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    name = hf_name.removeprefix("model.")
    for hf, titan in table.items():
        name = name.replace(hf, titan)
    return name


RUNS = {}  # the layouts' metrics, by case, for the comparison below


def test_loss_parallel_on_and_off_give_the_same_loss(tmp_path):
    """The TP 2 layouts with and without loss parallelism (their runs above, or run here when selected alone)."""
    on = RUNS.get("tp2") or probe(tmp_path, "on", 2, degrees(2))[0]
    off = RUNS.get("tp2_no_loss_parallel") or probe(tmp_path, "off", 2, degrees(2) + ["--parallelism.disable_loss_parallel"])[0]
    for a, b in zip(on["steps"], off["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


@pytest.mark.parametrize("np_,args,needles", [
    (3, degrees(3), ["tensor_parallel_degree = 3", "model n_heads (query heads) = 16 does not divide by 3"]),
    (8, degrees(8) + ["--model.flavor", "debugmodel_gqa"], ["n_kv_heads (key/value heads) = 4 does not divide by 8"]),
    (2, degrees(2) + ["--training.seq_len", "63"], ["training.seq_len = 63 does not divide by 2"]),
    (2, degrees(4), ["tensor_parallel_degree (4)", "must equal the number of processes (2)"]),
])
def test_bad_degrees_are_clear_errors(tmp_path, np_, args, needles):
    cmd = mpirun(np_) + [binary("titan"), "train", "--job.dump_folder", str(tmp_path), "--model.hf_assets_path", "builtin",
                         "--training.steps", "1", "--training.seq_len", "64", *args]
    result = run(cmd, check=False, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode != 0
    for needle in needles:
        assert needle in result.stderr, result.stderr[-3000:]
    assert "frame #" not in result.stderr
