"""torch.distributed.checkpoint (DCP) both ways, against PyTorch's own DCP and torchtitan's CheckpointManager
(v0.2.2, from the test venv): torchtitan's checkpoints (saved by 2 FSDP ranks) convert into titan bitwise, train
on in titan from where they stopped (model, AdamW state, step, LR schedule) under other layouts, and titan's
checkpoints export to DCP directories that torchtitan loads (2 ranks) with every tensor equal."""
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from titan_testing import SOURCE_DIR, binary, read_checkpoint, run

HELPER = SOURCE_DIR / "tests" / "helpers" / "torchtitan_checkpoint.py"


def torchtitan(*args):
    return run([sys.executable, str(HELPER), *map(str, args)], env={"OMP_NUM_THREADS": "1"}, timeout=600)


def dcp_tensors(directory):
    """Every tensor of a DCP directory, read by PyTorch's own DCP loader (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(directory))
    return state


def dcp_train_state(directory):
    """torchtitan's train state (pickled integers), read by PyTorch's DCP loader."""
    import torch.distributed.checkpoint as dcp

    state = {"train_state": {"step": 0, "ntokens_seen": 0}}
    dcp.load(state, checkpoint_id=str(directory))
    return state["train_state"]


def as_numpy(t):
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def titan_train(dump, steps, extra=(), np_=1):
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", str(np_)] if np_ > 1 else []
    return run(mpi + [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                      "--job.dump_folder", str(dump), "--training.seq_len", "16", "--training.local_batch_size", "2",
                      "--training.steps", str(steps), "--checkpoint.enable", "--debug.seed", "0", *extra],
               env={"OMP_NUM_THREADS": "1" if np_ > 1 else "2"})


@pytest.fixture(scope="module")
def torchtitan_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("torchtitan") / "run"
    torchtitan("save", 2, base)
    return base / "checkpoint"


@pytest.mark.parametrize("step", [2, 3])
def test_torchtitan_checkpoints_convert_bitwise(torchtitan_run, tmp_path, step):
    """step-2 is the full float32 training state of 2 FSDP ranks (every weight in two row chunks); step-3 is
    torchtitan's model-only bfloat16 last save."""
    source = torchtitan_run / f"step-{step}"
    expected = dcp_tensors(source)
    out = tmp_path / "titan"
    run([binary("titan"), "convert", "--from", str(source), "--to", str(out), "--flavor", "debugmodel"])
    meta, weights = read_checkpoint(out)
    assert sorted(weights) == sorted("model." + k for k in expected if not k.startswith("optimizer."))
    for key, value in expected.items():
        if key.startswith("optimizer."):
            continue
        assert meta["tensors"]["model." + key]["dtype"] == str(value.dtype).removeprefix("torch.")
        assert np.array_equal(weights["model." + key], as_numpy(value)), key
    # A torch.save file of the same weights, read by torch.load.
    pt = tmp_path / "weights.pt"
    run([binary("titan"), "convert", "--from", str(source), "--to", str(pt), "--flavor", "debugmodel"])
    loaded = torch.load(str(pt), weights_only=True)
    for key, value in loaded.items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("ranks,layout", [(1, []), (2, ["--parallelism.data_parallel_shard_degree", "2"]),
                                          (2, ["--parallelism.tensor_parallel_degree", "2"])])
def test_titan_resumes_a_torchtitan_checkpoint(torchtitan_run, tmp_path, ranks, layout):
    """A torchtitan step-2 folder in titan's checkpoint folder is resumed: the weights exactly (lr 1e-30 keeps them
    through step 3), AdamW's step counts and moments (step 3's second moment is at least beta2 times step 2's, which
    a fresh optimizer state would not give), the step, token count and LR schedule position."""
    dump = tmp_path / "run"
    shutil.copytree(torchtitan_run / "step-2", dump / "checkpoint" / "step-2")
    result = titan_train(dump, 3, ["--checkpoint.interval", "1", "--checkpoint.last_save_model_only", "false",
                                   "--optimizer.lr", "1e-30", *layout], np_=ranks)
    assert "Loaded torch DCP checkpoint" in result.stdout and "step 2: model, optimizer, LR schedule" in result.stdout
    assert "the data loader starts from the beginning of the data" in result.stdout + result.stderr
    before = dcp_tensors(torchtitan_run / "step-2")
    meta, after = read_checkpoint(dump / "checkpoint" / "step-3")
    assert meta["train_state"]["step"] == 3 and meta["lr_scheduler"]["completed"] == 3
    saved = dcp_train_state(torchtitan_run / "step-2")
    assert saved["step"] == 2
    # torchtitan counts each of its 2 ranks' tokens, titan all ranks'.
    assert meta["train_state"]["tokens_seen"] == 2 * saved["ntokens_seen"] + 2 * 16 * (2 if layout and "data_parallel" in layout[0] else 1)
    for key, value in before.items():
        if key.startswith("optimizer."):
            continue
        assert np.array_equal(after["model." + key], value.numpy()), key
        assert meta["optimizer"]["steps"][key] == 3.0, key
        v2 = before[f"optimizer.state.{key}.exp_avg_sq"].numpy()
        v3 = after[f"optimizer.exp_avg_sq.{key}"]
        assert (v3 >= 0.95 * v2 * (1 - 1e-6)).all(), key
        assert (v3 > 0).any()


