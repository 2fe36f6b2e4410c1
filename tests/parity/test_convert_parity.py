"""`titan convert` and Hugging Face interop: a trained titan checkpoint exported to an HF directory loads in
transformers' LlamaForCausalLM and gives titan's logits; HF -> titan -> HF and titan -> HF -> titan round trips
are bitwise; sharded exports carry an index; checkpoint.initial_load_in_hf starts training from HF weights,
also under FSDP and TP."""
import json
import shutil
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_testing import shared, SOURCE_DIR, binary, read_checkpoint, run



def titan_train(dump, steps, extra=(), np_=1):
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", str(np_)] if np_ > 1 else []
    return run(mpi + [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                      "--job.dump_folder", str(dump), "--training.seq_len", "64", "--training.local_batch_size", "2",
                      "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", str(steps),
                      "--debug.seed", "0", *extra], env={"OMP_NUM_THREADS": "1" if np_ > 1 else "2"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    dump = tmp_path_factory.mktemp("trained")
    titan_train(dump, 5)  # the last save is model-only float32 (torchtitan's default)
    step = dump / "checkpoint" / "step-5"
    meta = json.loads((step / "metadata.json").read_text())
    assert meta["model_only"] and all(t["dtype"] == "float32" for t in meta["tensors"].values())
    return step


def test_exported_model_gives_titans_logits_in_transformers(trained, tmp_path):
    from transformers import LlamaForCausalLM

    hf = tmp_path / "hf"
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(hf)])
    model = LlamaForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    torch.manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 48))
    labels = torch.roll(tokens, -1, 1)
    save_file({"inputs": tokens, "labels": labels}, str(tmp_path / "batch.safetensors"))
    run([binary("titan_model_probe"), "--flavor", "debugmodel", "--weights", str(hf / "model.safetensors"),
         "--batch", str(tmp_path / "batch.safetensors"), "--out", str(tmp_path / "out.safetensors")])
    titan_logits = load_file(str(tmp_path / "out.safetensors"))["logits"]
    with torch.no_grad():
        hf_logits = model(input_ids=tokens).logits
    assert (titan_logits - hf_logits).abs().max().item() < 2e-5
    # The weights are the trained ones, not an initialisation: they differ from a fresh model's.
    _, saved = read_checkpoint(trained)
    assert not np.allclose(saved["model.norm.weight"], 1.0)


def test_round_trips_are_bitwise_and_shards_are_indexed(trained, tmp_path):
    _, original = read_checkpoint(trained)
    hf = tmp_path / "hf"
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(hf), "--max-shard-mb", "5"])
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    back = tmp_path / "back"
    run([binary("titan"), "convert", "--from", str(hf), "--to", str(back), "--flavor", "debugmodel"])
    _, restored = read_checkpoint(back)
    assert sorted(restored) == sorted(original)
    for key in original:
        assert np.array_equal(original[key], restored[key]), key
    # The HF directory's tokenizer goes with the weights: the titan checkpoint records it, and its next export carries it.
    assert json.loads((back / "metadata.json").read_text())["tokenizer"] == str((hf / "tokenizer.json").resolve())
    hf2 = tmp_path / "hf2"
    run([binary("titan"), "convert", "--from", str(back), "--to", str(hf2)])
    assert (hf2 / "tokenizer.json").exists() and "eos_token_id" in json.loads((hf2 / "config.json").read_text())
    merged = {}
    for f in files:
        merged.update(load_file(str(hf / f)))
    again = load_file(str(hf2 / "model.safetensors"))
    assert sorted(merged) == sorted(again)
    for name in merged:
        assert torch.equal(merged[name], again[name]), name
    # An index that does not match its shards (files of two downloads mixed, a shard replaced) is refused by name,
    # as is a tensor held twice; transformers would fail too, or load whichever copy it met.
    import shutil
    def convert_bad(edit):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(hf, bad)
        edit(bad, json.loads((bad / "model.safetensors.index.json").read_text()))
        return run([binary("titan"), "convert", "--from", str(bad), "--to", str(tmp_path / "bad_out"), "--flavor", "debugmodel"],
                   check=False)
    def write_index(bad, index):
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    moved = next(n for n, f in index["weight_map"].items() if f == files[0])
    def misplace(bad, index):
        index["weight_map"][moved] = files[1]
        write_index(bad, index)
    def duplicate(bad, index):
        shutil.copy(bad / files[0], bad / "zz-extra.safetensors")
        index["weight_map"]["lm_head.extra"] = "zz-extra.safetensors"
        write_index(bad, index)
    for edit, message in [(misplace, f'says "{moved}" is in {files[1]}, but {files[0]} holds it'),
                          (lambda bad, index: write_index(bad, {"metadata": {}}), 'no "weight_map" object'),
                          (duplicate, f"is in both {files[0]} and zz-extra.safetensors"),
                          (lambda bad, index: save_file({k: v for k, v in load_file(str(bad / files[0])).items() if k != moved},
                                                        str(bad / files[0]), metadata={"format": "pt"}),
                           f'says "{moved}" is in {files[0]}, which does not hold it')]:
        result = convert_bad(edit)
        assert result.returncode == 2 and message in result.stderr, (message, result.stderr)
    # An index entry the model does not need (a rotary table, say) that no file holds: a warning, not an error.
    result = convert_bad(lambda bad, index: write_index(bad, {"weight_map": {**index["weight_map"],
                                                                             "model.layers.0.self_attn.rotary_emb.inv_freq": files[0]}}))
    assert result.returncode == 0 and "lists 1 tensor(s) its files do not hold" in result.stdout + result.stderr, result.stderr
    # A read-only tokenizer (shared data often is) gives the export files of its own, which their owner can change.
    tokenizer = tmp_path / "read_only_tokenizer"
    shutil.copytree(shared("tokenizers", "torchtitan_test"), tokenizer)
    for f in tokenizer.iterdir():
        f.chmod(0o444)
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(tmp_path / "hf_tok"), "--tokenizer", str(tokenizer)])
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in (tmp_path / "hf_tok").iterdir())
    # bfloat16 export
    hf_bf16 = tmp_path / "hf_bf16"
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(hf_bf16), "--dtype", "bfloat16"])
    assert json.loads((hf_bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(hf_bf16 / "model.safetensors")).values())


