"""Float8 linears (rowwise_with_gw_hp, emulated) on real MPI ranks against one process at the same global batch:
FSDP 2 and PP 2 (1F1B). With that recipe every scale is per token or per weight row (the weight gradient stays in
high precision), so no scale depends on how the batch is split: the first step equals one process to float32
precision; later steps drift as float32 rounding differences (another summation order of the gradients) flip
elements to the neighbouring float8 value, within what test_float8_parity measures between two float8 runs started
one rounding apart (up to 6e-4 relative loss over 10 steps). Measured on 2026-11-27: FSDP 2 1.2e-7, PP 2 3.7e-7 over
10 steps (no flip at this size).

Float8 FSDP all-gathers (tensorwise): each rank casts its float32 shard with the whole weight's scale, so the gathered
float8 weight is exactly what casting the gathered float32 weight gives. With float32 gathers a run with them equals
the same layout without them bitwise, precomputed scales or not; the bytes they send per step are checked against the
analytic figure, and with bf16 gathers against half of bf16's."""
import json
import os

import numpy as np
import pytest
from safetensors.torch import load_file

from titan_testing import binary, read_checkpoint, run

STEPS = 10
COMMON = ["--model.flavor", "debugmodel", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
          "--model.n_kv_heads", "2", "--model.hidden_dim", "128", "--model.hf_assets_path", "builtin",
          "--training.dataset", "fortunes", "--training.seq_len", "32", "--training.global_batch_size", "8",
          "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "3",
          "--training.max_norm", "0.5", "--debug.seed", "0", "--metrics.log_freq", "1", "--training.data_lanes", "4",
          "--activation_checkpoint.mode", "none", "--training.steps", str(STEPS),
          "--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate",
          "--quantize.linear.float8.filter_fqns", "output"]
