"""Pipeline parallelism on real MPI ranks against one process at the same global batch: every schedule on PP2 and
PP4 (virtual stages for the looped ones), and PP with FSDP, DDP, TP and activation checkpointing, give the same
losses and gradient norms (1e-5 relative) and final weights over 6 float32 steps; DualPipeV (which needs as many
micro-batches as stages) on PP2 alone and with FSDP. Each rank's recorded order of
actions is the order torch.distributed.pipelining's schedule of that name defines, every action started only after
the neighbouring stage's action it depends on had ended, 1F1B holds at most p micro-batches in flight on the
first stage where GPipe holds m, and bad stage splits and micro-batch counts are clear errors."""
import csv
import json
import os
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.pipelining import schedules as torch_schedules

from titan_testing import binary, run, compare_steps

STEPS = 6
COMMON = ["--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.steps", str(STEPS),
          "--training.seq_len", "32", "--training.global_batch_size", "8",
          "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "3",
          "--training.max_norm", "0.5", "--debug.seed", "0", "--metrics.log_freq", "100", "--metrics.disable_color_printing",
          "--training.data_lanes", "4", "--activation_checkpoint.mode", "none"]


def mpirun(np):
    return [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(np)]


def probe(tmp_path, name, np, extra, dp=1, local_batch=4, env=None):
    out = tmp_path / name
    validation = ["--probe.validate", "--validation.enable", "--validation.dataset", "fortunes", "--validation.seq_len", "32",
                  "--validation.local_batch_size", str(8 // dp), "--validation.steps", "2"]
    cmd = ([] if np == 1 else mpirun(np)) + [binary("titan_train_probe"), "--probe.out", str(out),
                                             "--job.dump_folder", str(tmp_path / name / "dump"), *COMMON,
                                             "--training.local_batch_size", str(local_batch), *validation, *extra]
    run(cmd, env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=900)
    return (json.loads((out / "metrics.json").read_text()), load_file(str(out / "final.safetensors")), tmp_path / name / "dump")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return probe(tmp_path_factory.mktemp("single"), "single", 1, [])


def pp(degree, schedule, shard=1, replicate=1, tp=1):
    return ["--parallelism.pipeline_parallel_degree", str(degree), "--parallelism.pipeline_parallel_schedule", schedule,
            "--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.data_parallel_replicate_degree", str(replicate),
            "--parallelism.tensor_parallel_degree", str(tp), "--debug.pipeline_timeline"]


SINGLE = ["GPipe", "1F1B"]
LOOPED = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]
# name: (ranks, pp degree, dp_shard, dp_replicate, tp, schedule, extra). 4 micro-batches of 1 per local batch of 4;
# two local batches per step (gradient accumulation) unless data parallelism reads them side by side.
CASES = {f"pp{d}_{s}": (d, d, 1, 1, 1, s, []) for d in (2, 4) for s in SINGLE + LOOPED}
CASES.update({
    "pp2_fsdp2_1F1B": (4, 2, 2, 1, 1, "1F1B", []),
    "pp2_fsdp2_InterleavedZeroBubble": (4, 2, 2, 1, 1, "InterleavedZeroBubble", []),
    "pp2_ddp2_Interleaved1F1B": (4, 2, 1, 2, 1, "Interleaved1F1B", []),
    "pp2_ddp2_ZBVZeroBubble": (4, 2, 1, 2, 1, "ZBVZeroBubble", []),
    # DualPipeV needs as many micro-batches as stages: 4 here, so PP 2 only.
    "pp2_DualPipeV": (2, 2, 1, 1, 1, "DualPipeV", []),
    "pp2_fsdp2_DualPipeV": (4, 2, 2, 1, 1, "DualPipeV", []),
    "pp2_tp2_1F1B_ac_full": (4, 2, 1, 1, 2, "1F1B", ["--activation_checkpoint.mode", "full"]),
    "pp2_tp2_fsdp2_Interleaved1F1B": (8, 2, 2, 1, 2, "Interleaved1F1B", []),
    "pp2_fsdp2_ZBVZeroBubble_ac_op_reshard": (4, 2, 2, 1, 1, "ZBVZeroBubble", [
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
        "--parallelism.fsdp_reshard_after_forward", "always"]),
})


def torch_order(name, ranks, microbatches, local):
    """Each rank's compute actions in the order torch.distributed.pipelining's schedule class defines, built without a
    process group (the order functions only read these attributes)."""
    cls = torch_schedules.get_schedule_class(name)
    schedule = object.__new__(cls)
    schedule._n_microbatches = microbatches
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        schedule._num_stages = ranks
        order = schedule._get_pipeline_order()
    else:
        schedule.pp_group_size, schedule.n_local_stages, schedule._stages = ranks, local, [None] * local
        schedule.num_stages = ranks * local
        schedule.number_of_rounds = max(1, microbatches // ranks)
        schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
        order = {r: schedule._calculate_single_rank_operations(r) for r in range(ranks)}
    compute = (torch_schedules.FORWARD, torch_schedules.FULL_BACKWARD, torch_schedules.BACKWARD_INPUT, torch_schedules.BACKWARD_WEIGHT)

    def flat(actions):
        # DualPipeV pairs one stage's forward with the other's backward in one action; titan runs them in that order.
        for a in actions:
            if a is not None and a.computation_type == torch_schedules.OVERLAP_F_B:
                yield from a.sub_actions
            elif a is not None:
                yield a
    out = {r: [str(a) for a in flat(actions) if a.computation_type in compute] for r, actions in order.items()}
    if name == "1F1B":
        # torch's 1F1B order table numbers the last rank's forwards from 1 (1F1, 1F2, ..., 1F{m}: its counter is
        # bumped before first use when that rank has no warm-up); its runtime runs 0 .. m-1, as the other ranks'
        # rows say. Renumber that row's forwards in sequence.
        last = ranks - 1
        count = iter(range(microbatches))
        out[last] = [f"{last}F{next(count)}" if a.startswith(f"{last}F") else a for a in out[last]]
    return out


def read_timeline(dump, world, pp_degree, actions_per_pass):
    """The first schedule pass's actions on each pipeline rank of the first group (pipeline is the outermost mesh
    dimension: world rank r has pipeline rank r // (world / pp))."""
    per_rank = {}
    group = world // pp_degree
    for rank in range(0, world, group):
        rows = list(csv.reader(open(dump / "pipeline_timeline" / f"rank-{rank:05d}.csv")))
        # (action, when its computation began: after any receive, when its result existed)
        per_rank[rank // group] = [(r[1], float(r[2]) + float(r[4]), float(r[3])) for r in rows[:actions_per_pass[rank // group]]]
    return per_rank


def check_timeline(timeline, stages):
    """Every action began after what it needs had ended on the neighbouring stage: F(s, m) after F(s-1, m), a
    backward of (s, m) after the backward of (s+1, m) and after its own forward, W after I."""
    ends = {}
    for actions in timeline.values():
        for action, start, end in actions:
            ends[action] = (start, end)

    def parse(a):
        i = 0
        while a[i].isdigit():
            i += 1
        return int(a[:i]), a[i], int(a[i + 1:])
    for action, (start, _) in ends.items():
        s, op, m = parse(action)
        needs = []
        if op == "F" and s > 0:
            needs.append(f"{s - 1}F{m}")
        if op in "BI":
            needs.append(f"{s}F{m}")
            if s < stages - 1:
                needs.append(f"{s + 1}B{m}" if f"{s + 1}B{m}" in ends else f"{s + 1}I{m}")
        if op == "W":
            needs.append(f"{s}I{m}")
        for need in needs:
            assert ends[need][1] <= start + 1e-6, f"{action} started at {start} before {need} ended at {ends[need][1]}"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(tmp_path, reference, case):
    np_, degree, shard, replicate, tp, schedule, extra = CASES[case]
    ref_meta, ref_final, _ = reference
    dp = shard * replicate
    meta, final, dump = probe(tmp_path, case, np_, pp(degree, schedule, shard, replicate, tp) + extra, dp=dp)
    worst = compare_steps(meta, ref_meta, case)
    assert len(meta["steps"]) == STEPS
    for name, ref in ref_final.items():
        torch.testing.assert_close(final[name], ref, rtol=1e-4, atol=3e-5, msg=lambda m: f"{case} {name}: {m}")
    # The recorded order is torch's for that schedule, and the actions ran in dependency order.
    local = 1 if schedule in SINGLE else 2
    expected = torch_order(schedule, degree, 4, local)
    timeline = read_timeline(dump, np_, degree, {r: len(a) for r, a in expected.items()})
    for rank, actions in timeline.items():
        assert [a for a, _, _ in actions] == expected[rank], (case, rank)
    check_timeline(timeline, degree * local)
    info = meta["pipeline"]
    print(f"{case}: worst relative loss difference {worst:.2e}; {info['stages']} stages, measured bubble on rank 0 "
          f"{100 * info['measured_bubble']:.1f}% (simulated {100 * info['simulated_bubble']:.1f}%)")


@pytest.mark.parametrize("case", ["pp2_ZBVZeroBubble_ac_full", "pp2_tp2_1F1B_ac_full"])
def test_weights_cast_once_per_step_train_as_libtorchs_autocast(tmp_path, case):
    """bfloat16 autocast with every block checkpointed, through the zero-bubble schedule's deferred weight gradients
    and through TP: holding autocast's weight copies over the step (the default) gives bit for bit the losses and
    gradient norms of LibTorch's own behaviour, which casts again in every forward and recomputation."""
    layout = {"pp2_ZBVZeroBubble_ac_full": (2, pp(2, "ZBVZeroBubble")), "pp2_tp2_1F1B_ac_full": (4, pp(2, "1F1B", tp=2))}[case]
    # Four steps: bitwise equality does not need the parity tests' ten.
    extra = layout[1] + ["--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16", "--training.steps", "4"]
    once, _, _ = probe(tmp_path, "step", layout[0], extra + ["--training.autocast_weight_casts", "step"])
    every, _, _ = probe(tmp_path, "forward", layout[0], extra + ["--training.autocast_weight_casts", "forward"])
    assert len(once["steps"]) == 4
    for mine, ref in zip(once["steps"], every["steps"]):
        assert (mine["loss"], mine["grad_norm"]) == (ref["loss"], ref["grad_norm"]), (case, mine, ref)


def test_1f1b_keeps_p_microbatches_in_flight_where_gpipe_keeps_m(tmp_path):
    """8 micro-batches on 2 stages with activations large enough to see: rank 0 holds at most 2 under 1F1B, all 8 under
    GPipe, and its peak resident memory is lower."""
    big = ["--training.seq_len", "256", "--training.global_batch_size", "8", "--training.steps", "2"]
    found = {}
    for schedule in ("GPipe", "1F1B"):
        out = tmp_path / schedule
        cmd = mpirun(2) + [binary("titan_train_probe"), "--probe.out", str(out), "--job.dump_folder", str(tmp_path / "dump"),
                           *COMMON, "--training.local_batch_size", "8", *big, *pp(2, schedule)]
        run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=600)
        found[schedule] = json.loads((out / "metrics.json").read_text())
    assert found["GPipe"]["pipeline"]["max_in_flight"] == 8
    assert found["1F1B"]["pipeline"]["max_in_flight"] == 2
    gpipe, one_f_one_b = found["GPipe"]["peak_rss_bytes"], found["1F1B"]["peak_rss_bytes"]
    print(f"rank 0 peak RSS: GPipe {gpipe / 2**20:.0f} MiB, 1F1B {one_f_one_b / 2**20:.0f} MiB")
    assert one_f_one_b < gpipe


@pytest.mark.parametrize("np_,args,needles", [
    (2, pp(2, "Interleaved1F1B") + ["--parallelism.pipeline_parallel_layers_per_stage", "4"],
     ["Interleaved1F1B", "at least 2 stages per rank", "2 stages over 2 ranks"]),
    (2, pp(2, "1F1B") + ["--parallelism.pipeline_parallel_layers_per_stage", "3"],
     ["layers_per_stage = 3 gives 3 pipeline stages", "do not divide over pipeline_parallel_degree = 2"]),
    (2, pp(2, "1F1B") + ["--training.local_batch_size", "1"], ["1F1B needs at least as many micro-batches as stages"]),
    (2, pp(2, "1F1B") + ["--training.local_batch_size", "3", "--parallelism.pipeline_parallel_microbatch_size", "2"],
     ["training.local_batch_size = 3 does not divide into micro-batches"]),
    (2, pp(2, "Interleaved1F1B") + ["--training.local_batch_size", "5"],
     ["multiple of their rounds", "max(1, 5 / 2) = 2"]),
    (2, pp(2, "DualPipeV") + ["--training.local_batch_size", "3"], ["DualPipeV needs at least as many micro-batches as stages"]),
    (2, pp(2, "Zigzag"), ["\"Zigzag\" is not a schedule", "Interleaved1F1B"]),
    (2, pp(2, "1F1B") + ["--parallelism.module_fqns_per_model_part",
                         '[["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layer.3", "layers.4", "layers.5", "norm", "output"]]'],
     ['"layer.3"', 'did you mean "layers.3"']),
    (2, pp(2, "1F1B") + ["--parallelism.module_fqns_per_model_part",
                         '[["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.2", "layers.3", "layers.4", "layers.5", "norm", "output"]]'],
     ['"layers.2" is in stage 0 and again in stage 1']),
    (2, pp(2, "1F1B") + ["--parallelism.module_fqns_per_model_part",
                         '[["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "layers.4", "layers.5", "norm"]]'],
     ['leaves out "output"']),
])
def test_bad_pipeline_settings_are_clear_errors(tmp_path, np_, args, needles):
    cmd = mpirun(np_) + [binary("titan"), "train", "--job.dump_folder", str(tmp_path), "--model.hf_assets_path", "builtin",
                         "--training.dataset", "fortunes", "--training.steps", "1", "--training.seq_len", "32",
                         "--training.local_batch_size", "4", *args]
    result = run(cmd, check=False, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode != 0
    for needle in needles:
        assert needle in result.stderr, result.stderr[-3000:]
    assert "frame #" not in result.stderr


def test_bad_schedule_csv_is_a_clear_error(tmp_path):
    base = ["--training.local_batch_size", "2"] + pp(2, "1F1B")
    cases = {
        "missing.csv": ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n", "stage 1 micro-batch 1 needs a backward"),
        "wrong_rank.csv": ("0F0,0F1,0B0,0B1,1F0\n1F0,1B0,1F1,1B1\n", "rank 0 runs 1F0 but stage 1 lives on rank 1"),
        "stage.csv": ("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1,3F0\n", "there are stages 0..1"),
        "junk.csv": ("0F0,0SEND_F0\n", "is not a compute action"),
        "deadlock.csv": ("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", "deadlocks"),
        "order.csv": ("0F0,0F1,0B0,0B1\n1F1,1B1,1F0,1B0\n",
                      "stage 0 runs its forwards in micro-batch order 0 1 but stage 1 in 1 0"),
    }
    for name, (text, needle) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        cmd = mpirun(2) + [binary("titan"), "train", "--job.dump_folder", str(tmp_path / "d"), "--model.hf_assets_path", "builtin",
                           "--training.dataset", "fortunes", "--training.steps", "1", "--training.seq_len", "32", *base,
                           "--parallelism.pipeline_parallel_schedule_csv", str(path)]
        result = run(cmd, check=False, env={"OMP_NUM_THREADS": "1"}, timeout=300)
        assert result.returncode != 0, name
        assert needle in result.stderr, (name, result.stderr[-2000:])


def test_custom_csv_schedule_trains_like_1f1b(tmp_path):
    """torchtitan's pipeline_parallel_schedule_csv: 1F1B's order written by hand gives 1F1B's losses."""
    path = tmp_path / "my_1f1b.csv"
    path.write_text("0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n")
    steps = ["--training.steps", "3"]
    csv_meta, _, _ = probe(tmp_path, "csv", 2, pp(2, "1F1B") + steps + ["--parallelism.pipeline_parallel_schedule_csv", str(path)])
    ref_meta, _, _ = probe(tmp_path, "named", 2, pp(2, "1F1B") + steps)
    for a, b in zip(csv_meta["steps"], ref_meta["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert csv_meta["pipeline"]["csv"] == path.read_text()
