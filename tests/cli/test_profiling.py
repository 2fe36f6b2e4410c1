"""profiling.enable_profiling: LibTorch's profiler (Kineto) writes a Chrome trace per rank and cycle, holding the
model's matmuls and titan's communication ranges; profiling.enable_memory_snapshot on a CPU writes the counted
memory figures it says it writes."""
import json
import os

from titan_testing import SOURCE_DIR, binary, run


def train(dump, extra, np_=1, check=True):
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", str(np_)] if np_ > 1 else []
    return run(mpi + [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                      "--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.local_batch_size", "2",
                      "--training.steps", "4", "--debug.seed", "0", *extra],
               env={"OMP_NUM_THREADS": "1" if np_ > 1 else "2"}, check=check)


def test_traces_hold_matmuls_and_collectives_on_every_rank(tmp_path):
    dump = tmp_path / "run"
    result = train(dump, ["--profiling.enable_profiling", "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1",
                          "--profiling.profiler_active", "1", "--profiling.enable_memory_snapshot",
                          "--parallelism.data_parallel_shard_degree", "2"], np_=2)
    assert "Profiler trace of steps 2-2 saved to" in result.stdout
    for step in (2, 4):
        for rank in (0, 1):
            trace = json.loads((dump / "profile_traces" / f"iteration_{step}" / f"rank{rank}_trace.json").read_text())
            events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
            names = {e["name"] for e in events}
            assert names & {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"}, sorted(names)[:50]
            # FSDP's gathers and gradient reduce-scatters, as titan's record ranges
            assert "titan::all_gather_into" in names and "titan::reduce_scatter" in names, sorted(n for n in names if "titan" in n)
            assert all(e["dur"] >= 0 and "ts" in e for e in events)
            memory = json.loads((dump / "memory_snapshot" / f"iteration_{step}" / f"rank{rank}_memory.json").read_text())
            assert memory["device"] == "cpu" and memory["peak_bytes_in_use"] >= memory["bytes_in_use"] > 0
    assert not (dump / "profile_traces" / "iteration_1").exists() and not (dump / "profile_traces" / "iteration_3").exists()


def test_a_schedule_that_does_not_fit_is_refused(tmp_path):
    result = train(tmp_path / "run", ["--profiling.enable_profiling", "--profiling.profile_freq", "2",
                                      "--profiling.profiler_warmup", "2", "--profiling.profiler_active", "1"], check=False)
    assert result.returncode == 2 and "profiling.profiler_warmup (2) + profiling.profiler_active (1) must not exceed " \
        "profiling.profile_freq (2)" in result.stderr, result.stderr