def test_initial_load_path_reads_torchtitans_model_only_save(torchtitan_run, tmp_path):
    dump = tmp_path / "run"
    result = titan_train(dump, 1, ["--checkpoint.initial_load_path", str(torchtitan_run / "step-3"),
                                   "--checkpoint.interval", "1", "--optimizer.lr", "1e-30"])
    assert "Loaded model weights from torch DCP checkpoint" in result.stdout
    expected = dcp_tensors(torchtitan_run / "step-3")
    _, after = read_checkpoint(dump / "checkpoint" / "step-1")
    for key, value in expected.items():
        assert np.array_equal(after["model." + key], value.float().numpy()), key


@pytest.mark.parametrize("world", [1, 2])
def test_titan_checkpoint_exports_to_dcp_that_torchtitan_loads(tmp_path, world):
    """titan's full checkpoint in torchtitan's layout: torchtitan's CheckpointManager loads it (its data loader
    excluded) on 1 and 2 FSDP ranks and holds titan's weights, AdamW moments and steps bitwise, titan's step, token
    count, LR schedule position and learning rate."""
    dump = tmp_path / "titan"
    titan_train(dump, 2, ["--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false",
                          "--lr_scheduler.warmup_steps", "2"])
    meta, saved = read_checkpoint(dump / "checkpoint" / "step-2")
    base = tmp_path / "torchtitan"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-2"), "--to",
         str(base / "checkpoint" / "step-2"), "--format", "dcp"])
    out = tmp_path / "loaded.safetensors"
    torchtitan("load", world, base, out)
    loaded = load_file(str(out))
    state = json.loads((tmp_path / "loaded.safetensors.json").read_text())
    assert state["step"] == 2 and state["last_epoch"] == meta["lr_scheduler"]["completed"]
    assert state["ntokens_seen"] == meta["train_state"]["tokens_seen"]
    assert state["lr"] == pytest.approx(meta["optimizer_settings"]["lr"], rel=1e-12)
    names = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    for name in names:
        assert np.array_equal(loaded[name].numpy(), saved["model." + name]), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(loaded[f"optimizer.state.{name}.{moment}"].numpy(), saved[f"optimizer.{moment}.{name}"])
        assert loaded[f"optimizer.state.{name}.step"].item() == meta["optimizer"]["steps"][name]
    # A model-only export reads with PyTorch's plain dcp.load.
    model_only = tmp_path / "model_only"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-2"), "--to", str(tmp_path / "m"),
         "--format", "titan"])
    run([binary("titan"), "convert", "--from", str(tmp_path / "m"), "--to", str(model_only), "--format", "dcp",
         "--dtype", "bfloat16"])
    plain = dcp_tensors(model_only)
    assert sorted(plain) == sorted(names)
    for name in names:
        assert plain[name].dtype == torch.bfloat16
        assert torch.equal(plain[name], torch.from_numpy(saved["model." + name]).to(torch.bfloat16)), name