# The converted weights' elements: per block wq, wo (64 x 64), wk, wv (32 x 64), w1, w3 (128 x 64), w2 (64 x 128).
CONVERTED_ELEMENTS = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]
ALL_GATHER = ["--quantize.linear.float8.enable_fsdp_float8_all_gather"]
PRECOMPUTE = ALL_GATHER + ["--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]


def probe(tmp_path, name, np, extra, recipe="rowwise_with_gw_hp"):
    out = tmp_path / name
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(np)]
    cmd = ([] if np == 1 else mpirun) + [binary("titan_train_probe"), "--probe.out", str(out),
                                         "--job.dump_folder", str(tmp_path / name / "dump"), *COMMON,
                                         "--quantize.linear.float8.recipe_name", recipe, *extra]
    if recipe.startswith("mxfp8"):  # the MX converter instead of the float8 one
        cmd = [a if a != "quantize.linear.float8" else "mx" for a in cmd]
        cmd += ["--quantize.linear.mx.recipe_name", recipe, "--quantize.linear.mx.emulate"]
    result = run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert (f"MXFP8 linears ({recipe}" if recipe.startswith("mxfp8") else f"Float8 linears ({recipe}, emulated") in result.stdout
    assert "14 converted, 1 kept in high precision (output)" in result.stdout
    if "--quantize.linear.float8.enable_fsdp_float8_all_gather" in extra:
        assert "float8 linear weights (" in result.stdout and "gathered in float8" in result.stdout, result.stdout[-3000:]
    return json.loads((out / "metrics.json").read_text())["steps"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return probe(tmp_path_factory.mktemp("one"), "one", 1, ["--training.local_batch_size", "8"])


@pytest.mark.parametrize("name, np, extra", [
    ("fsdp2", 2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
    ("pp2_1F1B", 2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
                     "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "8"]),
])
def test_float8_layout_matches_one_process(tmp_path, reference, name, np, extra):
    steps = probe(tmp_path, name, np, extra)
    assert len(steps) == STEPS
    worst = 0.0
    for mine, ref in zip(steps, reference):
        rel = abs(mine["loss"] - ref["loss"]) / ref["loss"]
        worst = max(worst, rel)
        if mine["step"] == 1:
            assert rel <= 1e-6 and abs(mine["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (mine, ref)
    print(f"float8 {name}: worst relative loss difference from one process over {STEPS} steps {worst:.2e}")
    assert worst <= 2e-3


def relative(steps, reference, key):
    return max(abs(a[key] - b[key]) / b[key] for a, b in zip(steps, reference))


def test_float8_all_gather_equals_the_bf16_gather_bitwise_and_sends_one_byte_per_element(tmp_path):
    """FSDP 2, tensorwise, float32 gathers: without float8 all-gathers, with them, and with precomputed scales."""
    f32 = ["--training.mixed_precision_param", "float32"]
    plain = probe(tmp_path, "plain", 2, FSDP2 + f32, recipe="tensorwise")
    gathered = probe(tmp_path, "float8_gather", 2, FSDP2 + f32 + ALL_GATHER, recipe="tensorwise")
    precomputed = probe(tmp_path, "precomputed", 2, FSDP2 + f32 + PRECOMPUTE, recipe="tensorwise")
    for run_ in (gathered, precomputed):
        assert [(s["loss"], s["grad_norm"]) for s in run_] == [(s["loss"], s["grad_norm"]) for s in plain]
    # Bytes this rank sends per step: each converted weight's shard (half of it on 2 ranks) is gathered twice (forward,
    # and backward after resharding), at 1 byte per element instead of 4; the scales' amax all-reduces cost
    # 2 (n - 1) / n x 4 bytes per weight: for each of the 2 blocks' 7 weights at each gather, or once per step for all
    # 14 after the optimizer step when precomputed (the first step also computes them before its first gather).
    shard = CONVERTED_ELEMENTS // 2
    for step, (a, b, c) in enumerate(zip(plain, gathered, precomputed), 1):
        assert a["data_parallel_bytes"] - b["data_parallel_bytes"] == 2 * shard * (4 - 1) - 4 * 7 * 4, (step, a, b)
        assert b["data_parallel_bytes"] - c["data_parallel_bytes"] == 4 * 7 * 4 - 14 * 4 * (2 if step == 1 else 1), (step, b, c)


def test_float8_all_gather_sends_half_of_bf16s_bytes(tmp_path):
    """bf16 gathers (the default mixed precision) against float8 ones: the converted weights' gather bytes halve, and
    the losses stay within float8 rounding of each other (the float8 weights now come from the float32 shards, as in
    torchao, rather than from the bf16 copies)."""
    plain = probe(tmp_path, "bf16", 2, FSDP2 + ["--training.mixed_precision_param", "bfloat16"], recipe="tensorwise")
    gathered = probe(tmp_path, "float8", 2, FSDP2 + ["--training.mixed_precision_param", "bfloat16"] + PRECOMPUTE, recipe="tensorwise")
    shard = CONVERTED_ELEMENTS // 2
    for step, (a, b) in enumerate(zip(plain, gathered), 1):
        bf16_bytes = 2 * shard * 2  # the converted weights' share of the bf16 run's gathers
        assert a["data_parallel_bytes"] - b["data_parallel_bytes"] == bf16_bytes / 2 - 14 * 4 * (2 if step == 1 else 1), (step, a, b)
    worst = relative(gathered, plain, "loss")
    print(f"float8 against bf16 all-gathers: worst relative loss difference {worst:.2e} over {STEPS} steps")
    assert worst <= 2e-3


@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble"])
def test_float8_all_gather_on_pp2_fsdp2(tmp_path, reference, schedule):
    """PP 2 x FSDP 2 (1F1B, and the interleaved zero-bubble schedule, whose weight steps make the float8 linears'
    weight gradients after FSDP has let the float8 weights go; each rank holds one of the two blocks) with full activation checkpointing (the recomputed forward reads the
    float8 weight that backward re-gathered), tensorwise with precomputed scales, float32 gathers: equal to the same
    layout without float8 all-gathers bitwise; against one process within the drift the rowwise_with_gw_hp layouts
    above show plus what tensorwise adds: its input scales come from each rank's local batch (as in torchtitan), so
    they differ from one process's from the first step on."""
    pp = ["--activation_checkpoint.mode", "full", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule,
          "--training.mixed_precision_param", "float32", "--parallelism.data_parallel_shard_degree", "2",
          "--training.local_batch_size", "4"]
    plain = probe(tmp_path, "pp_plain", 4, pp, recipe="tensorwise")
    gathered = probe(tmp_path, "pp_float8", 4, pp + PRECOMPUTE, recipe="tensorwise")
    assert [(s["loss"], s["grad_norm"]) for s in gathered] == [(s["loss"], s["grad_norm"]) for s in plain]
    one = probe(tmp_path, "one_tensorwise", 1, ["--training.local_batch_size", "8"], recipe="tensorwise")
    worst = relative(gathered, one, "loss")
    print(f"float8 all-gather on PP 2 x FSDP 2 ({schedule}) against one process (tensorwise): worst relative loss difference {worst:.2e}")
    assert worst <= 2e-3


def test_mxfp8_layouts_match_one_process(tmp_path):
    """MXFP8 (mxfp8_cublas_rceil, emulated): every block of 32 lies within one token's row or, for the weight
    gradient, within 32 consecutive tokens of one sequence (seq_len 32), so no scale depends on how the batch is
    split: FSDP 2, PP 2 x FSDP 2 and PP 2 under ZBVZeroBubble (the weight gradients made in its weight steps) follow
    one process to float32 precision."""
    one = probe(tmp_path, "mx_one", 1, ["--training.local_batch_size", "8"], recipe="mxfp8_cublas_rceil")
    for name, np_, extra in [("mx_fsdp2", 2, FSDP2),
                             ("mx_pp2_fsdp2", 4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                                                  "1F1B", "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
                             # The V's split backward: the MX linears' weight gradients made in the weight steps.
                             ("mx_pp2_zbv", 2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                                                "ZBVZeroBubble", "--training.local_batch_size", "8"])]:
        steps = probe(tmp_path, name, np_, extra, recipe="mxfp8_cublas_rceil")
        worst = relative(steps, one, "loss")
        print(f"MXFP8 {name}: worst relative loss difference from one process over {STEPS} steps {worst:.2e}")
        assert abs(steps[0]["loss"] - one[0]["loss"]) <= 1e-6 * one[0]["loss"]
        assert worst <= 1e-5


# EP borrowing the TP ranks (expert_tensor_parallel_degree 1): each rank's experts whole, the routed rows split over TP.
TP2_EP2_ETP1 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--parallelism.expert_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "1",
                "--training.local_batch_size", "8"]

GROUPED = {
    # converter: (log line, the layouts: name, ranks, options, bound on the relative loss and gradient-norm differences)
    "mx": ("MXFP8 grouped matmuls (quantize.grouped_mm.mx, rceil scales", [
        ("ep2", 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
                    "--training.local_batch_size", "4"], 3e-7),  # measured 1.2e-7, 2026-11-30
        # TP's partial sums round differently in float32, and later steps' MXFP8 casts round some of those
        # differences to neighbouring values: 1.7e-5 (loss) and 6.0e-5 (gradient norm) over 10 steps, 2026-11-30.
        ("tp2", 2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                    "--training.local_batch_size", "8"], 1e-4),
        # Measured 1.8e-7 (loss), 1.1e-7 (gradient norm) on the Zen 4, 2026-12-01; 2.4e-7 and 4.2e-7 on an AMX Xeon.
        ("tp2ep2", 2, TP2_EP2_ETP1, 1e-6),
        # Measured on 2026-11-30: 1.9e-5 (loss) and 4.3e-5 (gradient norm); the first step's loss is one process's.
        ("fsdp2", 2, FSDP2, 1e-4)]),
    "float8": ("float8 (rowwise) grouped matmuls (quantize.grouped_mm.float8, power-of-two scales per row", [
        ("ep2", 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
                    "--training.local_batch_size", "4"], 5e-7),  # measured 2.4e-7, 2026-11-30
        # As MXFP8's (measured 1.7e-5 and 6.0e-5, 2026-12-01): the per-row scales are the whole rows', all-reduced.
        ("tp2", 2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                    "--training.local_batch_size", "8"], 1e-4),
        # Measured 6.0e-8 (loss), 0 (gradient norm) on the Zen 4, 2026-12-01; 2.4e-7 and 4.2e-7 on an AMX Xeon,
        # 2026-12-02 (oneDNN's kernels there sum some products in another order for other shapes).
        ("tp2ep2", 2, TP2_EP2_ETP1, 1e-6),
        ("fsdp2", 2, FSDP2, 1e-4)]),  # measured 1.9e-5 and 4.3e-5, 2026-11-30
}


