"""LoRA adapters merged and FP8 dequantized by ckpt.load and ckpt.merge, against the
references PEFT's merge_and_unload and DeepSeek's weight_dequant made
(tests/fixtures/serving/README.md)."""

import numpy as np
import pytest

import ckpt
from conftest import FIXTURES

SERVING = FIXTURES / "serving"


def _same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert np.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("adapter", ["a_qv_r4", "b_rslora_patterns", "c_modules_to_save"])
def test_load_with_lora_equals_peft_merge(adapter):
    d = SERVING / "lora" / adapter
    got = ckpt.load(SERVING / "base", lora=[d])
    _same(got, ckpt.load(d / "merged.safetensors"))


def test_merge_with_lora_writes_peft_merge(tmp_path):
    d = SERVING / "lora" / "b_rslora_patterns"
    r = ckpt.merge(SERVING / "base", tmp_path / "out", lora=[d])
    assert r.tensors == 21
    _same(ckpt.load(tmp_path / "out"), ckpt.load(d / "merged.safetensors"))


def test_lora_alpha_0_is_refused_unless_given():
    d = SERVING / "lora" / "d_alpha0"
    with pytest.raises(ckpt.CheckpointError, match="lora_alpha is 0"):
        ckpt.load(SERVING / "base", lora=[d])
    got = ckpt.load(SERVING / "base", lora=[d], lora_alpha=8)
    base = ckpt.load(SERVING / "base")
    changed = [k for k in base if not np.array_equal(got[k], base[k])]
    assert changed and all("q_proj" in k for k in changed)


def test_fp8_loads_dequantized_and_merges_quantized(tmp_path):
    got = ckpt.load(SERVING / "fp8", dtype="bf16")
    _same(got, ckpt.load(SERVING / "fp8" / "dequantized_bf16.safetensors"))
    ckpt.merge(SERVING / "fp8" / "dequantized_bf16.safetensors", tmp_path / "q", quantize="fp8")
    _same(ckpt.load(tmp_path / "q"), ckpt.load(SERVING / "fp8" / "requant_fp8.safetensors"))


def test_reshard_with_lora_then_merge_equals_peft_merge(tmp_path):
    d = SERVING / "lora" / "a_qv_r4"
    ckpt.reshard(SERVING / "base", tmp_path / "tp2", to=2, shard=[("*_proj.weight", 0)], lora=[d])
    ckpt.merge(tmp_path / "tp2", tmp_path / "out")
    _same(ckpt.load(tmp_path / "out"), ckpt.load(d / "merged.safetensors"))