def test_damaged_dcp_directories_are_refused_by_name(torchtitan_run, tmp_path):
    def convert(source, flavor="debugmodel"):
        return run([binary("titan"), "convert", "--from", str(source), "--to", str(tmp_path / "out"), "--flavor", flavor],
                   check=False)

    result = convert(torchtitan_run / "step-3", "debugmodel_gqa")
    assert result.returncode == 2 and '"layers.0.attention.wk.weight" has shape [256, 256]' in result.stderr, result.stderr
    broken = tmp_path / "truncated"
    shutil.copytree(torchtitan_run / "step-3", broken)
    data = sorted(broken.glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[:-100])
    result = convert(broken)
    assert result.returncode == 2 and data.name in result.stderr, result.stderr
    missing = tmp_path / "missing"
    shutil.copytree(torchtitan_run / "step-3", missing)
    sorted(missing.glob("*.distcp"))[0].unlink()
    result = convert(missing)
    assert result.returncode == 2 and "cannot open" in result.stderr and "__0_0.distcp" in result.stderr, result.stderr
    garbled = tmp_path / "garbled"
    shutil.copytree(torchtitan_run / "step-3", garbled)
    (garbled / ".metadata").write_bytes((garbled / ".metadata").read_bytes()[:200])
    result = convert(garbled)
    assert result.returncode == 2 and "truncated pickle" in result.stderr and ".metadata" in result.stderr, result.stderr
    flipped = tmp_path / "flipped"
    shutil.copytree(torchtitan_run / "step-3", flipped)
    raw = bytearray((flipped / "__0_0.distcp").read_bytes())
    raw[len(raw) // 2] ^= 0x20
    (flipped / "__0_0.distcp").write_bytes(bytes(raw))
    result = convert(flipped)
    assert result.returncode == 2 and ("CRC-32" in result.stderr or "malformed" in result.stderr), result.stderr
    assert not (tmp_path / "out").exists()
    result = run([binary("titan"), "convert", "--from", str(torchtitan_run / "step-3"), "--to", str(tmp_path / "x")],
                 check=False)
    assert result.returncode == 2 and "pass --flavor" in result.stderr, result.stderr


def test_single_process_dcp_with_strided_and_bf16_tensors_converts_bitwise(tmp_path):
    """A DCP checkpoint saved by one process with plain torch.distributed.checkpoint.save: the debug model's shapes
    with random values, some tensors stored transposed (non-contiguous chunks, strides honoured), some bfloat16."""
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    state = {}
    expected = {}
    names = dcp_tensors_names()
    for i, (name, shape) in enumerate(names):
        value = torch.randn(*shape, generator=generator)
        if i % 3 == 1 and len(shape) == 2:
            value = value.t().contiguous().t()  # column-major storage, the same values
        if i % 4 == 2:
            value = value.to(torch.bfloat16)
        state[name] = value
        expected[name] = value.contiguous()
    source = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(source))
    out = tmp_path / "titan"
    run([binary("titan"), "convert", "--from", str(source), "--to", str(out), "--flavor", "debugmodel"])
    _, weights = read_checkpoint(out)
    for name, value in expected.items():
        assert np.array_equal(weights["model." + name], as_numpy(value)), name


def test_dcp_of_a_wrapped_state_dict_is_read_one_level_down(tmp_path):
    """dcp.save({"model": model.state_dict()}) nests every key under "model."; titan convert and
    checkpoint.initial_load_path read the model from there and say so."""
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(1)
    state = {name: torch.randn(*shape, generator=generator) for name, shape in dcp_tensors_names()}
    source = tmp_path / "wrapped"
    dcp.save({"model": state, "step": 7}, checkpoint_id=str(source))
    out = tmp_path / "titan"
    result = run([binary("titan"), "convert", "--from", str(source), "--to", str(out), "--flavor", "debugmodel"])
    assert 'under "model."' in result.stderr, result.stderr
    _, weights = read_checkpoint(out)
    for name, value in state.items():
        assert np.array_equal(weights["model." + name], value.numpy()), name
    # Training starts from it: the first step's loss is the one the converted weights give.
    common = ["--checkpoint.interval", "100", "--metrics.log_freq", "1", "--metrics.disable_color_printing"]
    direct = titan_train(tmp_path / "direct", 1, ["--checkpoint.initial_load_path", str(out), *common])
    nested = titan_train(tmp_path / "nested", 1, ["--checkpoint.initial_load_path", str(source),
                                                   "--checkpoint.initial_load_model_only", *common])
    assert 'under "model."' in nested.stderr + nested.stdout
    loss = lambda r: re.findall(r"loss:\s*([0-9.]+)", r.stdout + r.stderr)
    assert loss(direct) and loss(direct) == loss(nested), (loss(direct), loss(nested))