@pytest.mark.parametrize("ranks,tp", [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_training_starts_from_hugging_face_weights(trained, tmp_path, ranks, tp):
    """Every rank reads only the rows of its pieces from the safetensors file; FSDP 3 cuts wq/wk inside heads
    (86-row shards of 16-row heads), whose rows HF permutes within each head; TP 2 x FSDP 2 reads column blocks."""
    hf = tmp_path / "hf"
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(hf)])
    dump = tmp_path / "run"
    extra = ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf", "--optimizer.lr", "1e-30"]
    if ranks > 1:
        extra += ["--parallelism.data_parallel_shard_degree", str(ranks // tp), "--parallelism.tensor_parallel_degree", str(tp)]
    result = titan_train(dump, 1, extra, np_=ranks)
    assert "Loaded Hugging Face weights" in result.stdout
    _, original = read_checkpoint(trained)
    _, after = read_checkpoint(dump / "checkpoint" / "step-1")  # lr 1e-30: updates vanish in float32, the weights stay the loaded ones
    for key in original:
        assert np.array_equal(original[key], after[key]), key


def test_convert_errors_name_the_problem(trained, tmp_path):
    result = run([binary("titan"), "convert", "--from", str(trained), "--to", str(tmp_path / "x"), "--flavor",
                  "debugmodel_gqa"], check=False)
    assert result.returncode == 2 and "n_kv_heads (num_key_value_heads): 16 vs 4" in result.stderr, result.stderr
    hf = tmp_path / "hf"
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(hf)])
    result = run([binary("titan"), "convert", "--from", str(hf), "--to", str(tmp_path / "y"), "--flavor", "8B"], check=False)
    assert result.returncode == 2 and "dim (hidden_size): 256 vs 4096" in result.stderr, result.stderr
    again = run([binary("titan"), "convert", "--from", str(trained), "--to", str(hf)], check=False)
    assert again.returncode == 2 and "already holds weights" in again.stderr
    for extra, message in [(["--dtype", "int8"], "--dtype \"int8\": expected float32, bfloat16 or float16"),
                           (["--max-shard-mb", "0"], "--max-shard-mb \"0\": expected a positive integer"),
                           (["--max-shard-mb", "lots"], "--max-shard-mb expects an integer, got \"lots\"")]:
        result = run([binary("titan"), "convert", "--from", str(trained), "--to", str(tmp_path / "z"), *extra], check=False)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
    # A destination that cannot be made: exit code 2 (bad input), naming the path.
    result = run([binary("titan"), "convert", "--from", str(trained), "--to", "/proc/titan-export"], check=False)
    assert result.returncode == 2 and "/proc/titan-export" in result.stderr, result.stderr


