"""Qwen3 (q/k norms, an explicit head_dim wider than dim / n_heads, the half-split rotary layout) through the same
trainer and parallelisms as Llama 3, on real MPI ranks against one process at the same global batch: FSDP 2,
TP 2 x FSDP 2, PP 2 (1F1B) and CP 2, with full, per-layer and op-level activation checkpointing among them, give the
same losses, gradient norms and learning rates (1e-5 relative) over 10 float32 steps; a checkpoint saved on
TP 2 x FSDP 2 resumes on one process and continues as the uninterrupted run does. Qwen3-MoE with load balancing likewise
on FSDP 2, expert parallelism (EP 2 x efsdp 2, EP 4, HSDP 2 x EP 2, CP 2 x EP 2, PP 2 x EP 2), zero-bubble PP 2 and
tensor parallelism (TP 2 x FSDP 2, TP 2 x EP 2 with ETP 1, FSDP 4 x TP 2 x EP 2 with ETP 2), and a checkpoint saved under EP 2 x efsdp 2
resumes on one process, on EP 4 and on FSDP 4 without EP with the same weights, AdamW moments and balancing biases,
and what FSDP 4 then saves loads on EP 2 x efsdp 2."""
import json
import shutil
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from titan_testing import binary, compare_steps, run

STEPS = 10
# A small Qwen3: 4 query heads of 32 (128 wide against dim 64), 2 key/value heads, untied so that every layout
# (PP's stage split included) holds the same parameters.
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--model.dim", "64", "--model.n_layers", "2",
         "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.head_dim", "32", "--model.hidden_dim", "128",
         "--model.tie_word_embeddings", "false"]
COMMON = [*QWEN3, "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.seq_len", "32",
          "--training.global_batch_size", "8", "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3",
          "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.total_steps", "12", "--training.max_norm", "0.5",
          "--debug.seed", "0", "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--training.data_lanes", "4",
          "--activation_checkpoint.mode", "none"]


def mpirun(np):
    return [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(np)]


