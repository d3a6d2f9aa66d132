#!/usr/bin/env python3
"""Check a GGUF file ckpt wrote against the Hugging Face model it came from.

  gguf_check.py FILE.gguf HF_MODEL_DIR [--tokens 1,5,9,...] [--llama-cpp DIR]

1. gguf-py (`gguf`) reads the file, and every tensor equals the model's tensor under
   llama.cpp's rules (tests/fixtures/serving/README.md, "GGUF semantics"): the name by
   the table (Qwen2's attention biases and Qwen3's query/key norms too; Qwen2-MoE's and
   Qwen3-MoE's router and shared expert, Mixtral's router, and each layer's per-expert
   tensors stacked over the experts, `[experts, rows, cols]`: Mixtral's w1/w2/w3 as
   ffn_gate/down/up_exps), no tensor of the file left over, the query/key
   rows permuted per head for Llama and Mixtral (`LlamaModel.permute`; not for Qwen), norms and
   1-D tensors F32, the others in the file's type: F32/F16/BF16 values equal to the
   source's cast (round to nearest even), Q8_0 bytes equal to gguf-py's own
   `quants.quantize(x, Q8_0)` of the F32 values.
2. With --llama-cpp DIR (the directory holding llama.cpp's convert_hf_to_gguf.py,
   conversion/ and gguf-py/, e.g. llama-cpp-python's sdist's vendor/llama.cpp), the
   converter is run on HF_MODEL_DIR with the file's type, and its file must have the
   same tensors (names, order, shapes, types) and the same metadata keys, in order,
   with the same values. Its `get_vocab_base_pre` is wrapped: a tokenizer whose hash
   the converter does not know (NotImplementedError) is registered under the
   `tokenizer.ggml.pre` ckpt wrote; a known one keeps the converter's name.
3. If `llama_cpp` (llama-cpp-python) is importable, it loads the file; for a model with
   a tokenizer.json, its tokenization of a fixed text (llama.cpp's own pre-tokenizer
   test text and a short English one) must equal transformers' `AutoTokenizer`
   (no special tokens added); and its logits on a fixed token sequence are compared
   with transformers' (the model in F32 on CPU): max |difference| <= TOL * max(1, max
   |logit|), TOL = 1e-4 for F32 files, 1e-2 for F16, 5e-2 for BF16 and Q8_0,
   with an F32 key/value cache (type_k = type_v = GGML_TYPE_F32). Otherwise that part prints SKIPPED.

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
    # Qwen2's attention biases, Qwen3's query/key norms
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    # Qwen2-MoE's and Qwen3-MoE's router, Qwen2-MoE's shared expert and its gate
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # Mixtral's router
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
# A layer's per-expert tensors, stacked over the experts in order (`torch.stack`, as
# llama.cpp's Qwen2MoeModel does): model.layers.L.mlp.experts.E.<proj>.weight.
EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}
# Mixtral's: model.layers.L.block_sparse_moe.experts.E.w{1,2,3}.weight (LlamaModel's stacks)
MIXTRAL_EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
# llama.cpp's get_vocab_base_pre text (conversion/base.py)
CHKTXT = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'
TEXTS = [CHKTXT, "Hello, world! The quick brown fox jumps over the lazy dog; don't stop: 12345."]
WRAPPER = """
import sys, runpy
from hashlib import sha256
sys.path.insert(0, {llama!r})
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        return {pre!r}  # this tokenizer's hash, registered as ckpt named it
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def compare_with_converter(reader, path: Path, model: Path, llama_cpp: Path, file_type: str) -> int:
    """Runs llama.cpp's converter on the model; 0 when its file matches ckpt's."""
    import subprocess
    import tempfile

    import gguf

    pre = reader.fields.get("tokenizer.ggml.pre")
    pre = pre.contents() if pre is not None else "default"
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / "convert.py"
        script = (llama_cpp / "convert_hf_to_gguf.py").resolve()
        wrapper.write_text(WRAPPER.format(llama=str(llama_cpp.resolve()), pre=pre, script=str(script)))
        out = Path(tmp) / "converter.gguf"
        # the converter names the model after the directory it is given
        cmd = [sys.executable, str(wrapper), model.resolve().name, "--outtype", file_type.lower(), "--outfile", str(out)]
        r = subprocess.run(cmd, cwd=model.resolve().parent, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"llama.cpp converter: FAILED ({r.stderr.strip().splitlines()[-1:]})")
            return 1
        conv = gguf.GGUFReader(out)
        bad = 0
        ours = [(t.name, t.shape.tolist(), t.tensor_type.name) for t in reader.tensors]
        theirs = [(t.name, t.shape.tolist(), t.tensor_type.name) for t in conv.tensors]
        if ours != theirs:
            print(f"llama.cpp converter: tensors differ: {sorted(set(ours) ^ set(theirs))[:6]}")
            bad += 1
        keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        conv_keys = [k for k in conv.fields if not k.startswith("GGUF.")]
        if keys != conv_keys:
            print(f"llama.cpp converter: keys differ: ckpt {keys} vs converter {conv_keys}")
            bad += 1
        for k in keys:
            if k in conv.fields and reader.fields[k].contents() != conv.fields[k].contents():
                print(f"llama.cpp converter: {k} differs")
                bad += 1
        same = path.read_bytes() == out.read_bytes()
        print(f"llama.cpp converter ({file_type}): {len(theirs)} tensors, {len(conv_keys)} keys; "
              f"{'same' if bad == 0 else 'DIFFERENT'} names, shapes, types, keys and values"
              f"{' (and the same bytes)' if same else ''}")
        return bad