@pytest.mark.parametrize("dtype,zip64", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_torch_save_export_loads_in_python(trained, tmp_path, dtype, zip64):
    """The seed's dcp_to_llama use case: a .pt of the weights that Python's torch.load (weights_only) reads."""
    out = tmp_path / "consolidated.pt"
    env = {"TITAN_TEST_TORCH_SAVE_FORCE_ZIP64": "1"} if zip64 else None
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(out), "--dtype", dtype], env=env)
    state = torch.load(str(out), weights_only=True)
    mmapped = torch.load(str(out), weights_only=True, mmap=True)  # storages are 64-byte aligned, as torch writes them
    _, original = read_checkpoint(trained)
    assert sorted("model." + k for k in state) == sorted(original)
    for name, tensor in state.items():
        assert tensor.dtype == getattr(torch, dtype)
        expected = torch.from_numpy(original["model." + name]).to(getattr(torch, dtype))
        assert torch.equal(tensor, expected), name
        assert torch.equal(mmapped[name], tensor), name
    again = run([binary("titan"), "convert", "--from", str(trained), "--to", str(out)], check=False)
    assert again.returncode == 2 and "exists" in again.stderr


def test_meta_consolidated_pth_imports_bitwise(trained, tmp_path):
    """Meta's original layout: a torch.save'd dict (bfloat16, torchtitan's names, plus Llama 2's rope.freqs), here
    written by Python's torch.save, including a tensor that is a view into a larger storage."""
    from collections import OrderedDict

    _, original = read_checkpoint(trained)
    state = OrderedDict()
    for key, value in original.items():
        state[key[len("model."):]] = torch.from_numpy(value).to(torch.bfloat16)
    shared_storage = torch.randn(5, 256).to(torch.bfloat16)
    shared_storage[2] = state["norm.weight"]
    state["norm.weight"] = shared_storage[2]  # storage offset 512, a view
    state["rope.freqs"] = torch.ones(8)
    folder = tmp_path / "Meta-Llama-debug"
    folder.mkdir()
    torch.save(state, folder / "consolidated.00.pth")
    # Meta's params.json gives the shape (the debug model's, as Meta's ModelArgs names it): no --flavor needed.
    params = {"dim": 256, "n_layers": 6, "n_heads": 16, "vocab_size": 2048, "multiple_of": 256, "norm_eps": 1e-5,
              "rope_theta": 500000.0, "use_scaled_rope": True}
    (folder / "params.json").write_text(json.dumps(params))
    out = tmp_path / "imported"
    result = run([binary("titan"), "convert", "--from", str(folder), "--to", str(out)])
    assert "params.json (debugmodel)" in result.stderr, result.stderr
    meta, imported = read_checkpoint(out)
    assert meta["flavor"] == "debugmodel" and meta["model"]["rope_scaling"]["factor"] == 8
    assert sorted(imported) == sorted(original)
    for key in original:
        expected = torch.from_numpy(original[key]).to(torch.bfloat16).float().numpy()
        assert np.array_equal(imported[key], expected), key
    # Model-parallel shards as Meta's 70B release has them (here 2): column-parallel weights split along dim 0,
    # row-parallel ones and the embedding along dim 1, norms replicated; titan merges them back.
    sharded = tmp_path / "Meta-Llama-mp2"
    sharded.mkdir()
    for rank in range(2):
        part = OrderedDict()
        for name, tensor in state.items():
            if tensor.dim() == 1:
                part[name] = tensor.clone()
            else:
                dim = 1 if name == "tok_embeddings.weight" or name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0
                part[name] = tensor.chunk(2, dim=dim)[rank].clone()
        torch.save(part, sharded / f"consolidated.{rank:02d}.pth")
    merged_out = tmp_path / "merged"
    run([binary("titan"), "convert", "--from", str(sharded), "--to", str(merged_out), "--flavor", "debugmodel"])
    _, merged = read_checkpoint(merged_out)
    for key in original:
        assert np.array_equal(merged[key], imported[key]), key
    # A --flavor is checked against params.json field by field.
    wrong = run([binary("titan"), "convert", "--from", str(folder), "--to", str(tmp_path / "w"), "--flavor",
                 "debugmodel_gqa"], check=False)
    assert wrong.returncode == 2 and "n_kv_heads (num_key_value_heads): 16 vs 4" in wrong.stderr, wrong.stderr
    # Another shape than any flavor (Llama 3 before 3.1: no RoPE scaling) imports as "custom" with that setting.
    (folder / "params.json").write_text(json.dumps({**params, "use_scaled_rope": False}))
    custom = tmp_path / "custom"
    run([binary("titan"), "convert", "--from", str(folder), "--to", str(custom)])
    custom_meta, _ = read_checkpoint(custom)
    assert custom_meta["flavor"] == "custom" and custom_meta["model"]["rope_scaling"] is None
    (folder / "params.json").write_text(json.dumps({**params, "n_layers": "six"}))
    bad = run([binary("titan"), "convert", "--from", str(folder), "--to", str(tmp_path / "b")], check=False)
    assert bad.returncode == 2 and "params.json: n_layers must be an integer" in bad.stderr, bad.stderr
    # Not a torch.save archive: a clear error.
    bogus = tmp_path / "bogus.pth"
    bogus.write_bytes(b"\x80\x02not a zip")
    result = run([binary("titan"), "convert", "--from", str(bogus), "--to", str(tmp_path / "z"), "--flavor", "debugmodel"],
                 check=False)
    assert result.returncode == 2 and "not a torch.save ZIP archive" in result.stderr, result.stderr


