"""`ckpt.merge(..., format="hf")` from Python: a Megatron checkpoint written by
megatron-core (tests/fixtures/hf, scripts/fixtures/hf_megatron.py) as a Hugging Face
model; the Megatron side of the names and the QKV split are checked against ckpt's plain
merge of the same checkpoint, the transformers side in scripts/hf_interop.py."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import ckpt


def test_merge_format_hf_from_python(tmp_path, fixtures):
    src = fixtures / "hf" / "qwen2" / "dist_ckpt"
    r = ckpt.merge(src, tmp_path / "hf", format="hf", dtype=None)
    assert r.tensors == 4 * 12 + 3
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_key_value_heads"] == 2
    got = load_file(tmp_path / "hf" / "model.safetensors")
    ckpt.merge(fixtures / "hf" / "qwen2" / "legacy", tmp_path / "plain")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    qkv = plain["decoder.layers.1.self_attention.linear_qkv.bias"]
    # Two groups of (2 query heads + key + value) x 8 channels.
    q = np.concatenate([qkv[0:16], qkv[32:48]])
    np.testing.assert_array_equal(got["model.layers.1.self_attn.q_proj.bias"], q)
    np.testing.assert_array_equal(got["model.layers.1.self_attn.v_proj.bias"], np.concatenate([qkv[24:32], qkv[56:64]]))
    assert got["model.embed_tokens.weight"].shape == (50, 32)


def test_hf_options_need_format_hf(tmp_path, fixtures):
    with pytest.raises(ValueError, match="go with format"):
        ckpt.merge(fixtures / "hf" / "llama" / "legacy", tmp_path / "x", hf_arch="llama")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ckpt.CheckpointError, match="LlamaForCausalLM does not"):
        ckpt.merge(fixtures / "hf" / "gpt" / "legacy", tmp_path / "y", format="hf", hf_arch="llama")
    assert not (tmp_path / "y").exists()
