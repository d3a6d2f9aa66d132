"""transformers loads ckpt's FP8 output (issue 47, docs/serving.md).

`ckpt merge BASE --quantize fp8` of the tiny Llama in tests/fixtures/serving/base,
loaded with transformers' `from_pretrained` (on CPU it dequantizes the FP8 weights to
BF16 itself, as it says), must give:
  - every weight equal, bit for bit, to ckpt's own dequantization of the same file
    (`ckpt merge FP8 --dtype bf16`), and the same logits;
  - logits within FP8's rounding of the BF16 model's: E4M3 keeps 3 mantissa bits (a
    relative error of at most 2^-4 per weight), so the logits on a fixed batch may move
    by at most 10 % of the largest logit (measured: 0.017 of 0.57).

    python scripts/fp8_transformers_check.py target/debug/ckpt
Needs torch, transformers (with FP8 support: 5.x) and accelerate (transformers loads FP8
models through it); prints SKIPPED without them (CI installs them).
"""

import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = REPO / "tests" / "fixtures" / "serving" / "base"


def main() -> int:
    ckpt = sys.argv[1] if len(sys.argv) > 1 else str(REPO / "target" / "debug" / "ckpt")
    try:
        import accelerate  # noqa: F401  (transformers loads FP8 models through it)
        import torch
        import transformers
    except ImportError as e:
        print(f"fp8_transformers_check: SKIPPED ({e})")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fp8, bf16 = pathlib.Path(tmp) / "fp8", pathlib.Path(tmp) / "bf16"
        subprocess.run([ckpt, "merge", str(BASE), "--quantize", "fp8", "-o", str(fp8), "-q"], check=True)
        subprocess.run([ckpt, "merge", str(fp8), "--dtype", "bf16", "-o", str(bf16), "-q"], check=True)
        load = transformers.AutoModelForCausalLM.from_pretrained
        base = load(BASE, dtype=torch.bfloat16)
        ours = load(bf16, dtype=torch.bfloat16)
        theirs = load(fp8, dtype=torch.bfloat16)
        ids = torch.tensor([[1, 5, 9, 17, 33, 64, 100, 127]])
        with torch.no_grad():
            logits = {k: m(ids).logits.float() for k, m in [("base", base), ("ours", ours), ("theirs", theirs)]}
        a, b = ours.state_dict(), theirs.state_dict()
        if sorted(a) != sorted(b):
            print(f"fp8_transformers_check: FAILED: parameters differ: {sorted(set(a) ^ set(b))}")
            return 1
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        if differ:
            print(f"fp8_transformers_check: FAILED: transformers' dequantization differs from ckpt's in {differ}")
            return 1
        if not torch.equal(logits["ours"], logits["theirs"]):
            print("fp8_transformers_check: FAILED: logits differ between ckpt's and transformers' dequantization")
            return 1
        moved = (logits["theirs"] - logits["base"]).abs().max().item()
        top = logits["base"].abs().max().item()
        if moved > 0.1 * top:
            print(f"fp8_transformers_check: FAILED: FP8 logits moved by {moved} (largest logit {top})")
            return 1
        print(
            f"fp8_transformers_check: ok: transformers {transformers.__version__} loads ckpt's FP8 model, "
            f"{len(a)} parameters equal to ckpt's dequantization bit for bit, logits within {moved:.4f} "
            f"of the BF16 model's (largest {top:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