def test_a_wrapped_torch_save_state_dict_is_read_one_level_down(trained, tmp_path):
    """torch.save({"model": model.state_dict(), "step": 10}) is read from under "model" (and says so); two dicts of
    tensors cannot be told apart and are refused by name."""
    _, original = read_checkpoint(trained)
    state = {key[len("model."):]: torch.from_numpy(value) for key, value in original.items()}
    wrapped = tmp_path / "wrapped.pt"
    torch.save({"model": state, "step": 10, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}]}}, wrapped)
    out = tmp_path / "out"
    result = run([binary("titan"), "convert", "--from", str(wrapped), "--to", str(out), "--flavor", "debugmodel"])
    assert 'under "model"' in result.stderr, result.stderr
    _, imported = read_checkpoint(out)
    assert sorted(imported) == sorted(original) and all(np.array_equal(imported[k], original[k]) for k in original)
    # DDP's and torch.compile's prefixes on every name are read through; names of another layout are listed.
    torch.save({"module._orig_mod." + key: value for key, value in state.items()}, tmp_path / "prefixed.pt")
    result = run([binary("titan"), "convert", "--from", str(tmp_path / "prefixed.pt"), "--to", str(tmp_path / "o3"),
                  "--flavor", "debugmodel"])
    assert 'starts with "module."' in result.stderr and 'starts with "_orig_mod."' in result.stderr, result.stderr
    _, imported = read_checkpoint(tmp_path / "o3")
    assert all(np.array_equal(imported[k], original[k]) for k in original)
    torch.save({"transformer." + key: value for key, value in state.items()}, tmp_path / "other.pt")
    other = run([binary("titan"), "convert", "--from", str(tmp_path / "other.pt"), "--to", str(tmp_path / "o4"),
                 "--flavor", "debugmodel"], check=False)
    assert other.returncode == 2 and 'no tensor "tok_embeddings.weight"' in other.stderr and "e.g. \"transformer." in other.stderr, \
        other.stderr
    torch.save({"model": state, "ema": state}, tmp_path / "two.pt")
    two = run([binary("titan"), "convert", "--from", str(tmp_path / "two.pt"), "--to", str(tmp_path / "o2"),
               "--flavor", "debugmodel"], check=False)
    assert two.returncode == 2 and '"model", "ema"' in two.stderr and "cannot tell" in two.stderr, two.stderr


