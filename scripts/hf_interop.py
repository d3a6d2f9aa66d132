"""transformers loads what `ckpt merge --format hf` writes from Megatron checkpoints that
megatron-core wrote, and computes Megatron's logits.

    python scripts/hf_interop.py [path/to/ckpt]     # default: target/debug/ckpt

For each family under tests/fixtures/hf (llama, qwen2, qwen3, gpt; written by
scripts/fixtures/hf_megatron.py with megatron-core's GPTModel on TP=2 x PP=2 gloo ranks)
and each layout (legacy, dist_ckpt):
- `ckpt merge <layout> --format hf -o OUT`, then
  `AutoModelForCausalLM.from_pretrained(OUT, output_loading_info=True)`: no missing,
  unexpected or mismatched keys; its logits on the fixture's input_ids equal Megatron's
  own forward (reference.safetensors) within 1e-4 (max abs difference, fp32);
- the same with `--dtype bf16`: the model loads in bfloat16 and its logits agree with
  Megatron's fp32 logits within bf16's rounding (max abs difference at most
  0.05 + 0.02 x the largest logit), and `config.json` says bfloat16.
Needs torch, transformers and safetensors (scripts/test.sh installs them into its venv).
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
FP32_TOL = 1e-4


def export(ckpt, src, out, *extra):
    r = subprocess.run([ckpt, "merge", src, "--format", "hf", "-o", out, "--quiet", *extra],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ckpt merge {src} --format hf {' '.join(extra)} failed ({r.returncode}):\n{r.stderr}")


def load(out, dtype):
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=dtype)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"{out}: {bad}"
    return model.eval()


def main():
    ckpt = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "ckpt"))
    families = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
    assert families, FIXTURES
    checked = 0
    with tempfile.TemporaryDirectory() as work:
        for family in families:
            ref = load_file(os.path.join(FIXTURES, family, "reference.safetensors"))
            ids, want = ref["input_ids"], ref["logits"]
            for layout in ("legacy", "dist_ckpt"):
                src = os.path.join(FIXTURES, family, layout)
                out = os.path.join(work, f"{family}-{layout}")
                export(ckpt, src, out)
                model = load(out, torch.float32)
                with torch.no_grad():
                    got = model(ids).logits
                diff = (got - want).abs().max().item()
                assert got.shape == want.shape, (got.shape, want.shape)
                assert diff <= FP32_TOL, f"{family} {layout}: logits differ by {diff}"
                print(f"{family} {layout}: {type(model).__name__} loads ckpt's export, logits max |diff| {diff:.2e} <= {FP32_TOL}")
                checked += 1

                out16 = out + "-bf16"
                export(ckpt, src, out16, "--dtype", "bf16")
                with open(os.path.join(out16, "config.json")) as f:
                    assert json.load(f)["dtype"] == "bfloat16"
                model = load(out16, "auto")
                assert next(model.parameters()).dtype == torch.bfloat16
                with torch.no_grad():
                    got = model(ids).logits.float()
                diff = (got - want).abs().max().item()
                tol = 0.05 + 0.02 * want.abs().max().item()
                assert diff <= tol, f"{family} {layout} bf16: logits differ by {diff} > {tol}"
                print(f"{family} {layout} bf16: logits max |diff| {diff:.3f} <= {tol:.3f}")
    print(f"hf_interop: {checked} exports loaded by transformers with Megatron's logits")


if __name__ == "__main__":
    main()