TOL = {"F32": 1e-4, "F16": 1e-2, "BF16": 5e-2, "Q8_0": 5e-2}


def gguf_name(hf: str) -> str | None:
    if hf in TABLE:
        return TABLE[hf]
    parts = hf.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        rest = ".".join(parts[3:])
        if rest in TABLE:
            return f"blk.{parts[2]}.{TABLE[rest]}"
        if len(parts) == 7 and parts[3:5] == ["mlp", "experts"] and parts[5] in EXPERTS:
            return f"blk.{parts[2]}.{EXPERTS[parts[5]]}"
        if len(parts) == 7 and parts[3:5] == ["block_sparse_moe", "experts"] and parts[5] in MIXTRAL_EXPERTS:
            return f"blk.{parts[2]}.{MIXTRAL_EXPERTS[parts[5]]}"
    return None


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_hf(model: Path) -> dict[str, np.ndarray]:
    """The model's tensors in F32; each layer's per-expert tensors stacked into one
    `[experts, rows, cols]` array under `model.layers.L.mlp.experts.<proj>.weight`
    (Mixtral's under `model.layers.L.block_sparse_moe.experts.w<i>.weight`)."""
    import re

    import torch
    from safetensors.torch import load_file

    out, experts = {}, {}
    for f in sorted(model.glob("*.safetensors")):
        for k, v in load_file(f).items():
            m = re.fullmatch(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+_proj|w[123])\.weight", k)
            if m:
                experts.setdefault((int(m[1]), m[2], m[4]), {})[int(m[3])] = v.to(torch.float32).numpy()
            else:
                out[k] = v.to(torch.float32).numpy()
    for (layer, module, proj), by_id in sorted(experts.items()):
        assert sorted(by_id) == list(range(len(by_id))), f"layer {layer} {proj}: experts {sorted(by_id)}"
        out[f"model.layers.{layer}.{module}.experts.{proj}.weight"] = np.stack([by_id[e] for e in range(len(by_id))])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", default="1,5,9,17,33,64,100,3,7,2,11,42")
    ap.add_argument("--llama-cpp", type=Path, help="directory holding convert_hf_to_gguf.py, conversion/, gguf-py/")
    a = ap.parse_args()

    import gguf
    from gguf import GGMLQuantizationType as Q

    config = json.loads((a.model / "config.json").read_text())
    heads = config["num_attention_heads"]
    qwen = config.get("model_type") in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    kv_heads = config.get("num_key_value_heads", heads)
    reader = gguf.GGUFReader(a.gguf)
    tensors = {t.name: t for t in reader.tensors}
    bad = 0
    file_type = "F32"
    hf_tensors = load_hf(a.model)
    for name, x in hf_tensors.items():
        g = gguf_name(name)
        if g is None:
            continue
        if g not in tensors:
            print(f"MISSING {g} ({name})")
            bad += 1
            continue
        t = tensors[g]
        if qwen:
            pass  # llama.cpp rotates Qwen's halves as Hugging Face stores them
        elif name.endswith("q_proj.weight"):
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
    mapped = {gguf_name(n) for n in hf_tensors} - {None}
    for g in sorted(set(tensors) - mapped):
        if not (g == "output.weight" and config.get("tie_word_embeddings")):
            print(f"EXTRA {g} (no tensor of the model maps to it)")
            bad += 1
    print(f"gguf-py: {len(tensors)} tensors read, {bad} differ from the model under llama.cpp's rules")
    if a.llama_cpp:
        bad += compare_with_converter(reader, a.gguf, a.model, a.llama_cpp, file_type)

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python logits: SKIPPED (llama_cpp is not importable)")
        return 1 if bad else 0
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    tokens = [int(t) for t in a.tokens.split(",")]
    # An F32 key/value cache (llama.cpp's default is F16, which alone moves F32 logits by
    # ~1e-3 of their size): the difference left is the weights' and the arithmetic's.
    llm = Llama(model_path=str(a.gguf), n_ctx=max(64, len(tokens)), logits_all=True, verbose=False, n_threads=1,
                type_k=0, type_v=0)
    if (a.model / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(a.model)
        for text in TEXTS:
            want_ids = hf_tok.encode(text, add_special_tokens=False)
            got_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            same = list(got_ids) == list(want_ids)
            bad += 0 if same else 1
            print(f"llama-cpp-python tokens of a {len(text)}-character text: {len(got_ids)} ids, "
                  f"{'the same as' if same else 'DIFFERENT from'} transformers' {len(want_ids)}")
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