def test_damaged_torch_save_files_are_refused_by_name(tmp_path):
    """Every ZIP record is checked against its CRC-32, and the pickle machine refuses malformed programs (truncated
    operands, stack underflow, missing marks and memo entries) with an error instead of reading out of bounds."""
    import zipfile

    good = tmp_path / "good.pth"
    torch.save({"norm.weight": torch.arange(256, dtype=torch.float32)}, good)

    def convert(path):
        return run([binary("titan"), "convert", "--from", str(path), "--to", str(tmp_path / "out"), "--flavor",
                    "debugmodel"], check=False)

    with zipfile.ZipFile(good) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        names = [i.filename for i in z.infolist()]
        records = {name: z.read(name) for name in names}
    raw = bytearray(good.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    raw[info.header_offset + 30 + name_len + extra_len + 40] ^= 0x10  # a bit of element 10
    flipped = tmp_path / "flipped.pth"
    flipped.write_bytes(bytes(raw))
    result = convert(flipped)
    assert result.returncode == 2 and "/data/0\" fails its CRC-32 check" in result.stderr, result.stderr
    top = names[0].split("/")[0]
    for program, needle in [(b"\x80\x02\x8a\x05\x01\x02", "truncated pickle"),
                            (b"\x80\x02\x8a\x09" + bytes(9) + b".", "wider than 64 bits"),
                            (b"\x80\x02a.", "stack underflow"), (b"\x80\x02(}(K\x01e.", "APPENDS to a dict"),
                            (b"\x80\x02h\x05.", "memo key never stored"), (b"\x80\x02}K\x01s.", "stack underflow"),
                            (b"\x80\x02(K\x01t(.", "STOP with a stack other than one value"),
                            (b"\x80\x02K\x01K\x02\x93.", "STACK_GLOBAL without two strings"),
                            (b"\x80\x02K\x01.", "top-level object is not a dict")]:
        bad = tmp_path / "bad.pth"
        with zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as z:
            for name, data in records.items():
                z.writestr(name, program if name == f"{top}/data.pkl" else data)
        result = convert(bad)
        assert result.returncode == 2 and needle in result.stderr, (program, result.stderr)


def test_initial_load_path_names_what_it_was_given(tmp_path):
    """checkpoint.initial_load_path pointed at something that is not a titan checkpoint says what it is and which
    key or command reads it (it used to call every such path "a save that did not finish")."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    pt = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, pt)
    dcp_dir = tmp_path / "torchtitan_step"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(dcp_dir))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(hf / "model.safetensors"))
    folder = tmp_path / "checkpoints"
    (folder / "step-3").mkdir(parents=True)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "rank-00000.bin").write_bytes(b"x")
    for path, needle in [(pt, "is a torch.save file (a state dict), not a titan checkpoint folder; `titan convert --from"),
                         (dcp_dir, "has tensor \"w\", which this run's model does not have"),
                         (hf, "is a Hugging Face model folder; set checkpoint.initial_load_in_hf = true"),
                         (folder, "is a folder of checkpoints; name one of its step-N folders"),
                         (partial, "is incomplete: it has no metadata.json (a save that did not finish)"),
                         (tmp_path / "missing", "does not exist")]:
        result = run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                      "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "1", "--checkpoint.enable",
                      "--checkpoint.initial_load_path", str(path)], check=False)
        assert result.returncode == 2 and needle in result.stderr, (path, result.stderr[-2000:])


def test_destinations_with_a_trailing_slash_or_without_a_folder(trained, tmp_path, monkeypatch):
    """`--to out/` (as docs/checkpoint.md writes it) and a bare relative name are folders like any other."""
    monkeypatch.chdir(tmp_path)
    for to, fmt, marker in [("slash/", "titan", "metadata.json"), ("dcp_slash/", "dcp", ".metadata"), ("bare", "titan", "metadata.json")]:
        run([binary("titan"), "convert", "--from", str(trained) + "/", "--to", to, "--format", fmt])
        assert (tmp_path / to / marker).exists(), (to, sorted(p.name for p in tmp_path.iterdir()))
    assert not list(tmp_path.glob("*.partial"))


def test_hf_tensors_the_model_does_not_have_are_named(trained, tmp_path):
    """A layer past num_hidden_layers in the files is not read, and the conversion says so (it was silent)."""
    hf = tmp_path / "hf"
    run([binary("titan"), "convert", "--from", str(trained), "--to", str(hf)])
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.layers.99.mlp.up_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    result = run([binary("titan"), "convert", "--from", str(hf), "--to", str(tmp_path / "back"), "--flavor", "debugmodel"])
    assert '1 tensor(s) this model does not have are not read, from "model.layers.99.mlp.up_proj.weight"' in \
        result.stdout + result.stderr, result.stderr
