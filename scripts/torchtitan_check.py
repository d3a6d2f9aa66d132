"""torchtitan's own Llama3Model loads what `ckpt reshard HF --format torchtitan` wrote.

    python scripts/torchtitan_check.py [path/to/ckpt]     # default: target/debug/ckpt

Needs torchtitan (0.3) beside torch, transformers and safetensors; not run by
scripts/test.sh, whose venv has no torchtitan (tests/hf.rs checks the same output
against torchtitan's own save without Python). From the fixture
tests/fixtures/torchtitan/llama: the Hugging Face model torchtitan's adapter made
(`adapter_to_hf.safetensors` + `config.json`) -> `--format torchtitan --to 1`, then
`dcp.load` into the model's state dict (every value first NaN),
`load_state_dict(strict=True)` and torchtitan's forward: its logits must equal the
fixture's reference (torchtitan's forward of the original model) within 1e-4.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "fixtures"))
import torchtitan_llama as T  # noqa: E402


def main():
    ckpt = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "ckpt"))
    fx = os.path.join(ROOT, "tests", "fixtures", "torchtitan", "llama")
    with tempfile.TemporaryDirectory() as work:
        hf = os.path.join(work, "hf")
        os.makedirs(hf)
        shutil.copy(os.path.join(fx, "config.json"), hf)
        shutil.copy(os.path.join(fx, "adapter_to_hf.safetensors"), os.path.join(hf, "model.safetensors"))
        out = os.path.join(work, "titan")
        subprocess.run([ckpt, "reshard", hf, "--format", "torchtitan", "--to", "1", "-o", out, "--quiet"], check=True)
        model = T.model_config().build()
        sd = {k: torch.full_like(v, float("nan")) for k, v in model.state_dict().items()}
        dcp.load(sd, checkpoint_id=out)
        model.load_state_dict(sd, strict=True)
        ref = load_file(os.path.join(fx, "reference.safetensors"))
        pos = torch.arange(ref["input_ids"].shape[1]).unsqueeze(0).expand_as(ref["input_ids"]).contiguous()
        with torch.no_grad():
            got = model.eval()(ref["input_ids"], pos, model.get_attention_masks(pos)).float()
        diff = (got - ref["logits"]).abs().max().item()
        assert diff <= 1e-4, f"torchtitan's logits of the import differ by {diff}"
        print(f"torchtitan loads ckpt's --format torchtitan output strictly; logits max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
