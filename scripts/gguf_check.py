#!/usr/bin/env python3
"""Check a GGUF file ckpt wrote against the Hugging Face model it came from.

  gguf_check.py FILE.gguf HF_MODEL_DIR [--tokens 1,5,9,...]

1. gguf-py (`gguf`) reads the file, and every tensor equals the model's tensor under
   llama.cpp's rules (tests/fixtures/serving/README.md, "GGUF semantics"): the name by
   the table, the query/key rows permuted per head (`LlamaModel.permute`), norms and
   1-D tensors F32, the others in the file's type: F32/F16/BF16 values equal to the
   source's cast (round to nearest even), Q8_0 bytes equal to gguf-py's own
   `quants.quantize(x, Q8_0)` of the F32 values.
2. If `llama_cpp` (llama-cpp-python) is importable, it loads the file and its logits on
   a fixed token sequence are compared with transformers' (the model in F32 on CPU):
   max |difference| <= TOL * max(1, max |logit|), TOL = 1e-3 for F32 files, 1e-2 for
   F16, 5e-2 for BF16 and Q8_0. Otherwise that part prints SKIPPED.

Exit status 0 when everything checked agrees, 1 otherwise. Needs numpy, gguf, torch
and safetensors (transformers for the logits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TABLE = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOL = {"F32": 1e-3, "F16": 1e-2, "BF16": 5e-2, "Q8_0": 5e-2}


def gguf_name(hf: str) -> str | None:
    if hf in TABLE:
        return TABLE[hf]
    parts = hf.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        rest = ".".join(parts[3:])
        if rest in TABLE:
            return f"blk.{parts[2]}.{TABLE[rest]}"
    return None


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_hf(model: Path) -> dict[str, np.ndarray]:
    import torch
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model.glob("*.safetensors")):
        for k, v in load_file(f).items():
            out[k] = v.to(torch.float32).numpy()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", default="1,5,9,17,33,64,100,3,7,2,11,42")
    a = ap.parse_args()

    import gguf
    from gguf import GGMLQuantizationType as Q

    config = json.loads((a.model / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    reader = gguf.GGUFReader(a.gguf)
    tensors = {t.name: t for t in reader.tensors}
    bad = 0
    file_type = "F32"
    for name, x in load_hf(a.model).items():
        g = gguf_name(name)
        if g is None:
            continue
        if g not in tensors:
            print(f"MISSING {g} ({name})")
            bad += 1
            continue
        t = tensors[g]
        if name.endswith("q_proj.weight"):
            x = permute(x, heads)
        elif name.endswith("k_proj.weight"):
            x = permute(x, kv_heads)
        ty = Q(t.tensor_type)
        if x.ndim >= 2 and ty != Q.F32:
            file_type = ty.name
        if ty == Q.Q8_0:
            want = gguf.quants.quantize(x, Q.Q8_0).tobytes()
        elif ty == Q.BF16:
            want = gguf.quants.quantize(x, Q.BF16).tobytes()
        elif ty == Q.F16:
            want = x.astype(np.float16).tobytes()
        else:
            want = x.astype(np.float32).tobytes()
        got = np.asarray(t.data).tobytes()
        if got != want or list(reversed(t.shape.tolist())) != list(x.shape):
            print(f"DIFFERS {g} ({ty.name}, shape {t.shape.tolist()} vs {list(x.shape)})")
            bad += 1
    print(f"gguf-py: {len(tensors)} tensors read, {bad} differ from the model under llama.cpp's rules")

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python logits: SKIPPED (llama_cpp is not importable)")
        return 1 if bad else 0
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    tokens = [int(t) for t in a.tokens.split(",")]
    llm = Llama(model_path=str(a.gguf), n_ctx=max(64, len(tokens)), logits_all=True, verbose=False, n_threads=1)
    llm.eval(tokens)
    got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    diff = float(np.abs(got - want).max())
    tol = TOL.get(file_type, 5e-2) * max(1.0, float(np.abs(want).max()))
    ok = diff <= tol
    print(f"llama-cpp-python logits ({file_type}): max |diff| {diff:.3g} vs transformers, tolerance {tol:.3g}: {'OK' if ok else 'FAIL'}")
    return 0 if ok and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
