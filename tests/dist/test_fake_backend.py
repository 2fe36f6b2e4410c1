"""comm.mode = "fake_backend", torchtitan's dry run: one process plays rank RANK of NGPU without communicating, its
collectives answering as if every rank were a copy of it (a pipeline stage's receives: stand-ins of the shape the stage
takes). What it is for, checking a job's layout, shapes and memory without its GPUs, is checked against the same rank
of the real job on MPI ranks; every parallelism runs through it; bad launches and settings are refused with the
variable or key named."""
import os
import re

from titan_testing import SOURCE_DIR, binary, run

CONFIG = ["--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--metrics.log_freq", "1",
          "--training.steps", "2", "--training.local_batch_size", "2", "--training.seq_len", "256"]
ESTIMATE = re.compile(r"Memory estimate for this rank: (.*): [\d.]+ (?:GiB|MiB) of")
PARAMETERS = re.compile(r"Parameters on this rank: ([\d.]+) MB")
ELEMENTS = re.compile(r"([\d,]+) parameter elements on this rank")  # one per model part
STEP = re.compile(r"step: +(\d+) +loss: +([\d.]+).*?memory: +([\d.]+)GiB")


def fake(tmp_path, ngpu, rank, *options, check=True, env=None):
    env = {"NGPU": str(ngpu), "RANK": str(rank), "TITAN_PEAK_FLOPS": "1e11", **(env or {})}
    return run([binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--comm.mode", "fake_backend", *options],
               env=env, check=check)


def terms(line):
    """The estimate's terms but the process's own footprint (`runtime`, which differs between any two processes)."""
    return [t for t in line.split(", ") if not t.startswith("runtime")]


def test_one_rank_of_fsdp_and_tp_is_that_rank_of_the_real_job(tmp_path):
    """Rank 5 of FSDP 4 x TP 2 (8 ranks): the fake run holds the real rank 5's pieces (the same parameter bytes and
    FSDP elements), estimates the same memory term by term, and trains; its peak is printed beside the real one's.
    It runs inside a SLURM allocation's shell too (SLURM_NTASKS without a job step), and its memory estimation
    reports the one rank it plays."""
    layout = ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2"]
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "8"]
    real = run(mpirun + [binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path / "real"), *layout],
               env={"LOG_RANK": "5", "OMP_NUM_THREADS": "1", "TITAN_PEAK_FLOPS": "1e11"}).stdout
    dry = fake(tmp_path / "fake", 8, 5, *layout, env={"SLURM_NTASKS": "8", "SLURM_PROCID": "0"})
    out = dry.stdout
    assert "this process plays rank 5 of 8" in out and "fake (no communication) communication" in out, out[-3000:]
    assert "a dry run of one rank" in dry.stdout + dry.stderr
    for pattern in (PARAMETERS, ELEMENTS):
        assert pattern.search(out).group(1) == pattern.search(real).group(1), (pattern.pattern, out[-3000:], real[-3000:])
    assert terms(ESTIMATE.search(out).group(1)) == terms(ESTIMATE.search(real).group(1)), (out[-3000:], real[-3000:])
    steps = STEP.findall(out)
    assert [int(s[0]) for s in steps] == [1, 2] and all(0 < float(s[1]) < 20 for s in steps), out[-3000:]
    real_peak = max(float(s[2]) for s in STEP.findall(real))
    print(f"rank 5 of FSDP 4 x TP 2: peak {float(steps[-1][2]):.2f} GiB alone (fake_backend), {real_peak:.2f} GiB in the real job")
    report = fake(tmp_path / "estimate", 8, 5, *layout, "--memory_estimation.enable").stdout
    assert "this rank fits:\n  rank 5: estimated" in report and "rank 0:" not in report, report[-2000:]