@pytest.mark.parametrize("converter", list(GROUPED))
def test_low_precision_grouped_experts_on_expert_and_data_parallel_layouts(tmp_path, converter):
    """quantize.grouped_mm.mx / .float8 on a small Qwen3-MoE (8 experts of 64 hidden units, top 2, balancing on), 10
    float32 steps against one process. The experts' products cast per token row and per weight row, and the weight
    gradient per expert along its tokens (MXFP8 in blocks of 32, float8 with one scale per row over them). Under EP
    (also EP 2 on the TP 2 ranks with ETP 1, the routed rows split over TP) each expert receives the whole batch's
    tokens in one process's order, so its casts are one process's. Under TP each rank holds 32 of every expert's 64
    hidden units: one MX block, and float8 takes each per-row scale over both ranks' pieces (checked bitwise where it
    matters by tests/dist/test_float8_tensor_parallel.cpp), so the first step is one process's and later ones drift
    by low-precision roundings of TP's float32 partial-sum differences. Under FSDP 2 each rank's experts see only that rank's tokens, so
    their weight-gradient casts are taken over other tokens (as in torchtitan): the first step's loss is one process's,
    the gradients differ by low-precision roundings."""
    from test_qwen3_layouts import COMMON as QWEN3_COMMON, MOE

    line, layouts = GROUPED[converter]

    def steps(name, np_, extra):
        out = tmp_path / name
        mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(np_)]
        result = run(([] if np_ == 1 else mpirun) + [binary("titan_train_probe"), "--probe.out", str(out), "--job.dump_folder",
                     str(out / "dump"), *QWEN3_COMMON, *MOE, "--model.moe_inter_dim", "64", "--training.steps", str(STEPS),
                     "--model.converters", f"quantize.grouped_mm.{converter}", f"--quantize.grouped_mm.{converter}.fqns", "experts",
                     *extra], env={"OMP_NUM_THREADS": "1"}, timeout=900)
        converted = line in result.stdout
        assert converted == (name != "plain") and (not converted or "2 MoE expert unit(s) converted" in result.stdout)
        return json.loads((out / "metrics.json").read_text())["steps"]

    one = steps("one", 1, ["--training.local_batch_size", "8"])
    plain = steps("plain", 1, ["--training.local_batch_size", "8", "--model.converters", ""])
    assert relative(plain, one, "loss") > 1e-6  # the conversion changes the run
    for name, np_, extra, bound in layouts:
        got = steps(name, np_, extra)
        loss, norm = relative(got, one, "loss"), relative(got, one, "grad_norm")
        print(f"{converter} grouped experts {name}: worst relative loss difference {loss:.2e}, gradient norm {norm:.2e} over {STEPS} steps")
        assert abs(got[0]["loss"] - one[0]["loss"]) <= 1e-6 * one[0]["loss"]
        if name != "fsdp2":  # FSDP 2's first gradients already carry its own weight-gradient casts
            assert abs(got[0]["grad_norm"] - one[0]["grad_norm"]) <= 1e-6 * one[0]["grad_norm"]
        assert loss <= bound and norm <= bound


TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "8"]
TP2_FSDP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]


def test_mxfp8_under_tensor_parallelism(tmp_path):
    """MXFP8 (mxfp8_cublas, emulated) under TP, with torchtitan's plain TP styles (its MX communication stays in high
    precision): each rank's shard of a converted weight holds whole blocks of 32 along both dimensions, so every
    block and scale is one process's and TP 2 and TP 2 x FSDP 2 follow one process to float32 precision. With 4
    key/value heads of 16 the key and value projections (64 x 64) split into 32-row shards; with 2 heads their 16-row
    shards would cut blocks, which is refused naming the layer and the filter to add."""
    kv4 = ["--model.n_kv_heads", "4"]
    one = probe(tmp_path, "mx_one", 1, ["--training.local_batch_size", "8", *kv4], recipe="mxfp8_cublas")
    for name, np_, layout in (("mx_tp2", 2, TP2), ("mx_tp2_fsdp2", 4, TP2_FSDP2)):
        steps = probe(tmp_path, name, np_, layout + kv4, recipe="mxfp8_cublas")
        worst = relative(steps, one, "loss")
        print(f"MXFP8 {name}: worst relative loss difference from one process over {STEPS} steps {worst:.2e}, "
              f"gradient norm {relative(steps, one, 'grad_norm'):.2e}")
        assert abs(steps[0]["loss"] - one[0]["loss"]) <= 1e-6 * one[0]["loss"], (steps[0], one[0])
        assert abs(steps[0]["grad_norm"] - one[0]["grad_norm"]) <= 1e-6 * one[0]["grad_norm"], (steps[0], one[0])
        assert worst <= 1e-5
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "2"]
    args = without_float8(COMMON) + ["--model.converters", "mx", "--quantize.linear.mx.emulate", "--quantize.linear.mx.filter_fqns", "output"]
    refused = run(mpirun + [binary("titan"), "train", "--job.dump_folder", str(tmp_path / "refused"), *args, *TP2],
                  env={"OMP_NUM_THREADS": "1"}, check=False)
    assert refused.returncode != 0, refused.stdout[-2000:]
    # Every such layer is named at once, with the filter entries that keep exactly them.
    assert ('4 converted weights would be split into pieces that cut MXFP8\'s blocks of 32 (each rank\'s piece: '
            '"layers.0.attention.wk" [16, 64], "layers.0.attention.wv" [16, 64], "layers.1.attention.wk" [16, 64]' in refused.stderr and
            'add "attention.wk", "attention.wv" to quantize.linear.mx.filter_fqns' in refused.stderr), refused.stderr[-2000:]


