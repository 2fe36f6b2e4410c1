"""DeepSeek-V3 (latent attention with low-rank queries and YaRN RoPE, a dense block before two Mixture-of-Experts
blocks with shared experts and load balancing) through the same trainer and parallelisms as Llama 3 and Qwen3, on real
MPI ranks against one process at the same global batch: FSDP 2 under full activation checkpointing, EP 2 x efsdp 2
under op-level checkpointing, PP 2 (1F1B), CP 2, TP 2 x FSDP 2 and EP 2 x TP 2 (ETP 1) give the same losses, gradient
norms and learning rates (1e-5 relative) over 10 float32 steps; a checkpoint saved on TP 2 x EP 2 (ETP 1) resumes on
one process and continues as the uninterrupted run does, and exports to torch DCP in torchtitan's layout; the
initialisation is torchtitan's."""
import json
import re
import shutil

import pytest
from safetensors.torch import load_file

from titan_testing import binary, compare_steps, read_checkpoint, run
from test_pipeline_parallel_parity import mpirun

STEPS = 10
# A small DeepSeek-V3: width 64, 4 heads of 16 + 16 query/key and 16 value columns over a 32-wide latent, queries
# through a 32-wide low-rank projection; 8 experts of width 32, top 2 (debugmodel's softmax routing, 2 shared experts),
# balancing at a step of 0.01; a model of 8,192 positions over YaRN's 4,096-position original context.
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.dim", "64", "--model.n_layers", "3",
            "--model.n_dense_layers", "1", "--model.n_heads", "4", "--model.hidden_dim", "128", "--model.q_lora_rank", "32",
            "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "16",
            "--model.v_head_dim", "16", "--model.moe_num_experts", "8", "--model.moe_top_k", "2", "--model.moe_inter_dim", "32",
            "--model.moe_load_balance_coeff", "0.01", "--model.max_seq_len", "8192"]
COMMON = [*DEEPSEEK, "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.seq_len", "32",
          "--training.global_batch_size", "8", "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3",
          "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.total_steps", "12", "--training.max_norm", "0.5",
          "--debug.seed", "0", "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--training.data_lanes", "4",
          "--activation_checkpoint.mode", "none"]


def probe(tmp_path, name, np, extra, steps=STEPS):
    out = tmp_path / name
    cmd = ([] if np == 1 else mpirun(np)) + [binary("titan_train_probe"), "--probe.out", str(out),
                                             "--job.dump_folder", str(tmp_path / "dump"), *COMMON,
                                             "--training.steps", str(steps), *extra]
    result = run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    return json.loads((out / "metrics.json").read_text()), load_file(str(out / "final.safetensors")), result.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 12 steps (the layouts compare the first 10; the resumed run steps 11 and 12)."""
    return probe(tmp_path_factory.mktemp("single"), "single", 1, ["--training.local_batch_size", "2"], steps=12)


CASES = {  # name: (ranks, options)
    "fsdp2_full_ac": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2",
                          "--activation_checkpoint.mode", "full"]),
    "ep2_efsdp2_op_ac": (4, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2",
                             "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    "pp2_1F1B": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
                     "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "2"]),
    # torchtitan's latent-attention TP plan: wq_b and wkv_b column-wise, wo row-wise, wq_a/wkv_a and their norms whole.
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
}
# EP borrowing the TP ranks (ETP 1): each expert whole on one rank of the TP pair, the attention split over both; the
# layout the checkpoint below is saved on.
TP2_EP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
           "--training.local_batch_size", "4"]
CASES["ep2_tp2_etp1"] = (4, TP2_EP2)


def test_model_is_deepseek_v3(reference):
    meta, weights, stdout = reference
    assert "Model deepseek_v3 debugmodel with" in stdout, stdout
    # DeepseekV3ForCausalLM's names: latent attention with low-rank queries, a dense first block, per-expert tensors.
    assert weights["model.layers.0.self_attn.q_a_proj.weight"].shape == (32, 64)
    assert weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (48, 64)
    assert weights["model.layers.0.self_attn.kv_b_proj.weight"].shape == (128, 32)
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)
    assert weights["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert weights["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (64, 64)
    assert len(meta["steps"]) == 12


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(tmp_path, reference, case):
    np, extra = CASES[case]
    ref_meta, _, _ = reference
    meta, _, out = probe(tmp_path, case, np, extra)
    assert meta["world_size"] == np and len(meta["steps"]) == STEPS
    worst = compare_steps(meta, {"steps": ref_meta["steps"][:STEPS]}, case, check_lr=True)
    print(f"deepseek_v3 {case}: worst relative loss difference {worst:.2e} over {STEPS} steps")


@pytest.fixture(scope="module")
def tp2_ep2_checkpoint(tmp_path_factory, reference):
    """The dump folder of a TP 2 x EP 2 (ETP 1) run saved at step 10, whose logged losses equal one process's."""
    ref_meta, _, _ = reference
    dump = tmp_path_factory.mktemp("tp2_ep2") / "dump"
    save = mpirun(4) + [binary("titan"), "train", "--job.dump_folder", str(dump), *COMMON, "--training.steps", "10",
                        *TP2_EP2, "--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.no_last_save_model_only"]
    saved = losses(run(save, env={"OMP_NUM_THREADS": "1"}, timeout=900).stdout)
    assert sorted(saved) == list(range(1, 11))
    for step, loss in saved.items():
        # The log line's 5 decimals: the straight run's loss rounded alike.
        assert abs(loss - ref_meta["steps"][step - 1]["loss"]) <= 1e-5 * loss + 5e-6, (step, loss)
    metadata = json.loads((dump / "checkpoint" / "step-10" / "metadata.json").read_text())
    assert metadata["model"]["family"] == "deepseek_v3" and metadata["model"]["mla"]["q_lora_rank"] == 32
    return dump