def test_one_pipeline_rank_is_that_rank_of_the_real_job(tmp_path):
    """Rank 3 of PP 2 x FSDP 2 under Interleaved1F1B (4 stages, two on each pipeline rank): the fake run holds the real
    rank 3's stages (1 and 3: the same parameter bytes and FSDP elements per part), estimates the same memory term by
    term and trains, every activation it receives a stand-in of the shape the real stage 0 and 2 send. Rank 0 (stage 2
    receives from stage 1) and a V-shaped zero-bubble schedule (ZBVZeroBubble: split backward, stages 0 and 3 on rank
    0) run too."""
    layout = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
              "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "4"]
    real = run(mpirun + [binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path / "real"), *layout],
               env={"LOG_RANK": "3", "OMP_NUM_THREADS": "1", "TITAN_PEAK_FLOPS": "1e11"}).stdout
    out = fake(tmp_path / "fake", 4, 3, *layout).stdout
    assert "stage 1 on this rank" in out and "stage 3 on this rank" in out, out[-3000:]
    assert PARAMETERS.search(out).group(1) == PARAMETERS.search(real).group(1), (out[-3000:], real[-3000:])
    assert ELEMENTS.findall(out) == ELEMENTS.findall(real) and len(ELEMENTS.findall(out)) == 2, (out[-3000:], real[-3000:])
    assert terms(ESTIMATE.search(out).group(1)) == terms(ESTIMATE.search(real).group(1)), (out[-3000:], real[-3000:])
    steps = STEP.findall(out)
    # The last stage's own loss (the real job's sums the last stage's over the pipeline, which a sum of copies would
    # multiply by PP).
    assert [int(s[0]) for s in steps] == [1, 2] and all(0 < float(s[1]) < 20 for s in steps), out[-3000:]
    real_peak = max(float(s[2]) for s in STEP.findall(real))
    print(f"rank 3 of PP 2 x FSDP 2: peak {float(steps[-1][2]):.2f} GiB alone (fake_backend), {real_peak:.2f} GiB in the real job")
    for rank, schedule in ((0, "Interleaved1F1B"), (0, "ZBVZeroBubble")):
        out = fake(tmp_path / f"{schedule}_{rank}", 4, rank, *layout[:-1], schedule).stdout
        steps = STEP.findall(out)
        # Without the last stage (1F1B-like schedules) a rank computes no loss; in a V rank 0 holds the last stage.
        losses = [float(s[1]) for s in steps]
        assert [int(s[0]) for s in steps] == [1, 2] and "0 activation shape header(s) read back" in out, (schedule, out[-3000:])
        assert all(loss == 0 for loss in losses) if schedule == "Interleaved1F1B" else all(0 < loss < 20 for loss in losses), \
            (schedule, losses)
        print(f"{schedule}, rank {rank} of PP 2 x FSDP 2: peak {float(steps[-1][2]):.2f} GiB")


def test_every_parallelism_runs_on_one_process(tmp_path):
    """HSDP, context parallelism (its ring's shifts: the all-to-all rotation), and expert parallelism on a MoE model
    (its uneven all-to-alls, whose counts come through the same backend) each run two steps as a middle rank of 4."""
    layouts = {
        "HSDP 2 x 2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
        "FSDP 2 x CP 2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2",
                          "--parallelism.context_parallel_rotate_method", "alltoall"],
        "MoE, EP 2 x efsdp 2": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.n_layers", "2",
                                "--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2"],
    }
    for name, options in layouts.items():
        out = fake(tmp_path / name.replace(" ", "_"), 4, 2, *options).stdout
        steps = STEP.findall(out)
        assert [int(s[0]) for s in steps] == [1, 2] and all(0 < float(s[1]) < 20 for s in steps), (name, out[-3000:])
        print(f"{name}, rank 2 of 4: losses {[float(s[1]) for s in steps]}, peak {float(steps[-1][2]):.2f} GiB")


def test_checkpoints_are_neither_saved_nor_loaded(tmp_path):
    """One rank's pieces are not a checkpoint: checkpoint.enable is set aside with a warning, and nothing is written."""
    result = fake(tmp_path, 2, 1, "--parallelism.data_parallel_shard_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "1")
    assert "checkpoints are neither loaded nor saved" in result.stdout + result.stderr
    assert not (tmp_path / "checkpoint").exists(), sorted(p.name for p in tmp_path.iterdir())


def test_bad_launches_and_settings_are_refused(tmp_path):
    layout = ["--parallelism.data_parallel_shard_degree", "2"]
    cases = [
        ({"NGPU": ""}, [], "comm.mode = \"fake_backend\" needs NGPU (the number of ranks to simulate)"),
        ({"NGPU": "eight"}, [], "NGPU=eight is not a whole number"),
        ({"NGPU": "4"}, [], "x pipeline_parallel_degree (1) = 2 must equal NGPU (4, the ranks comm.mode = \"fake_backend\" simulates)"),
        ({"NGPU": "2", "SLURM_STEP_NUM_TASKS": "2"}, [], "srun started 2 (SLURM_STEP_NUM_TASKS): run titan alone"),
        ({"NGPU": "2", "RANK": "2"}, [], "RANK=2 is not a rank of NGPU=2 (0 to 1)"),
    ]
    for env, extra, message in cases:
        result = run([binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--comm.mode", "fake_backend", *layout,
                      *extra], env={"RANK": "", **env}, check=False)
        assert result.returncode == 2 and message in result.stderr, (env, extra, result.returncode, result.stderr[-2000:])
    # One process stands in for the job: a launcher's several are refused, each naming what to run instead.
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "2"]
    result = run(mpirun + ["-x", "NGPU=2", binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--comm.mode",
                           "fake_backend", *layout], env={"OMP_NUM_THREADS": "1"}, check=False)
    assert result.returncode != 0 and "runs one process standing in for one rank of NGPU; mpirun started 2" in result.stderr, \
        result.stderr[-2000:]
    # torchtitan's other simulated mode, every rank in turn in one process, is not there yet.
    result = run([binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--comm.mode", "local_tensor"], check=False)
    assert result.returncode == 2 and "comm.mode = \"local_tensor\"" in result.stderr and "not supported yet" in result.stderr, \
        result.stderr[-2000:]
