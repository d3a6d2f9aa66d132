#!/usr/bin/env python3
"""transformers loads the Hugging Face models ckpt exports from the trainers' own save
directories (tests/fixtures/trainers: HF Trainer + accelerate FSDP (a Llama and a
Mixtral), HF Trainer plain, Lightning FSDP and DeepSpeed, verl FSDP, torchtitan, written
by each trainer's own code on CPU;
Megatron-Bridge, NeMo 2 and verl's Megatron backend (both layouts), laid out from their source and written by megatron-core,
against Megatron's own logits) and gives the logits the trainer's model gave.

  trainers_check.py CKPT

For each: `ckpt merge OUTPUT_DIR --format hf -o OUT` (the output directory as the
trainer leaves it; `--hf-config` only where the trainer keeps no model config), then
`from_pretrained(OUT)` with no missing, unexpected or mismatched keys and the logits on
the fixture's input within 1e-4 of `reference.safetensors` (fp32); the same with
`--dtype bf16`: every tensor torch's own cast of the fp32 export to bfloat16, and the
model loads. Also the megatron-core dist_ckpts saved
without Megatron-LM's args (tests/fixtures/hf/*/dist_ckpt_noargs) with the model's
config, against Megatron's own logits."""
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
LLAMA_CONFIG = FIXTURES / "hf_models" / "llama" / "config.json"
MIXTRAL_CONFIG = FIXTURES / "moe" / "hf" / "mixtral" / "hf" / "config.json"
QWEN3_MOE_CONFIG = FIXTURES / "moe" / "hf" / "qwen3_moe" / "hf" / "config.json"
TOLERANCE = 1e-4

# (fixture, the trainer's output directory, the config where the trainer keeps none)
CASES = [
    ("hf_trainer_fsdp", "trainer_out", LLAMA_CONFIG),
    ("hf_trainer_fsdp_moe", "trainer_out", MIXTRAL_CONFIG),  # transformers' fused experts in the DCP
    ("hf_trainer_fsdp_qwen3_moe", "trainer_out", QWEN3_MOE_CONFIG),
    ("hf_trainer_plain", "trainer_out", None),
    ("lightning_fsdp", "lightning_out", LLAMA_CONFIG),
    ("lightning_deepspeed", "lightning_out", LLAMA_CONFIG),  # DeepSpeed's ZeRO-2 save in the step
    ("verl_fsdp", "verl_out", None),
    ("torchtitan", "outputs", FIXTURES / "trainers" / "torchtitan" / "config.json"),
    # Layouts from the trainers' source, files by megatron-core; reference: Megatron's logits.
    ("megatron_bridge", "nemo_experiments", None),  # its run_config.yaml gives the sizes
    ("verl_megatron", "verl_out", None),  # verl 0.4.1-0.8: actor/dist_ckpt + actor/huggingface
    # verl 0.9 (actor/model/dist_ckpt) keeps no HF config: the 0.4.1-0.8 save's, same model
    ("verl_megatron", "verl_v2_out",
     FIXTURES / "trainers" / "verl_megatron" / "verl_out" / "global_step_2" / "actor" / "huggingface" / "config.json"),
    ("nemo2", "nemo_experiments", FIXTURES / "trainers" / "nemo2" / "hf_config.json"),
]


def export(ckpt, src, out, config, *extra):
    cmd = [ckpt, "merge", str(src), "--format", "hf", "-o", str(out), "-q", *extra]
    if config is not None:
        cmd += ["--hf-config", str(config)]
    subprocess.run(cmd, check=True)


def logits_error(out, ref, what):
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[k], f"{what}: {k} {info[k]}"
    model.eval()
    with torch.no_grad():
        got = model(ref["input_ids"]).logits.float()
    return (got - ref["logits"]).abs().max().item()


def main():
    ckpt = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        for name, out_dir, config in CASES:
            fx = FIXTURES / "trainers" / name
            ref = load_file(fx / "reference.safetensors")
            out = pathlib.Path(tmp) / f"{name}-{out_dir}"
            export(ckpt, fx / out_dir, out, config)
            err = logits_error(out, ref, name)
            assert err < TOLERANCE, f"{name}: logits differ from the trainer's by {err}"
            bf16 = pathlib.Path(tmp) / f"{name}-{out_dir}-bf16"
            export(ckpt, fx / out_dir, bf16, config, "--dtype", "bf16")
            full, half = load_file(out / "model.safetensors"), load_file(bf16 / "model.safetensors")
            assert sorted(full) == sorted(half), f"{name} (bf16): tensor names"
            for k, t in full.items():
                assert half[k].dtype == torch.bfloat16 and torch.equal(half[k], t.to(torch.bfloat16)), f"{name} (bf16): {k}"
            err16 = logits_error(bf16, ref, f"{name} (bf16)")
            print(f"{name} ({out_dir}): logits within {err:.1e} of the trainer's; the bf16 export is torch's cast (logits within {err16:.1e})")
        for family in ["llama", "qwen2"]:
            fx = FIXTURES / "hf" / family
            ref = load_file(fx / "reference.safetensors")
            # The model's config as ckpt writes it from the Megatron-LM save of the same model.
            with_args = pathlib.Path(tmp) / f"{family}-args"
            export(ckpt, fx / "dist_ckpt", with_args, None)
            out = pathlib.Path(tmp) / f"{family}-noargs"
            export(ckpt, fx / "dist_ckpt_noargs", out, with_args / "config.json")
            err = logits_error(out, ref, f"{family} (no args)")
            assert err < TOLERANCE, f"{family} (no args): logits differ from Megatron's by {err}"
            print(f"{family} dist_ckpt without args: logits within {err:.1e} of Megatron's")


if __name__ == "__main__":
    main()
