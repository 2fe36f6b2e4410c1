"""Parameter counts and FLOPs per token against torchtitan's own model code (built on the meta device, so even
405B allocates nothing)."""
import json

import pytest
import torch

from titan_testing import binary, run


@pytest.mark.parametrize("flavor,seq_len", [("debugmodel", 2048), ("8B", 8192), ("70B", 8192), ("405B", 8192)])
def test_counts_match_torchtitan(flavor, seq_len):
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = llama3_args[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    nparams, flops = args.get_nparams_and_flops(model, seq_len)
    out = json.loads(run([binary("titan"), "estimate", "--json", "--model.flavor", flavor,
                          "--training.seq_len", str(seq_len)]).stdout)
    assert out["parameters"] == nparams
    assert out["flops_per_token"] == flops