def test_float8_under_tensor_parallelism(tmp_path):
    """Tensorwise float8 under TP: every per-tensor scale comes from the amax of the whole tensor (the weight, the
    input, the output gradient), reduced over the TP ranks as torchao's casts of DTensors do, so TP 2 follows one
    process to float32 precision, while the sequence all-gathers move float8 (torchao's float8 TP styles); TP 2 x FSDP 2 with float8 all-gathers (the amax reduced over the shard and TP
    groups) equals TP 2 x FSDP 2 without them bitwise (float32 gathers)."""
    one = probe(tmp_path, "tw_one", 1, ["--training.local_batch_size", "8"], recipe="tensorwise")
    tp = probe(tmp_path, "tw_tp2", 2, TP2, recipe="tensorwise")
    worst = relative(tp, one, "loss")
    norms = relative(tp, one, "grad_norm")
    print(f"float8 TP 2 against one process (tensorwise): worst relative loss difference {worst:.2e}, gradient norm {norms:.2e}")
    assert worst <= 1e-5 and norms <= 1e-5
    # The TP all-gathers of the attention and feed-forward inputs (forward) and of wo's and w2's output gradients
    # (backward) move E4M3 / E5M2 instead of float32: 4 per block of 8 x 16 x 64 elements on each rank, 3 bytes
    # saved per element. The scales' amax all-reduces (4 bytes each on 2 ranks) add, per block, 2 + 2 for those
    # casts and, for the linears, the weight of each of the 7 in forward and backward, wo's and w2's inputs in both,
    # and wq/wk/wv/w1/w3's output gradient once (its per-tensor cast serves both backward matmuls, as torchao casts
    # it once): 27.
    cmd = ["mpirun" if not os.environ.get("TITAN_MPIRUN") else os.environ["TITAN_MPIRUN"], "--oversubscribe", "--allow-run-as-root",
           "--bind-to", "none", "-np", "2", binary("titan_train_probe"), "--probe.out", str(tmp_path / "tp2_plain"),
           "--job.dump_folder", str(tmp_path / "tp2_plain" / "dump"), *without_float8(COMMON), *TP2]
    run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    plain_tp = json.loads((tmp_path / "tp2_plain" / "metrics.json").read_text())["steps"]
    saved, amax = 2 * 4 * (8 * 16 * 64) * (4 - 1), 2 * 27 * 4
    for a, b in zip(plain_tp, tp):
        assert a["tensor_parallel_bytes"] - b["tensor_parallel_bytes"] == saved - amax, (a, b)
    print(f"TP bytes per step on each rank: {plain_tp[0]['tensor_parallel_bytes']:,} in float32, {tp[0]['tensor_parallel_bytes']:,} "
          "with float8 linears")
    plain = probe(tmp_path, "tw_tp2_fsdp2", 4, TP2_FSDP2, recipe="tensorwise")
    gathered = probe(tmp_path, "tw_tp2_fsdp2_float8", 4, TP2_FSDP2 + PRECOMPUTE, recipe="tensorwise")
    assert [(s["loss"], s["grad_norm"]) for s in gathered] == [(s["loss"], s["grad_norm"]) for s in plain]


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_float8_under_tensor_parallelism(tmp_path, recipe):
    """The rowwise recipes under TP (torchtitan applies its plain TP styles to torchao's rowwise float8 linears, whose
    casts of DTensors take each row's amax over the ranks holding parts of it): a row is split only along the
    weight's split dimension, so a row-parallel linear reduces its input's and weight's per-row amaxes in forward and
    a column-parallel one its output gradient's and weight's in the input gradient's matmul; every other scale is
    local. TP 2 and TP 2 x FSDP 2 then follow one process to float32 precision (the first step to 1e-6 in loss and
    gradient norm), and TP's collectives move the compute dtype (float32 here), as without float8."""
    one = probe(tmp_path, "one", 1, ["--training.local_batch_size", "8"], recipe=recipe)
    for name, np, layout in (("tp2", 2, TP2), ("tp2_fsdp2", 4, TP2_FSDP2)):
        steps = probe(tmp_path, name, np, layout, recipe=recipe)
        first, ref = steps[0], one[0]
        assert abs(first["loss"] - ref["loss"]) <= 1e-6 * ref["loss"], (name, first, ref)
        assert abs(first["grad_norm"] - ref["grad_norm"]) <= 1e-6 * ref["grad_norm"], (name, first, ref)
        worst, norms = relative(steps, one, "loss"), relative(steps, one, "grad_norm")
        print(f"float8 {recipe} {name} against one process: worst relative loss difference {worst:.2e}, gradient norm {norms:.2e}")
        assert worst <= 1e-5 and norms <= 1e-5
    # Without the float8 TP styles the TP collectives carry what they carry without float8, plus the per-row amax
    # all-reduces (4 bytes per float32 amax, as the tensorwise test counts them). Per block, of 8 x 32 tokens on each
    # rank: wo and w2 (row-parallel) reduce their input's 256 row amaxes and their weight's 64 in forward; wq, wk,
    # wv, w1 and w3 (column-parallel) their output gradient's 256 and their weight's 64 (per input feature) in
    # backward. rowwise_with_gw_hp casts the weight per tensor for the input gradient: 1 amax for each of the 7.
    per_block = 2 * (256 + 64) + 5 * (256 + 64) if recipe == "rowwise" else 2 * (256 + 64) + 5 * (256 + 1) + 2 * 1
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "2"]
    run(mpirun + [binary("titan_train_probe"), "--probe.out", str(tmp_path / "tp2_plain"), "--job.dump_folder",
                  str(tmp_path / "tp2_plain" / "dump"), *without_float8(COMMON), *TP2, "--training.steps", "1"],
        env={"OMP_NUM_THREADS": "1"}, timeout=900)
    plain_bytes = json.loads((tmp_path / "tp2_plain" / "metrics.json").read_text())["steps"][0]["tensor_parallel_bytes"]
    tp_bytes = json.loads((tmp_path / "tp2" / "metrics.json").read_text())["steps"][0]["tensor_parallel_bytes"]
    assert tp_bytes - plain_bytes == 2 * per_block * 4, (tp_bytes, plain_bytes, 2 * per_block * 4)