def dcp_tensors_names():
    """torchtitan's debug model: its parameter names and shapes."""
    names = [("tok_embeddings.weight", (2048, 256))]
    for i in range(6):
        p = f"layers.{i}."
        names += [(p + "attention.wq.weight", (256, 256)), (p + "attention.wk.weight", (256, 256)),
                  (p + "attention.wv.weight", (256, 256)), (p + "attention.wo.weight", (256, 256)),
                  (p + "feed_forward.w1.weight", (768, 256)), (p + "feed_forward.w2.weight", (256, 768)),
                  (p + "feed_forward.w3.weight", (768, 256)), (p + "attention_norm.weight", (256,)),
                  (p + "ffn_norm.weight", (256,))]
    return names + [("norm.weight", (256,)), ("output.weight", (2048, 256))]


def test_custom_shapes_read_back_with_the_training_jobs_configuration(tmp_path):
    """A torch DCP folder or torch.save file records no shape: a model of custom shape (here Qwen3 with its [model]
    keys set in the job's TOML) is read back with `--config` (or the same `--model.KEY` options) by `titan convert` and
    `titan generate`, bitwise and token for token; a configuration of another shape is refused by name."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "qwen3"\nflavor = "debugmodel"\ndim = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n'
                   'head_dim = 32\nhidden_dim = 128\nhf_assets_path = "builtin"\n\n[training]\nseq_len = 16\n'
                   'local_batch_size = 2\nsteps = 2\ndataset = "fortunes"\nmixed_precision_param = "float32"\n')
    run([binary("titan"), "train", "--job.config_file", str(job), "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable",
         "--debug.seed", "0", "--activation_checkpoint.mode", "none"], env={"OMP_NUM_THREADS": "2"})
    step = tmp_path / "run" / "checkpoint" / "step-2"
    tokenizer = json.loads((step / "metadata.json").read_text())["tokenizer"]
    _, original = read_checkpoint(step)
    run([binary("titan"), "convert", "--from", str(step), "--to", str(tmp_path / "dcp"), "--format", "dcp"])
    run([binary("titan"), "convert", "--from", str(step), "--to", str(tmp_path / "weights.pt")])
    options = ["--model", "qwen3", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
               "--model.head_dim", "32", "--model.hidden_dim=128", "--model.tie_word_embeddings", "--training.seq_len", "16",
               "--model.no_print_after_conversion", "--model.print_after_conversion", "false"]  # booleans as titan train takes them
    for source, shape in [("dcp", ["--config", str(job)]), ("weights.pt", ["--config", str(job)]), ("dcp", options)]:
        out = tmp_path / ("back-" + source + str(len(shape)))
        run([binary("titan"), "convert", "--from", str(tmp_path / source), "--to", str(out), *shape])
        _, back = read_checkpoint(out)
        assert sorted(back) == sorted(original)
        for key in original:
            assert np.array_equal(original[key], back[key]), (source, key)
    sample = ["--prompt", "The best", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos", "--json"]
    expected = json.loads(run([binary("titan"), "generate", "--checkpoint", str(step), *sample]).stdout)["ids"]
    from_dcp = run([binary("titan"), "generate", "--checkpoint", str(tmp_path / "dcp"), "--config", str(job), "--tokenizer", tokenizer,
                    *sample])
    assert json.loads(from_dcp.stdout)["ids"] == expected
    # The titan checkpoint records its shape: a configuration that agrees passes, one that does not is named.
    run([binary("titan"), "convert", "--from", str(step), "--to", str(tmp_path / "agreed.pt"), "--config", str(job)])
    for source, extra, message in [
            ("dcp", [], "pass --flavor (a built-in shape"),
            ("dcp", ["--config", str(job), "--model.dim", "32"], "has shape [2048, 64], the model (debugmodel with dim"),
            ("run/checkpoint/step-2", ["--config", str(job), "--model.n_layers", "3"], "is not the model"),
            ("dcp", ["--config", str(job), "--flavor", "debugmodel"], "both give the shape"),
            ("dcp", ["--config", str(job), "--model", "llama3"], "--model llama3 and the configuration's model.name = qwen3"),
            ("dcp", ["--config", str(tmp_path / "missing.toml")], "missing.toml"),
            ("dcp", ["--config", str(job), "--model.dimm", "32"], "unknown option \"--model.dimm\"; did you mean")]:
        result = run([binary("titan"), "convert", "--from", str(tmp_path / source), "--to", str(tmp_path / "refused"), *extra],
                     check=False)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