def probe(tmp_path, name, np, extra, steps=STEPS, dp=1):
    out = tmp_path / name
    validation = ["--probe.validate", "--validation.enable", "--validation.dataset", "fortunes", "--validation.seq_len", "32",
                  "--validation.local_batch_size", str(8 // dp), "--validation.steps", "2"]
    cmd = ([] if np == 1 else mpirun(np)) + [binary("titan_train_probe"), "--probe.out", str(out),
                                             "--job.dump_folder", str(tmp_path / "dump"), *COMMON,
                                             "--training.steps", str(steps), *validation, *extra]
    result = run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    return json.loads((out / "metrics.json").read_text()), load_file(str(out / "final.safetensors")), result.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 12 steps (the layouts compare the first 10; the resumed run steps 11 and 12)."""
    return probe(tmp_path_factory.mktemp("single"), "single", 1, ["--training.local_batch_size", "2"], steps=12)


# Each layout also runs one activation checkpointing mode (the reference runs none): recomputation must not change
# a float32 step.
CASES = {  # name: (ranks, data-parallel ranks, options)
    "fsdp2_full_ac": (2, 2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2",
                             "--activation_checkpoint.mode", "full"]),
    "tp2_fsdp2_selective_ac_1": (4, 2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                                        "--training.local_batch_size", "2", "--activation_checkpoint.mode", "selective",
                                        "--activation_checkpoint.selective_ac_option", "1"]),
    "pp2_1F1B_op_ac": (2, 1, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
                              "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4",
                              "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    "cp2": (2, 1, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                   "--training.local_batch_size", "2"]),
}


def test_model_is_qwen3(reference):
    meta, weights, stdout = reference
    assert "Model qwen3 debugmodel with" in stdout, stdout
    # torchtitan's and Hugging Face's Qwen3 names, q/k norms included.
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (64, 64)
    assert len(meta["steps"]) == 12


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(tmp_path, reference, case):
    np, dp, extra = CASES[case]
    ref_meta, ref_weights, _ = reference
    meta, weights, _ = probe(tmp_path, case, np, extra + ["--lr_scheduler.total_steps", "12"], dp=dp)
    assert meta["world_size"] == np
    assert len(meta["steps"]) == STEPS
    # The reference's validation ran after step 12, these after step 10: compare the steps only.
    ref_steps = {"steps": ref_meta["steps"][:STEPS]}
    worst = compare_steps(meta, ref_steps, case, check_lr=True)
    print(f"qwen3 {case}: worst relative loss difference {worst:.2e} over {STEPS} steps")


def losses(stdout):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", stdout)}


def test_checkpoint_from_tp2_fsdp2_resumes_on_one_process(tmp_path, reference):
    ref_meta, _, _ = reference
    dump = tmp_path / "dump"
    save = mpirun(4) + [binary("titan"), "train", "--job.dump_folder", str(dump), *COMMON, "--training.steps", "10",
                        "--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "10",
                        "--checkpoint.no_last_save_model_only"]
    run(save, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert (dump / "checkpoint" / "step-10" / "metadata.json").exists()
    metadata = json.loads((dump / "checkpoint" / "step-10" / "metadata.json").read_text())
    assert metadata["model"]["family"] == "qwen3" and metadata["model"]["qk_norm"] is True
    out = tmp_path / "resumed"
    resume = [binary("titan_train_probe"), "--probe.out", str(out), "--job.dump_folder", str(dump), *COMMON,
              "--training.steps", "12", "--training.local_batch_size", "2", "--checkpoint.enable",
              "--checkpoint.load_step", "10"]
    run(resume, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    meta = json.loads((out / "metrics.json").read_text())
    assert [s["step"] for s in meta["steps"]] == [11, 12]
    compare_steps(meta, {"steps": ref_meta["steps"][10:]}, "resumed from tp2_fsdp2", check_lr=True)


# Qwen3-MoE (debugmodel_moe's routing: softmax, top-k renormalised, scores on the outputs) with 8 experts of width 32,
# top 2, and auxiliary-loss-free balancing at a step of 0.01 (torchtitan's 1e-3 would take longer to move routing):
# the bias updates depend on every rank's token counts, so they must match too.
MOE = ["--model.flavor", "debugmodel_moe", "--model.moe_num_experts", "8", "--model.moe_top_k", "2", "--model.moe_inter_dim", "32",
       "--model.moe_load_balance_coeff", "0.01"]
MOE_CASES = {  # name: (ranks, data-parallel ranks, options)
    "fsdp2": (2, 2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    # Expert parallelism: the experts split over 2 ranks, each of them sharded over the other 2 (efsdp 2), full AC.
    "ep2_efsdp2_full_ac": (4, 4, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2",
                                  "--activation_checkpoint.mode", "full"]),
    # Every rank holds 2 experts whole; op-level AC.
    "ep4_op_ac": (4, 4, ["--parallelism.expert_parallel_degree", "4", "--training.local_batch_size", "2",
                         "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    # HSDP: 2 replicas of (EP 2 over dp_shard 2); the experts' gradients all-reduced over the replicas.
    "hsdp2_ep2": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                         "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]),
    # EP borrows a context-parallel rank: the experts split over (dp_shard x cp) ranks that hold different tokens.
    "cp2_ep2": (4, 2, ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                       "--training.local_batch_size", "4"]),
    # Pipeline stages of MoE blocks, with EP inside each stage (interleaved: two stages per rank).
    "pp2_ep2_interleaved": (4, 2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                                   "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.local_batch_size", "4"]),
    "pp2_zero_bubble": (2, 1, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
                               "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4"]),
    # Tensor parallelism: the experts' hidden units split over TP, the router whole.
    "tp2_fsdp2_full_ac": (4, 2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                                 "--activation_checkpoint.mode", "full"]),
    # EP borrowing the TP ranks (torchtitan's default ETP 1): each TP rank dispatches its share of the routed rows.
    "tp2_ep2_etp1_op_ac": (4, 2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                                  "--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                                  "--activation_checkpoint.selective_ac_option", "op"]),
    # Eight ranks: FSDP 4 x TP 2, each expert split over TP (ETP 2) and the experts over EP 2 (efsdp 2).
    "fsdp4_tp2_ep2_etp2": (8, 4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                                  "--parallelism.expert_tensor_parallel_degree", "2", "--training.local_batch_size", "2"]),
}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """One process, 12 steps (the layouts compare the first 10; the resumed runs steps 11 and 12)."""
    return probe(tmp_path_factory.mktemp("moe_single"), "moe_single", 1, MOE + ["--training.local_batch_size", "2"], steps=12)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_a_mixture_of_experts_layout_matches_single_process(tmp_path, moe_reference, case):
    """Losses, gradient norms and learning rates over 10 float32 steps against one process."""
    np, dp, extra = MOE_CASES[case]
    ref_meta, ref_weights, stdout = moe_reference
    assert "Model qwen3 debugmodel_moe with" in stdout, stdout
    assert ref_weights["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    meta, weights, out = probe(tmp_path, case, np, MOE + extra + ["--lr_scheduler.total_steps", "12"], dp=dp)
    if "expert_parallel_degree" in extra:
        ep = extra[extra.index("--parallelism.expert_parallel_degree") + 1]
        assert f"Expert parallelism over {ep} ranks: {8 // int(ep)} of the 8 experts per rank" in out, out
    worst = compare_steps(meta, {"steps": ref_meta["steps"][:STEPS]}, f"MoE {case}", check_lr=True)
    print(f"MoE {case}: worst relative loss difference {worst:.2e} over {STEPS} steps")
    # The routing health on the log line covers the whole model (every pipeline stage's blocks, every rank's tokens).
    assert routing_health(out) == routing_health(stdout)[:STEPS], (routing_health(out), routing_health(stdout))


def routing_health(stdout):
    return re.findall(r"step: +\d+ .*(experts: max .*)", stdout)


def test_balancing_changes_the_run(tmp_path, moe_reference):
    """Without balancing the same run's losses differ beyond the layouts' tolerance: the bias is exercised."""
    ref_meta, _, _ = moe_reference
    meta, _, _ = probe(tmp_path, "moe_unbalanced", 1, MOE + ["--training.local_batch_size", "2", "--model.moe_load_balance_coeff", "0"])
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(meta["steps"], ref_meta["steps"]))
    print(f"MoE without balancing: worst relative loss difference {worst:.2e}")
    assert worst > 1e-4


def test_moe_checkpoint_from_ep2_efsdp2_resumes_on_one_process_ep4_and_fsdp4_and_back(tmp_path, moe_reference):
    """Saved on EP 2 x efsdp 2 at step 10, loaded on one process, on EP 4 and on FSDP 4 without EP: the same weights,
    AdamW moments and balancing biases (bitwise), and steps 11 and 12 as the uninterrupted run's. And back: what
    FSDP 4 saves at step 12 loads on EP 2 x efsdp 2 as on one process, bitwise."""
    from safetensors.torch import load_file as load

    ref_meta, _, _ = moe_reference
    dump = tmp_path / "dump"
    save = mpirun(4) + [binary("titan"), "train", "--job.dump_folder", str(dump), *COMMON, *MOE, "--training.steps", "10",
                        "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2",
                        "--lr_scheduler.total_steps", "12", "--checkpoint.enable", "--checkpoint.interval", "10",
                        "--checkpoint.no_last_save_model_only"]
    run(save, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    states = {}
    for name, np, extra in [("one_process", 1, []), ("ep4", 4, ["--parallelism.expert_parallel_degree", "4"]), ("fsdp4", 4, [])]:
        out = tmp_path / name
        resume = ([] if np == 1 else mpirun(np)) + [
            binary("titan_train_probe"), "--probe.out", str(out), "--probe.loaded_state", "--job.dump_folder", str(dump), *COMMON,
            *MOE, "--training.steps", "12", "--training.local_batch_size", "2", "--lr_scheduler.total_steps", "12",
            "--checkpoint.enable", "--checkpoint.load_step", "10", *extra]
        result = run(resume, env={"OMP_NUM_THREADS": "1"}, timeout=900)
        assert "MoE balancing biases" not in result.stdout, result.stdout  # they were in the checkpoint
        meta = json.loads((out / "metrics.json").read_text())
        assert [s["step"] for s in meta["steps"]] == [11, 12]
        compare_steps(meta, {"steps": ref_meta["steps"][10:]}, f"resumed from ep2_efsdp2 on {name}", check_lr=True)
        states[name] = load(str(out / "loaded_state.safetensors"))
    a = states["one_process"]
    assert "model.layers.1.moe.expert_bias" in a and a["model.layers.1.moe.expert_bias"].abs().max() > 0
    assert any(k.startswith("optimizer.exp_avg.layers.0.moe.experts.w1") for k in a)
    for other in ("ep4", "fsdp4"):
        b = states[other]
        assert sorted(a) == sorted(b), other
        for key in a:
            assert torch.equal(a[key], b[key]), (other, key)

    # Back: FSDP 4 without EP resumes from a copy of the step-10 checkpoint in a folder of its own and saves step 12
    # there, which loads on EP 2 x efsdp 2 and on one process (one more step each, from the same state).
    fsdp4_dump = tmp_path / "fsdp4_dump"
    shutil.copytree(dump / "checkpoint" / "step-10", fsdp4_dump / "checkpoint" / "step-10")
    run(mpirun(4) + [binary("titan"), "train", "--job.dump_folder", str(fsdp4_dump), *COMMON, *MOE, "--training.steps", "12",
                     "--training.local_batch_size", "2", "--lr_scheduler.total_steps", "12", "--checkpoint.enable",
                     "--checkpoint.load_step", "10", "--checkpoint.interval", "12", "--checkpoint.no_last_save_model_only"],
        env={"OMP_NUM_THREADS": "1"}, timeout=900)
    back = {}
    for name, np, extra in [("back_one_process", 1, []), ("back_ep2", 4, ["--parallelism.expert_parallel_degree", "2"])]:
        out = tmp_path / name
        resume = ([] if np == 1 else mpirun(np)) + [
            binary("titan_train_probe"), "--probe.out", str(out), "--probe.loaded_state", "--job.dump_folder", str(fsdp4_dump),
            *COMMON, *MOE, "--training.steps", "13", "--training.local_batch_size", "2", "--lr_scheduler.total_steps", "13",
            "--checkpoint.enable", "--checkpoint.load_step", "12", *extra]
        run(resume, env={"OMP_NUM_THREADS": "1"}, timeout=900)
        back[name] = (load(str(out / "loaded_state.safetensors")), json.loads((out / "metrics.json").read_text()))
    (a, meta_a), (b, meta_b) = back["back_one_process"], back["back_ep2"]
    assert sorted(a) == sorted(b) and "model.layers.0.moe.expert_bias" in a
    for key in a:
        assert torch.equal(a[key], b[key]), ("back", key)
    compare_steps(meta_b, meta_a, "step 13 after FSDP 4's checkpoint, EP 2 against one process", check_lr=True)


def test_a_collapsed_router_trains_on_ep2_or_stops_every_rank_by_name(tmp_path):
    """Every token's choices forced onto experts 0 and 1 (TITAN_TEST_MOE_COLLAPSE, a test-only switch): one process
    and EP 2 train the same 4 steps (rank 0's experts receive every token, rank 1's none), and the routing health
    says so; when rank 0's memory could not hold what it would receive (TITAN_TEST_EXPERT_RECEIVE_LIMIT_BYTES), every
    rank stops before anything moves, with an error naming the layer, the rank and the counts, not a hang or a kill."""
    env = {"OMP_NUM_THREADS": "1", "TITAN_TEST_MOE_COLLAPSE": "1"}
    common = [*COMMON, *MOE, "--training.steps", "4"]
    one = run([binary("titan"), "train", "--job.dump_folder", str(tmp_path / "one"), *common, "--training.local_batch_size", "2"],
              env=env, timeout=300)
    ep = run(mpirun(2) + [binary("titan"), "train", "--job.dump_folder", str(tmp_path / "ep"), *common, "--training.local_batch_size", "2",
                          "--parallelism.expert_parallel_degree", "2"], env=env, timeout=300)
    assert losses(one.stdout) and losses(ep.stdout) == losses(one.stdout)
    assert routing_health(one.stdout)[-1].startswith("experts: max 4.00x min 0.00x"), routing_health(one.stdout)
    limited = run(mpirun(2) + [binary("titan"), "train", "--job.dump_folder", str(tmp_path / "limited"), *common,
                               "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"],
                  env={**env, "TITAN_TEST_EXPERT_RECEIVE_LIMIT_BYTES": "100000"}, timeout=300, check=False)
    message = limited.stdout + limited.stderr
    assert limited.returncode != 0, message
    needle = ("expert parallelism: layers.0.moe.experts: the tokens routed to the experts of expert-parallel rank 0 "
              "(experts 0 to 3) would need about")
    assert message.count(needle) == 1, message  # both ranks stop on it; rank 0 prints it, and the job ends (cli/main.cpp)
    assert "256 token rows (from each rank: 128, 128; per expert: 128, 128, 0, 0)" in message, message
