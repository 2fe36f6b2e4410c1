"""DeepSeek-V3 (latent attention with low-rank queries and YaRN RoPE, a dense block before two Mixture-of-Experts
blocks with shared experts and load balancing) through the same trainer and parallelisms as Llama 3 and Qwen3, on real
MPI ranks against one process at the same global batch: FSDP 2 under full activation checkpointing, EP 2 x efsdp 2
under op-level checkpointing, PP 2 (1F1B), CP 2 and TP 2 x FSDP 2 give the same losses, gradient norms and learning
rates (1e-5 relative) over 10 float32 steps; a checkpoint saved on TP 2 x EP 2 (ETP 1) resumes on one process and
continues as the uninterrupted run does."""
import json
import re

import pytest
from safetensors.torch import load_file

from titan_testing import binary, compare_steps, run
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
# EP borrowing the TP ranks (ETP 1): the layout the checkpoint below is saved on.
TP2_EP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
           "--training.local_batch_size", "4"]


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


def test_checkpoint_from_tp2_ep2_resumes_on_one_process(tmp_path, reference):
    """Saved at step 10 of a TP 2 x EP 2 (ETP 1) run, whose losses equal one process's; resumed on one process, steps
    11 and 12 are the uninterrupted run's."""
    ref_meta, _, _ = reference
    dump = tmp_path / "dump"
    save = mpirun(4) + [binary("titan"), "train", "--job.dump_folder", str(dump), *COMMON, "--training.steps", "10",
                        *TP2_EP2, "--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.no_last_save_model_only"]
    saved = losses(run(save, env={"OMP_NUM_THREADS": "1"}, timeout=900).stdout)
    assert sorted(saved) == list(range(1, 11))
    for step, loss in saved.items():
        # The log line's 5 decimals: the straight run's loss rounded alike.
        assert abs(loss - ref_meta["steps"][step - 1]["loss"]) <= 1e-5 * loss + 5e-6, (step, loss)
    metadata = json.loads((dump / "checkpoint" / "step-10" / "metadata.json").read_text())
    assert metadata["model"]["family"] == "deepseek_v3" and metadata["model"]["mla"]["q_lora_rank"] == 32
    out = tmp_path / "resumed"
    resume = [binary("titan_train_probe"), "--probe.out", str(out), "--job.dump_folder", str(dump), *COMMON,
              "--training.steps", "12", "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.load_step", "10"]
    run(resume, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    meta = json.loads((out / "metrics.json").read_text())
    assert [s["step"] for s in meta["steps"]] == [11, 12]
    compare_steps(meta, {"steps": ref_meta["steps"][10:]}, "resumed from tp2_ep2", check_lr=True)


def losses(stdout):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", stdout)}
