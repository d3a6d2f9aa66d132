#!/usr/bin/env python3
"""transformers loads the Hugging Face MoE models ckpt exported from megatron-core's MoE
checkpoints (`ckpt merge SRC --format hf`) and gives Megatron's logits.

  moe_hf_check.py CKPT      (for each family of tests/fixtures/moe/hf: Mixtral,
                             Qwen2-MoE, Qwen3-MoE; from the legacy and the dist_ckpt
                             files, and Mixtral's GroupedMLP legacy files)

For each: `from_pretrained` with no missing, unexpected or mismatched keys; the logits on
the fixture's input within 1e-4 of the logits megatron-core computed on its EP-sharded
model (fp32); every tensor equal to what transformers' own `save_pretrained` wrote of the
same model (the fixture's `hf/`)."""
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "moe" / "hf"
TOLERANCE = 1e-4


def main():
    ckpt = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        for family in ["mixtral", "qwen2_moe", "qwen3_moe"]:
            fx = FIXTURES / family
            ref = load_file(fx / "logits.safetensors")
            want = load_file(fx / "hf" / "model.safetensors")
            # Mixtral's also as megatron-core's GroupedMLP (legacy_grouped/).
            for src in ["legacy", "dist_ckpt"] + (["legacy_grouped"] if family == "mixtral" else []):
                out = pathlib.Path(tmp) / f"{family}-{src}"
                subprocess.run([ckpt, "merge", str(fx / src), "--format", "hf", "-o", str(out), "-q"], check=True)
                model, info = AutoModelForCausalLM.from_pretrained(
                    out, dtype=torch.float32, output_loading_info=True
                )
                for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
                    assert not info[k], f"{family} ({src}): {k} {info[k]}"
                model.eval()
                with torch.no_grad():
                    got = model(ref["input_ids"]).logits.float()
                err = (got - ref["logits"]).abs().max().item()
                assert err < TOLERANCE, f"{family} ({src}): logits differ from Megatron's by {err}"
                got_t = load_file(out / "model.safetensors")
                assert sorted(got_t) == sorted(want), f"{family} ({src}): tensor names"
                for k in want:
                    assert torch.equal(got_t[k], want[k]), f"{family} ({src}): {k}"
                print(f"{family} from {src}: {type(model).__name__}, logits within {err:.1e} of Megatron's, {len(want)} tensors as transformers saves them")


if __name__ == "__main__":
    main()