def without_float8(args):
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
        elif a == "--model.converters":
            skip = 1
        elif a.startswith("--quantize.linear.float8."):
            skip = 0 if a == "--quantize.linear.float8.emulate" or i + 1 == len(args) or args[i + 1].startswith("--") else 1
        else:
            out.append(a)
    return out


@pytest.mark.parametrize("saved_with_float8", [True, False])
def test_a_checkpoint_moves_between_float8_and_high_precision(tmp_path, saved_with_float8):
    """Saved at step 5 by TP 2 x FSDP 2 with float8 linears and float8 all-gathers, loaded by one process without
    float8 (and the other way round): the loaded weights and AdamW moments are bitwise the saved ones, and training
    continues from step 6."""
    float8 = ["--quantize.linear.float8.recipe_name", "tensorwise", *PRECOMPUTE]
    save = (4, COMMON + float8 + TP2_FSDP2) if saved_with_float8 else (1, without_float8(COMMON) + ["--training.local_batch_size", "8"])
    load = (1, without_float8(COMMON) + ["--training.local_batch_size", "8"]) if saved_with_float8 else (4, COMMON + float8 + TP2_FSDP2)
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.no_last_save_model_only"]
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np"]
    dump = tmp_path / "run"
    ranks, args = save
    run(([] if ranks == 1 else mpirun + [str(ranks)]) + [binary("titan"), "train", "--job.dump_folder", str(dump), *args, *checkpoint,
                                                         "--training.steps", "5"], env={"OMP_NUM_THREADS": "1"}, timeout=600)
    _, stored = read_checkpoint(dump / "checkpoint" / "step-5")
    ranks, args = load
    out = tmp_path / "probe"
    result = run(([] if ranks == 1 else mpirun + [str(ranks)]) + [
        binary("titan_train_probe"), "--probe.out", str(out), "--probe.loaded_state", "--job.dump_folder", str(dump), *args,
        *checkpoint, "--checkpoint.load_step", "5", "--training.steps", "8"], env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert ("Float8 linears" in result.stdout) == (not saved_with_float8)
    state = load_file(str(out / "loaded_state.safetensors"))
    assert sorted(state) == sorted(stored)
    for key, value in stored.items():
        assert np.array_equal(state[key].numpy(), value), key
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [6, 7, 8]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8_cublas"])
def test_float8_under_tensor_parallelism_in_moe_models(tmp_path, recipe):
    """A small DeepSeek-V3 (latent attention, a dense block, MoE blocks with a shared expert; float8 or MXFP8,
    emulated) on TP 2 against one process: the shared experts' float8 linears, split inside the MoE layer's partial
    region, take each scale over the whole tensor as the attention's and dense feed-forward's do, so the first step's
    loss and gradient norm are one process's (bitwise on 2026-11-29; before the shared experts' amax was reduced the
    loss differed by 2.5e-7); later steps drift apart by float8 roundings of ulp-level float32 differences (2.0e-6
    measured over 6 steps; the same model without float8 stays bitwise equal). MXFP8's blocks stay within each rank's
    shards (the experts' hidden width is 64 there, so the shared experts' shards are 32 wide). The router and the
    latent down-projections, whose output gradients are partial sums under TP, are refused by name unless filtered."""
    from test_deepseek_v3_layouts import DEEPSEEK

    mx = recipe.startswith("mxfp8")
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "2"]
    model = list(DEEPSEEK)
    model[model.index("--model.moe_num_experts") + 1] = "16"  # the router (16 x 64) is then convertible to float8
    if mx:
        model[model.index("--model.moe_inter_dim") + 1] = "64"
    key = "--quantize.linear.mx." if mx else "--quantize.linear.float8."
    common = [*model, "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.seq_len", "32",
              "--training.global_batch_size", "8", "--training.local_batch_size", "8", "--training.mixed_precision_param", "float32",
              "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "3", "--training.max_norm", "0.5", "--debug.seed", "0",
              "--metrics.log_freq", "1", "--training.data_lanes", "4", "--activation_checkpoint.mode", "none", "--training.steps", "6",
              "--model.converters", "mx" if mx else "quantize.linear.float8", key + "emulate", key + "recipe_name", recipe]
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    refused = run(mpirun + [binary("titan"), "train", "--job.dump_folder", str(tmp_path / "refused"), *common, *tp2,
                            key + "filter_fqns", "output"], env={"OMP_NUM_THREADS": "1"}, check=False)
    # MXFP8 converts neither the 16-row router nor wkv_a (48 rows), only wq_a (32 x 64).
    needle = ('the MXFP8 linears "layers.0.attention.wq_a" ... "layers.2.attention.wq_a" (3) run whole on every tensor-parallel '
              'rank and take partial output gradients, which MXFP8 cannot scale as one process does; add "wq_a" to '
              'quantize.linear.mx.filter_fqns' if mx else
              '"layers.0.attention.wq_a" ... "layers.2.moe.router.gate" (8) run whole on every tensor-parallel rank and take partial '
              'output gradients, which float8 cannot scale as one process does; add "wq_a", "wkv_a", "router.gate" to '
              'quantize.linear.float8.filter_fqns (torchtitan\'s DeepSeek-V3 TOMLs filter the router)')
    assert refused.returncode != 0 and needle in refused.stderr, refused.stderr[-2000:]
    filtered = common + [key + "filter_fqns", "output,router.gate,wq_a,wkv_a"]
    steps = {}
    for name, launch in (("one", []), ("tp2", mpirun)):
        out = tmp_path / name
        result = run(launch + [binary("titan_train_probe"), "--probe.out", str(out), "--job.dump_folder", str(out / "dump"), *filtered,
                               *(tp2 if launch else [])], env={"OMP_NUM_THREADS": "1"}, timeout=900)
        # shared experts, wq_b, wkv_b, wo, dense FFN
        assert (f"MXFP8 linears ({recipe}" if mx else f"Float8 linears ({recipe}, emulated") in result.stdout
        assert "18 converted" in result.stdout
        steps[name] = json.loads((out / "metrics.json").read_text())["steps"]
    first_one, first_tp = steps["one"][0], steps["tp2"][0]
    # Rowwise: one float32 ulp of the first loss apart (measured 2026-11-30; the per-row amax reductions themselves
    # are checked bitwise by tests/dist/test_float8_tensor_parallel.cpp).
    bound = 1e-7 if recipe == "tensorwise" else 2.5e-7
    assert abs(first_tp["loss"] - first_one["loss"]) <= bound * first_one["loss"], (first_tp, first_one)
    assert abs(first_tp["grad_norm"] - first_one["grad_norm"]) <= bound * first_one["grad_norm"], (first_tp, first_one)
    worst = relative(steps["tp2"], steps["one"], "loss")
    print(f"{recipe} DeepSeek-V3 TP 2 against one process: worst relative loss difference over 6 steps {worst:.2e}")
    assert worst <= 1e-4