def test_checkpoint_from_tp2_ep2_resumes_on_one_process(tmp_path, reference, tp2_ep2_checkpoint):
    """Resumed on one process from step 10 of the TP 2 x EP 2 (ETP 1) run, steps 11 and 12 are the uninterrupted
    run's."""
    ref_meta, _, _ = reference
    dump = tmp_path / "dump"
    shutil.copytree(tp2_ep2_checkpoint, dump)
    out = tmp_path / "resumed"
    resume = [binary("titan_train_probe"), "--probe.out", str(out), "--job.dump_folder", str(dump), *COMMON,
              "--training.steps", "12", "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.load_step", "10"]
    run(resume, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    meta = json.loads((out / "metrics.json").read_text())
    assert [s["step"] for s in meta["steps"]] == [11, 12]
    compare_steps(meta, {"steps": ref_meta["steps"][10:]}, "resumed from tp2_ep2", check_lr=True)


def test_checkpoint_exports_to_dcp_that_torchtitans_model_loads(tmp_path, tp2_ep2_checkpoint):
    """`titan convert --format dcp` writes the TP 2 x EP 2 checkpoint in torchtitan's layout: torch.distributed.checkpoint
    loads it into torchtitan's own DeepSeekV3Model of the same shape (whose state dict has no optional keys: latent
    attention's projections and norms, 3-D experts, shared experts, balancing biases) with every tensor equal."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    step = tp2_ep2_checkpoint / "checkpoint" / "step-10"
    _, saved = read_checkpoint(step)
    run([binary("titan"), "convert", "--from", str(step), "--to", str(tmp_path / "dcp"), "--format", "dcp"])
    state = torchtitan_model(saved["model.tok_embeddings.weight"].shape[0]).state_dict()
    assert "layers.1.moe.expert_bias" in state and "layers.0.attention.wkv_b.weight" in state
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    compared = 0
    for key, value in state.items():
        if "freqs_cis" in key or "tokens_per_expert" in key:
            continue
        np.testing.assert_array_equal(value.float().numpy(), saved["model." + key], err_msg=key)
        compared += 1
    assert compared == sum(1 for k in saved if k.startswith("model.")), compared
    assert np.abs(saved["model.layers.2.moe.expert_bias"]).max() > 0


def torchtitan_model(vocab_size):
    """torchtitan's own DeepSeekV3Model of DEEPSEEK's shape (its debugmodel's routing), initialised by its
    init_weights."""
    import torch
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
    from torchtitan.models.moe import MoEArgs

    args = DeepSeekV3ModelArgs(vocab_size=vocab_size, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=3, n_dense_layers=1,
                               n_heads=4, moe_args=MoEArgs(num_experts=8, num_shared_experts=2, top_k=2, score_func="softmax",
                                                           route_norm=False, score_before_experts=False, use_grouped_mm=False,
                                                           load_balance_coeff=0.01),
                               q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                               max_seq_len=8192)
    args.moe_impl = "standard"  # what torchtitan's update_from_config sets
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def test_initialisation_matches_torchtitans(tmp_path):
    """titan's seed checkpoint (step 0, model only) against torchtitan's init_weights on the same shape, tensor by
    tensor: the same distribution (norms at one, balancing biases at zero, the embedding at std 1, the projections at
    0.02 or the depth-scaled 0.02 / sqrt(2 (layer + 1)) for wo, w2, w3 and the experts', the output at dim^-0.5 cut at
    3 std), the standard deviations within six standard errors of each other's, and the output within its cut-off."""
    import numpy as np

    dump = tmp_path / "dump"
    run([binary("titan"), "train", "--job.dump_folder", str(dump), *COMMON, "--training.steps", "1", "--training.local_batch_size",
         "2", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--checkpoint.last_save_model_only"],
        env={"OMP_NUM_THREADS": "1"})
    _, seed = read_checkpoint(dump / "checkpoint" / "step-0")
    theirs = {k: v.float().numpy() for k, v in torchtitan_model(seed["model.tok_embeddings.weight"].shape[0]).state_dict().items()
              if "freqs_cis" not in k and "tokens_per_expert" not in k}
    assert sorted("model." + k for k in theirs) == sorted(seed), sorted(set(seed) ^ {"model." + k for k in theirs})
    for key, reference in theirs.items():
        mine = seed["model." + key].astype(np.float64)
        if reference.std() == 0:  # norms at one, biases at zero
            np.testing.assert_array_equal(mine, reference, err_msg=key)
            continue
        tolerance = 6 / np.sqrt(2 * mine.size)
        assert abs(mine.std() / reference.std() - 1) < tolerance, (key, mine.std(), reference.std())
        assert abs(mine.mean()) < 6 * reference.std() / np.sqrt(mine.size), (key, mine.mean())
    cut = 3 * 64 ** -0.5
    assert np.abs(seed["model.output.weight"]).max() <= cut * (1 + 1e-6)


def losses(stdout):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", stdout)}
