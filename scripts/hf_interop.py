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
- import, the way back: `ckpt reshard OUT --format megatron --mesh tp=2,pp=2` of that
  Hugging Face model writes, rank by rank, the state dicts megatron-core's own model
  wrote into the fixture (same keys in every `mp_rank_TT_PPP` file, every tensor equal;
  the vocabulary rows unpadded: the TP ranks' rows joined equal the fixture's first
  vocab_size rows), as a `release` checkpoint; and `ckpt merge --format hf` of that
  gives back the Hugging Face model's safetensors file byte for byte;
- import as a dist_ckpt (`--format megatron-dist`, TP2 x PP2 and TP1 x PP1):
  megatron-core's GPTModel on that many gloo ranks loads it with
  `dist_checkpointing.load` and `load_state_dict(strict=True)`, its weights equal the
  legacy import's rank by rank, its forward (pipeline driven by hand) gives the
  reference logits within 1e-4, and `merge --format hf` of it gives back every tensor
  byte;
- the same with `--dtype bf16`: the model loads in bfloat16, `config.json` says so, every
  weight equals torch's own cast of the fp32 export's (`.to(torch.bfloat16)`, round to
  nearest even), and its logits agree with Megatron's fp32 logits within bf16's rounding
  (max abs difference at most 0.1 x the largest logit). (Its logits are not compared
  with the cast model's exactly: `.to()` also casts the rotary `inv_freq` buffer, which
  `from_pretrained(dtype=...)` computes in fp32.)
- import from transformers' own save_pretrained (tests/fixtures/hf_models: Llama,
  Mistral, Qwen2, Qwen3 in transformers 5's config form, written by
  scripts/fixtures/hf_transformers.py): `reshard --format megatron --mesh tp=1,pp=1`,
  then megatron-core's GPTModel built from the args ckpt wrote loads the rank file with
  `load_state_dict(strict=True)` (only `_extra_state` may be absent) and its own forward
  gives transformers' logits within 1e-4; `--mesh tp=2,pp=2` and back to Hugging Face
  gives back the model.safetensors byte for byte.
- DeepSpeed ZeRO-2 of transformers' LlamaForCausalLM (tests/fixtures/hf_deepspeed,
  written by DeepSpeed itself, scripts/fixtures/hf_deepspeed.py): `merge --format hf
  --hf-config` gives a model transformers loads with the trained model's logits
  (reference.safetensors: transformers' forward of DeepSpeed's own zero_to_fp32 state
  dict) within 1e-4.
- torchtitan's Llama (tests/fixtures/torchtitan/llama, a DCP save by torchtitan 0.3
  itself, scripts/fixtures/torchtitan_llama.py): `merge --format hf --hf-config` gives a
  model transformers loads with torchtitan's own logits within 1e-4.
Needs torch, transformers, safetensors and megatron-core (scripts/test.sh installs them
into its venv).
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
sys.path.append(os.path.join(ROOT, "scripts", "fixtures"))
from gloo_ranks import run_ranks  # noqa: E402
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


VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def check_import(ckpt, family, hf_dir, work):
    """HF -> Megatron TP2 x PP2 -> HF."""
    meg = os.path.join(work, f"{family}-megatron")
    r = subprocess.run([ckpt, "reshard", hf_dir, "--format", "megatron", "--mesh", "tp=2,pp=2", "-o", meg, "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(meg, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "release"
    fixture = os.path.join(FIXTURES, family, "legacy", "iter_0000001")
    ranks = sorted(os.listdir(fixture))
    assert sorted(os.listdir(os.path.join(meg, "release"))) == ranks
    ours, theirs = {}, {}
    for sub in ranks:
        x = torch.load(os.path.join(meg, "release", sub, "model_optim_rng.pt"), weights_only=False)
        y = torch.load(os.path.join(fixture, sub, "model_optim_rng.pt"), weights_only=False)
        assert x["args"].tensor_model_parallel_size == 2 and x["args"].pipeline_model_parallel_size == 2
        xm, ym = x["model"], {k: v for k, v in y["model"].items() if v is not None}
        assert sorted(xm) == sorted(ym), (sub, sorted(set(xm) ^ set(ym)))
        for k in xm:
            if k in VOCAB_TENSORS:
                ours.setdefault((k, sub[-3:]), []).append(xm[k])
                theirs.setdefault((k, sub[-3:]), []).append(ym[k])
            else:
                assert torch.equal(xm[k], ym[k]), (family, sub, k)
    vocab = load_file(os.path.join(FIXTURES, family, "reference.safetensors"))["logits"].shape[-1]
    for key in ours:
        a, b = torch.cat(ours[key]), torch.cat(theirs[key])
        assert a.shape[0] == vocab and torch.equal(a, b[:vocab]), key
    check_dist_import(ckpt, family, hf_dir, os.path.join(meg, "release"), work, 29700,
                      os.path.join(FIXTURES, family, "reference.safetensors"))
    back = os.path.join(work, f"{family}-back")
    export(ckpt, meg, back)
    with open(os.path.join(hf_dir, "model.safetensors"), "rb") as f1, open(os.path.join(back, "model.safetensors"), "rb") as f2:
        assert f1.read() == f2.read(), f"{family}: HF -> Megatron -> HF changed the bytes"
    print(f"{family}: HF -> Megatron TP2 x PP2 holds megatron-core's state dicts rank by rank; -> HF gives back every byte")


MODELS = os.path.join(ROOT, "tests", "fixtures", "hf_models")


def family_of_args(a):
    """The fixture generator's family features from Megatron-LM's args."""
    return dict(norm=a.normalization, swiglu=a.swiglu, rope=a.position_embedding_type == "rope",
                groups=a.num_query_groups, kv=a.kv_channels, qkv_bias=a.add_qkv_bias, bias=a.add_bias_linear,
                qk_norm=a.qk_layernorm, tied=not a.untie_embeddings_and_output_weights, base=a.rotary_base,
                eps=a.norm_epsilon)


def run_forward(model, ref_file, result):
    ref = load_file(ref_file)
    ids = ref["input_ids"]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model.eval()(ids, pos, mask)
    torch.save(logits, result)


def dist_load_worker(rank, world, tp, pp, port, dist_dir, legacy_dir, ref_file, result):
    """One of tp x pp gloo ranks: megatron-core's GPTModel of the args in the
    dist_ckpt's common.pt loads it with `dist_checkpointing.load` (every key it expects,
    the `_extra_state` objects included), then `load_state_dict(strict=True)`; its
    weights equal, key for key, the legacy import's rank file of the same TP x PP rank;
    on one rank, its forward's logits are saved to `result`."""
    import hf_megatron as H

    H.stub_cuda()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    a = torch.load(os.path.join(dist_dir, "common.pt"), weights_only=False)["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.ckpt_format) == (tp, pp, "torch_dist")
    model = H.build_model(family_of_args(a), tp, pp, a.padded_vocab_size)
    for p in model.parameters():
        torch.nn.init.constant_(p, float("nan"))
    # As Megatron-LM's load_checkpoint: the model under `model`, common.pt's entries beside.
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, dist_dir)
    assert loaded["checkpoint_version"] == 3.0 and loaded["args"].num_layers == a.num_layers
    model.load_state_dict(loaded["model"], strict=True)
    t, s = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    sub = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{s:03d}"
    want = torch.load(os.path.join(legacy_dir, sub, "model_optim_rng.pt"), weights_only=False)["model"]
    have = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(have) == sorted(want), (sub, sorted(set(have) ^ set(want)))
    for k, v in have.items():
        assert torch.equal(v, want[k]), (sub, k)
    if ref_file:
        logits = H.pipeline_forward(model, load_file(ref_file)["input_ids"], a.hidden_size)
        if logits is not None and t == 0:
            torch.save(logits, result)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def check_dist_import(ckpt, name, hf_dir, legacy_dir, work, port, ref_file):
    """HF -> megatron-dist on TP2 x PP2 and on one rank: megatron-core loads it, the
    weights are the legacy import's, its forward gives `ref_file`'s logits; -> HF gives
    back the model."""
    tag = name.replace(" ", "_").replace("(", "").replace(")", "")
    for tp, pp in ((2, 2), (1, 1)):
        out = os.path.join(work, f"{tag}-dist-tp{tp}pp{pp}")
        r = subprocess.run([ckpt, "reshard", hf_dir, "--format", "megatron-dist", "--mesh", f"tp={tp},pp={pp}",
                            "-o", out, "--quiet"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
            assert f.read() == "release"
        legacy = legacy_dir
        if (tp, pp) != (2, 2):
            legacy = os.path.join(work, f"{tag}-legacy-tp{tp}pp{pp}")
            r = subprocess.run([ckpt, "reshard", hf_dir, "--format", "megatron", "--mesh", f"tp={tp},pp={pp}",
                                "-o", legacy, "--quiet"], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            legacy = os.path.join(legacy, "release")
        result = os.path.join(work, f"{tag}-dist-logits-{tp}{pp}.pt")
        run_ranks(dist_load_worker, (tp * pp, tp, pp, port + tp * pp, os.path.join(out, "release"), legacy,
                                     ref_file, result), tp * pp)
        got, want = torch.load(result), load_file(ref_file)["logits"]
        diff = (got - want).abs().max().item()
        assert got.shape == want.shape and diff <= FP32_TOL, f"{name} TP{tp} x PP{pp}: logits differ by {diff}"
        back = os.path.join(work, f"{tag}-dist-back-{tp}{pp}")
        export(ckpt, out, back)
        same_tensors(os.path.join(hf_dir, "model.safetensors"), os.path.join(back, "model.safetensors"), name)
        print(f"{name}: HF -> megatron-dist TP{tp} x PP{pp}: megatron-core's dist_checkpointing.load takes it "
              f"strictly, weights equal the legacy import's rank by rank, its forward's logits the reference's "
              f"(max |diff| {diff:.2e}); -> HF gives back every tensor byte")


def megatron_forward(rank, rank_file, ref_file, result):
    """One gloo rank: megatron-core's GPTModel from the args in `rank_file`, loaded
    strictly, run on the reference input."""
    import hf_megatron as H

    H.stub_cuda()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29631"
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    sd = torch.load(rank_file, weights_only=False)
    a = sd["args"]
    f = family_of_args(a)
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.ffn_hidden_size) == (H.LAYERS, H.HIDDEN, H.HEADS, H.FFN)
    model = H.build_model(f, 1, 1, a.padded_vocab_size)
    missing, unexpected = model.load_state_dict(sd["model"], strict=False)
    assert all(k.endswith("._extra_state") for k in missing), missing
    assert not unexpected, unexpected
    run_forward(model, ref_file, result)
    torch.distributed.destroy_process_group()


def check_transformers_import(ckpt, work):
    for name in sorted(d for d in os.listdir(MODELS) if os.path.isdir(os.path.join(MODELS, d))):
        src = os.path.join(MODELS, name)
        ref = os.path.join(src, "reference.safetensors")
        # (reference.safetensors sits beside the model: import the model file only.)
        model_dir = os.path.join(work, f"{name}-hf")
        os.makedirs(model_dir)
        for f in ("config.json", "generation_config.json", "model.safetensors"):
            with open(os.path.join(src, f), "rb") as i, open(os.path.join(model_dir, f), "wb") as o:
                o.write(i.read())
        one = os.path.join(work, f"{name}-tp1")
        r = subprocess.run([ckpt, "reshard", model_dir, "--format", "megatron", "--mesh", "tp=1,pp=1", "-o", one, "--quiet"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        result = os.path.join(work, f"{name}-logits.pt")
        run_ranks(megatron_forward, (os.path.join(one, "release", "mp_rank_00", "model_optim_rng.pt"), ref, result), 1)
        got = torch.load(result)
        want = load_file(ref)["logits"]
        diff = (got - want).abs().max().item()
        assert got.shape == want.shape and diff <= FP32_TOL, f"{name}: Megatron's logits of the import differ by {diff}"
        four = os.path.join(work, f"{name}-tp2pp2")
        r = subprocess.run([ckpt, "reshard", model_dir, "--format", "megatron", "--mesh", "tp=2,pp=2", "-o", four, "--quiet"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        check_dist_import(ckpt, f"{name} (save_pretrained)", model_dir, os.path.join(four, "release"),
                          work, 29720, ref)
        back = os.path.join(work, f"{name}-model-back")
        export(ckpt, four, back)
        same_tensors(os.path.join(model_dir, "model.safetensors"), os.path.join(back, "model.safetensors"), name)
        print(f"{name} (transformers' save_pretrained): megatron-core loads the import strictly, logits max |diff| {diff:.2e}; TP2 x PP2 and back: every tensor byte")


def same_tensors(a, b, what):
    """Two safetensors files hold the same tensors in the same order, byte for byte: the
    data areas are equal and the headers differ at most in `__metadata__` (ckpt records
    its checksums there; transformers' save_pretrained records `format` only)."""
    import struct

    def parts(p):
        with open(p, "rb") as f:
            raw = f.read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__", {})
        return header, meta, raw[8 + n:]

    ha, ma, da = parts(a)
    hb, mb, db = parts(b)
    assert list(ha.items()) == list(hb.items()), f"{what}: tensor entries differ"
    assert da == db, f"{what}: tensor data differs"
    assert ma.get("format") == mb.get("format"), (ma, mb)


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
                if layout == "legacy":
                    check_import(ckpt, family, out, work)

                out16 = out + "-bf16"
                export(ckpt, src, out16, "--dtype", "bf16")
                with open(os.path.join(out16, "config.json")) as f:
                    assert json.load(f)["dtype"] == "bfloat16"
                m16 = load(out16, "auto")
                assert next(m16.parameters()).dtype == torch.bfloat16
                cast = load(out, torch.float32).to(torch.bfloat16)
                for (k, a), (k2, b) in zip(sorted(m16.state_dict().items()), sorted(cast.state_dict().items())):
                    assert k == k2 and torch.equal(a, b), f"{family} {layout} bf16: {k} is not torch's cast"
                with torch.no_grad():
                    got = m16(ids).logits.float()
                diff = (got - want).abs().max().item()
                tol = 0.1 * want.abs().max().item()
                assert diff <= tol, f"{family} {layout} bf16: logits differ by {diff} > {tol}"
                print(f"{family} {layout} bf16: every weight torch's cast; logits max |diff| from Megatron's fp32 {diff:.3f} <= {tol:.3f}")
        check_transformers_import(ckpt, work)
        ds = os.path.join(ROOT, "tests", "fixtures", "hf_deepspeed")
        out = os.path.join(work, "deepspeed-hf")
        export(ckpt, os.path.join(ds, "ckpt"), out, "--hf-config", os.path.join(MODELS, "llama", "config.json"))
        ref = load_file(os.path.join(ds, "reference.safetensors"))
        with torch.no_grad():
            got = load(out, torch.float32)(ref["input_ids"]).logits
        diff = (got - ref["logits"]).abs().max().item()
        assert diff <= FP32_TOL, f"DeepSpeed export: logits differ by {diff}"
        print(f"DeepSpeed ZeRO-2 of LlamaForCausalLM -> HF: logits max |diff| {diff:.2e}")
        titan = os.path.join(ROOT, "tests", "fixtures", "torchtitan", "llama")
        out = os.path.join(work, "torchtitan-hf")
        export(ckpt, os.path.join(titan, "dcp"), out, "--hf-config", os.path.join(titan, "config.json"))
        ref = load_file(os.path.join(titan, "reference.safetensors"))
        with torch.no_grad():
            got = load(out, torch.float32)(ref["input_ids"]).logits
        diff = (got - ref["logits"]).abs().max().item()
        assert diff <= FP32_TOL, f"torchtitan export: logits differ by {diff}"
        print(f"torchtitan's Llama (DCP) -> HF: transformers gives torchtitan's own logits, max |diff| {diff:.2e}")
    print(f"hf_interop: {checked} exports loaded by transformers with Megatron's logits")


if __name__ == "__main__":
    main()
