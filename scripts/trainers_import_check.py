"""The way back to a trainer (issue 45): what `ckpt reshard HF --format megatron-bridge`
writes is what Megatron-Bridge's import leaves and its loader reads; what
`ckpt reshard HF --format nemo2` writes is what NeMo 2's `llm.import_ckpt` leaves.

    python scripts/trainers_import_check.py [path/to/ckpt]     # default: target/debug/ckpt

For the tiny Llama of tests/fixtures/hf/llama (exported to Hugging Face from its
megatron-core dist_ckpt) on TP2 x PP2 and on one rank, and the Qwen2 of
tests/fixtures/hf/qwen2 on TP2 x PP2:
- megatron-core: a GPTModel built from the output's `run_config.yaml` `model` section
  (its sizes, norm, activation, RoPE base, epsilon; the vocabulary unpadded, as
  `should_pad_vocab` false gives) on that many gloo ranks loads `iter_0000000` with
  `dist_checkpointing.load({"model": model.sharded_state_dict()}, ...)` (as Bridge's
  `_load_checkpoint_from_path` does: the model under `model`, common.pt's entries beside)
  and `load_state_dict(strict=True)`; every weight equals the one megatron-core loads
  from `--format megatron-dist` of the same model (which scripts/hf_interop.py checks
  against megatron-core's own save), and its forward gives the reference logits within
  1e-4; `common.pt` holds checkpoint_version 3.0, iteration 0 and Bridge's
  content_metadata;
- the side files, field by field, against the committed fixture
  tests/fixtures/trainers/megatron_bridge (written following Bridge v0.6.0's source, for
  the same Llama): every section and field name ckpt writes in `run_config.yaml` is one
  of that class's fields there, with the same `_target_`; for the Llama, the model's
  architecture fields have the fixture's values; `train_state.pt` has the fixture's keys and dtypes
  (all zero: step 0), `latest_train_state.pt` is its copy, `metadata.json` is the
  fixture's, the tracker says `0`.
Megatron-Bridge itself (its `load_checkpoint` / `AutoBridge.load_megatron_model`) needs
CUDA, Transformer Engine and Python 3.12 and is not run: said as SKIPPED.

A mixture of experts (`--format megatron-bridge`, Qwen3-MoE: Bridge v0.6.0's
`Qwen3MoEBridge`; its Mixtral and Qwen2-MoE have no bridge there and are refused), the
tiny Qwen3-MoE of tests/fixtures/moe/hf/qwen3_moe/hf (transformers' own save) on EP2
(2 gloo ranks) and on TP2 x PP2 (4 ranks, EP1):
- megatron-core: the provider's fields in `run_config.yaml`'s `model` that are
  `TransformerConfig` fields become its TransformerConfig (GPTModelProvider is one), as
  Bridge's `provide` does, with the expert-parallel sizes it records; Transformer Engine
  cannot run on CPU, so the layer spec is the local one with SequentialMLP experts in
  place of the provider's TEGroupedMLP (`moe_grouped_gemm` true: megatron-core's
  TEGroupedMLP.sharded_state_dict is "interchangable with SequentialMLP's", the same
  keys) and `pre_mlp_layernorm` under its own name as Transformer Engine's MoE spec
  keeps it; the CPU needs the allgather dispatcher (gloo has no all_to_all) and no
  fusions: those fields are replaced and said. `dist_checkpointing.load` with
  every key the model's ranks ask held and every key held asked (megatron-core's own
  `strict=RAISE_ALL` fails on torch 2.15 before it compares), then
  `load_state_dict(strict=True)`;
  the logits equal transformers' forward of the source within 1e-4 (transformers run
  where it imports, or with $HF_PYTHON; else the fixture's logits.safetensors, Megatron's
  own, which moe_hf.py checked against transformers', said).

NeMo 2, for the same models and meshes (`--format nemo2`):
- megatron-core: the GPTModel of `context/model.yaml`'s `config` on that many gloo ranks
  loads `weights/` with `dist_checkpointing.load({"state_dict":
  model.sharded_state_dict(prefix="module.")}, ...)`, as `MegatronStrategy.load_checkpoint`
  does (`MegatronParallel`'s keys under `module.`), strictly, with the weights of the
  `--format megatron-dist` import and the reference logits within 1e-4; `common.pt` holds
  epoch 0, global step 0 and the strategy's content_metadata;
- fiddle (0.3, the real decoder NeMo's `load_context` calls,
  `serialization.Deserialization` via `load_json`): `context/io.json` decodes, over
  stand-in classes registered under NeMo's module names (NeMo needs CUDA, Transformer
  Engine and nemo_run) and torch's dtypes registered as NeMo's `fdl_torch.enable` does,
  into a TrainerContext Config whose model config's arguments are model.yaml's, whose
  strategy has the mesh's sizes and whose tokenizer is the `nemo_tokenizer` artifact;
  fiddle's own `dump_json` of the decoded graph gives io.json again byte for byte; the
  committed fixture's io.json (tests/fixtures/trainers/nemo2) decodes too.
NeMo's own `load_context` and restore are not run (nemo_toolkit needs CUDA): SKIPPED.
Needs torch, safetensors, pyyaml and megatron-core (and fiddle for io.json); SKIPPED with
a message when one is missing.
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "trainers", "megatron_bridge", "nemo_experiments", "default",
                       "checkpoints", "iter_0000002")
NEMO_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "trainers", "nemo2", "nemo_experiments", "default",
                            "checkpoints", "default--reduced_train_loss=4.1851-epoch=0-consumed_samples=4.0-last")
NEMO_CONTENT_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
HF_FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
FP32_TOL = 1e-4
# The model's architecture: equal to the fixture's (the same model).
ARCH = ["_target_", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "layernorm_epsilon", "normalization", "gated_linear_unit", "activation_func",
        "position_embedding_type", "rotary_base", "rotary_percent", "share_embeddings_and_output_weights",
        "add_bias_linear", "add_qkv_bias", "params_dtype", "fp16", "bf16", "hidden_dropout", "attention_dropout",
        "init_method_std"]
# Fields the run sets, not the model (the fixture is a training run's save, ckpt's an import).
RUN = {"tensor_model_parallel_size": "--mesh", "pipeline_model_parallel_size": "--mesh",
       "seq_length": "the HF max_position_embeddings (the fixture's run: 16)",
       "vocab_size": "the HF vocabulary, unpadded (the fixture's run: its NullTokenizer's 50 of 64 rows)",
       "make_vocab_size_divisible_by": "Bridge's largest power of 2 dividing the vocabulary (the run: 8)",
       "hf_model_id": "the HF directory imported (the run: none)",
       "perform_initialization": "false: weights loaded (to_megatron_provider)",
       "bias_activation_fusion": "Llama's true (the CPU run built without fusions)",
       "masked_softmax_fusion": "idem", "persist_layer_norm": "idem", "bias_dropout_fusion": "idem",
       "apply_rope_fusion": "idem"}


def skipped(why):
    print(f"SKIPPED: {why}")
    sys.exit(0)


def run(*args):
    r = subprocess.run(list(args), capture_output=True, text=True)
    assert r.returncode == 0, f"{args}: {r.stderr}"
    return r


def family_of_run_config(m):
    """hf_megatron.build_model's family features from run_config.yaml's model section."""
    return dict(norm=m["normalization"], swiglu=m["gated_linear_unit"]
                and m["activation_func"]["_target_"].endswith("silu"),
                rope=m["position_embedding_type"] == "rope", groups=m["num_query_groups"], kv=m.get("kv_channels"),
                qkv_bias=m["add_qkv_bias"], bias=m["add_bias_linear"], qk_norm=m.get("qk_layernorm", False),
                tied=m["share_embeddings_and_output_weights"], base=m["rotary_base"], eps=m["layernorm_epsilon"])


def load_worker(rank, world, tp, pp, port, saved, dist_iter, ref_file, result, kind="bridge"):
    """One of tp x pp gloo ranks: the model of run_config.yaml (Bridge's iteration `saved`)
    or of model.yaml (`kind` "nemo2": `saved` is the checkpoint, its weights/ loaded under
    `module.` as NeMo's strategy loads them) loads strictly; its weights equal
    megatron-dist's; on one rank, its logits go to `result`."""
    import torch
    import yaml
    from safetensors.torch import load_file

    sys.path.append(os.path.join(ROOT, "scripts", "fixtures"))
    import hf_megatron as H

    H.stub_cuda()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if kind == "bridge":
        with open(os.path.join(saved, "run_config.yaml")) as f:
            m = yaml.safe_load(f)["model"]
        assert (m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"]) == (tp, pp)
    else:
        with open(os.path.join(saved, "context", "model.yaml")) as f:
            m = yaml.safe_load(f)["config"]
    assert (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"], m["num_attention_heads"]) == (
        H.LAYERS, H.HIDDEN, H.FFN, H.HEADS), m

    def build():
        model = H.build_model(family_of_run_config(m), tp, pp, m["vocab_size"])
        for p in model.parameters():
            torch.nn.init.constant_(p, float("nan"))
        return model

    model = build()
    if kind == "bridge":
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, saved)
        assert loaded["checkpoint_version"] == 3.0 and loaded["iteration"] == 0, sorted(loaded)
        assert loaded["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        assert "args" not in loaded and "optimizer" not in loaded and "rng_state" not in loaded, sorted(loaded)
        model.load_state_dict(loaded["model"], strict=True)
    else:
        weights = os.path.join(saved, "weights")
        loaded = dist_checkpointing.load({"state_dict": model.sharded_state_dict(prefix="module.")}, weights)
        assert loaded["content_metadata"] == NEMO_CONTENT_METADATA, loaded["content_metadata"]
        assert (loaded["epoch"], loaded["global_step"]) == (0, 0), sorted(loaded)
        assert all(k.startswith("module.") for k in loaded["state_dict"]), sorted(loaded["state_dict"])
        model.load_state_dict({k[len("module."):]: v for k, v in loaded["state_dict"].items()}, strict=True)
    other = build()
    other.load_state_dict(dist_checkpointing.load({"model": other.sharded_state_dict()}, dist_iter)["model"],
                          strict=True)
    have, want = model.state_dict(), other.state_dict()
    assert sorted(have) == sorted(want)
    for k, v in have.items():
        if not k.endswith("_extra_state"):
            assert torch.equal(v, want[k]), k
    logits = H.pipeline_forward(model, load_file(ref_file)["input_ids"], m["hidden_size"])
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(logits, result)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def check_sidecars(out, tp, pp, same_model):
    """The side files against the committed fixture's, field by field (`same_model`:
    the fixture's Llama, whose architecture values must be the same too)."""
    import torch
    import yaml

    it = os.path.join(out, "iter_0000000")
    with open(os.path.join(it, "run_config.yaml")) as f:
        mine = yaml.safe_load(f)
    with open(os.path.join(FIXTURE, "run_config.yaml")) as f:
        theirs = yaml.safe_load(f)
    assert mine["_target_"] == theirs["_target_"]
    fields = 0
    for section, v in mine.items():
        assert section in theirs, f"run_config.yaml: section `{section}` is not a ConfigContainer field"
        if not isinstance(v, dict):
            assert v is None or isinstance(v, str), (section, v)
            continue
        assert v["_target_"] == theirs[section]["_target_"], section
        for k in v:
            assert k in theirs[section], f"run_config.yaml: `{section}.{k}` is not a field of {v['_target_']}"
            fields += 1
    m, t = mine["model"], theirs["model"]
    differ = {k: m[k] for k in m if m[k] != t.get(k)}
    if same_model:
        for k in ARCH:
            assert m[k] == t[k], f"run_config.yaml: model.{k} is {m[k]!r}, the fixture's {t[k]!r}"
        assert set(differ) <= set(RUN), f"model fields neither the model's nor the run's: {set(differ) - set(RUN)}"
    assert (m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"]) == (tp, pp)
    assert mine["checkpoint"]["save"] == os.path.abspath(out)
    assert (mine["checkpoint"]["save_optim"], mine["checkpoint"]["save_rng"]) == (False, False)
    assert mine["tokenizer"]["tokenizer_type"] == "HuggingFaceTokenizer"
    for s in ("train", "ddp", "scheduler", "dataset", "dist"):
        assert mine[s] is None, s
    ts = torch.load(os.path.join(it, "train_state.pt"), weights_only=True)
    ref = torch.load(os.path.join(FIXTURE, "train_state.pt"), weights_only=True)
    assert list(ts) == list(ref), (list(ts), list(ref))
    for k, v in ts.items():
        assert v.dtype == ref[k].dtype and v.shape == ref[k].shape == torch.Size([]), k
        assert v.item() == 0, k
    latest = torch.load(os.path.join(out, "latest_train_state.pt"), weights_only=True)
    assert all(torch.equal(latest[k], v) for k, v in ts.items())
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "0"
    with open(os.path.join(it, "metadata.json")) as f, open(os.path.join(FIXTURE, "metadata.json")) as g:
        assert json.load(f) == json.load(g)
    common = torch.load(os.path.join(it, "common.pt"), weights_only=False)
    theirs_common = torch.load(os.path.join(FIXTURE, "common.pt"), weights_only=False)
    assert list(common) == ["checkpoint_version", "iteration", "content_metadata"], list(common)
    assert set(common) <= set(theirs_common)
    assert common["checkpoint_version"] == theirs_common["checkpoint_version"]
    assert set(common["content_metadata"]) <= set(theirs_common["content_metadata"])
    return fields, sorted(differ)


def stand_ins(doc):
    """Stand-in classes registered under the NeMo module names io.json refers to (NeMo
    does not install here), as the fixture generator made them; torch's dtypes registered
    as serialization constants, as NeMo's `fdl_torch.enable` registers them."""
    import types

    import torch
    from fiddle._src.experimental import serialization

    for name in ("float32", "bfloat16", "float16"):
        serialization.register_constant("torch", name, compare_by_identity=True)
    refs = []

    def walk(v):
        if isinstance(v, dict):
            if v.get("type") == "pyref" and v["module"].startswith("nemo."):
                refs.append((v["module"], v["name"]))
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(doc)
    for mod, attr in refs:
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):
            n = ".".join(parts[:i])
            if n not in sys.modules:
                sys.modules[n] = types.ModuleType(n)
        m = sys.modules[mod]
        if not hasattr(m, attr):
            cls = type(attr, (), {"__init__": lambda self, **k: None})
            cls.__module__, cls.__qualname__, cls.__name__ = mod, attr, attr
            setattr(m, attr, cls)
    return torch


def check_nemo_context(out, tp, pp, tokenizer):
    """context/io.json through fiddle's own decoder and encoder, against model.yaml."""
    import fiddle as fdl
    import yaml
    from fiddle._src.experimental import serialization

    with open(os.path.join(out, "context", "io.json")) as f:
        text = f.read()
    torch = stand_ins(json.loads(text))
    cfg = serialization.load_json(text)
    assert type(cfg).__name__ == "Config" and fdl.get_callable(cfg).__name__ == "TrainerContext", cfg
    again = serialization.dump_json(cfg)
    assert again == text, "fiddle's dump_json of the decoded graph differs from ckpt's io.json"
    with open(os.path.join(out, "context", "model.yaml")) as f:
        y = yaml.safe_load(f)
    given = fdl.ordered_arguments(cfg.model.config)
    for k, v in given.items():
        want = y["config"][k]
        if isinstance(v, torch.dtype):
            assert want == {"_call_": False, "_target_": str(v)}, (k, v, want)
        else:
            assert v == want, f"io.json's model.config.{k} is {v!r}, model.yaml's {want!r}"
    assert y["config"]["_target_"].endswith("." + fdl.get_callable(cfg.model.config).__name__)
    assert y["_target_"].endswith("." + fdl.get_callable(cfg.model).__name__)
    s = cfg.trainer.strategy
    assert (s.tensor_model_parallel_size, s.pipeline_model_parallel_size) == (tp, pp)
    if tokenizer:
        assert cfg.model.tokenizer.pretrained_model_name == "nemo_tokenizer"
        assert y["tokenizer"]["pretrained_model_name"] == "nemo_tokenizer"
        assert os.path.isdir(os.path.join(out, "context", "nemo_tokenizer"))
    with open(os.path.join(NEMO_FIXTURE, "context", "io.json")) as f:
        fx = f.read()
    stand_ins(json.loads(fx))
    fx_cfg = serialization.load_json(fx)
    assert fdl.get_callable(fx_cfg).__name__ == "TrainerContext"
    assert fdl.get_callable(fx_cfg.model).__name__ == "LlamaModel"
    return len(given), len(json.loads(text)["objects"])


def nemo2_checks(ckpt, work, runs):
    try:
        import fiddle  # noqa: F401
    except ImportError:
        print("SKIPPED: NeMo 2's io.json through fiddle (fiddle is not installed)")
        fiddle = None
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    for i, (family, tp, pp) in enumerate(runs):
        hf = os.path.join(work, f"hf-{family}")
        out = os.path.join(work, f"nemo2-{family}-{tp}{pp}")
        dist = os.path.join(work, f"dist-{family}-{tp}{pp}")
        mesh = f"tp={tp},pp={pp}"
        run(ckpt, "reshard", hf, "--format", "nemo2", "--mesh", mesh, "-o", out, "--quiet")
        said = run(ckpt, "inspect", out)
        assert "NeMo 2" in said.stdout + said.stderr, said.stdout + said.stderr
        context = ""
        if fiddle is not None:
            given, objects = check_nemo_context(out, tp, pp, os.path.isfile(os.path.join(hf, "tokenizer.json")))
            context = (f"; io.json decodes with fiddle into the TrainerContext ({objects} objects; the config's "
                       f"{given} arguments model.yaml's) and fiddle's dump_json gives it again byte for byte")
        result = os.path.join(work, f"nemo-logits-{family}-{tp}{pp}.pt")
        ref = os.path.join(HF_FIXTURES, family, "reference.safetensors")
        mp.spawn(load_worker, args=(tp * pp, tp, pp, 29740 + 10 * i, out, os.path.join(dist, "release"), ref,
                                    result, "nemo2"), nprocs=tp * pp, join=True)
        got, want = torch.load(result), load_file(ref)["logits"]
        diff = (got - want).abs().max().item()
        assert got.shape == want.shape and diff <= FP32_TOL, f"{family} TP{tp} x PP{pp}: logits differ by {diff}"
        print(f"{family}: HF -> nemo2 TP{tp} x PP{pp}: megatron-core's dist_checkpointing.load takes weights/ "
              f"under module. strictly into the GPTModel of model.yaml's config, weights equal megatron-dist's, "
              f"logits the reference's (max |diff| {diff:.2e}){context}")
    print("SKIPPED: NeMo's own load_context and RestoreConfig restore (nemo_toolkit needs CUDA, Transformer "
          "Engine and nemo_run); megatron-core's load and fiddle's decoder stand for them")


MOE_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "moe", "hf", "qwen3_moe")
# The run_config fields replaced for megatron-core on CPU: (field, value, why).
MOE_CPU = [("moe_token_dispatcher_type", "allgather", "gloo has no all_to_all"),
           ("moe_permute_fusion", False, "a Transformer Engine kernel"),
           ("moe_grouped_gemm", False, "SequentialMLP in place of TEGroupedMLP (Transformer Engine)"),
           ("bias_activation_fusion", False, "CPU"), ("masked_softmax_fusion", False, "CPU"),
           ("persist_layer_norm", False, "CPU"), ("apply_rope_fusion", False, "CPU"),
           ("bias_dropout_fusion", False, "CPU")]


def resolve(v):
    """A `{_call_: false, _target_: ...}` mapping as the object it names (Bridge's
    instantiate)."""
    import importlib

    if isinstance(v, dict) and v.get("_call_") is False:
        mod, _, name = v["_target_"].rpartition(".")
        return getattr(importlib.import_module(mod), name)
    return v


def moe_worker(rank, world, saved, ids_file, result, port):
    """One gloo rank: the GPTModel of run_config.yaml's model section (module docs) loads
    `saved` (iter_0000000) strictly; on the last stage's first TP rank, logits to
    `result`."""
    import dataclasses

    import torch
    import yaml
    from safetensors.torch import load_file

    sys.path.append(os.path.join(ROOT, "scripts", "fixtures"))
    import hf_megatron as H

    H.stub_cuda()
    with open(os.path.join(saved, "run_config.yaml")) as f:
        m = yaml.safe_load(f)["model"]
    tp, pp = m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"]
    ep = m.get("expert_model_parallel_size", 1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = None
    etp = m.get("expert_tensor_parallel_size", tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {k: resolve(v) for k, v in m.items() if k in fields}
    for k, v, _ in MOE_CPU:
        kw[k] = v
    kw.update(use_cpu_initialization=True, pipeline_dtype=kw["params_dtype"])
    config = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(num_experts=m["num_moe_experts"], qk_layernorm=m["qk_layernorm"],
                                    normalization=m["normalization"])
    # Transformer Engine's MoE layer keeps pre_mlp_layernorm a module of its own (TENorm),
    # not fused into linear_fc1 as the local spec's key map says.
    del spec.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."]
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=m["vocab_size"],
                     max_sequence_length=m["seq_length"], pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=m["share_embeddings_and_output_weights"],
                     position_embedding_type=m["position_embedding_type"], rotary_base=m["rotary_base"])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    sharded = model.sharded_state_dict()
    # Strict both ways: every key the model asks is in the checkpoint and every key the
    # checkpoint holds is asked by some rank. (megatron-core 0.16.1's own
    # StrictHandling.RAISE_ALL cannot run on torch 2.15: its load_tensors_metadata passes
    # TensorProperties' new `strides` to torch.empty.)
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from torch.distributed.checkpoint import FileSystemReader

    mine = {v.unique_key if isinstance(v, ShardedObject) else v.key for v in nested_values(sharded)}
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    asked = set().union(*every)
    held = set(FileSystemReader(saved).read_metadata().state_dict_metadata)
    assert asked == held, f"missing {sorted(asked - held)}, unexpected {sorted(held - asked)}"
    loaded = dist_checkpointing.load({"model": sharded}, saved)
    assert loaded["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    model.load_state_dict(loaded["model"], strict=True)
    assert not any(torch.isnan(p).any() for p in model.parameters())
    logits = H.pipeline_forward(model, load_file(ids_file)["input_ids"], m["hidden_size"])
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0 and \
            parallel_state.get_expert_model_parallel_rank() == 0:
        torch.save(logits, result)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


TRANSFORMERS_LOGITS = """
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    out = model(load_file(sys.argv[2])["input_ids"]).logits
torch.save(out, sys.argv[3])
"""


def reference_logits(hf, ids_file, work):
    """transformers' logits of the source ([b, s, v], as GPTModel's), and where
    they came from."""
    import torch
    from safetensors.torch import load_file

    out = os.path.join(work, "hf-moe-logits.pt")
    python = sys.executable
    try:
        import transformers  # noqa: F401
    except ImportError:
        python = os.environ.get("HF_PYTHON")
    if python:
        r = subprocess.run([python, "-c", TRANSFORMERS_LOGITS, hf, ids_file, out], capture_output=True, text=True)
        if r.returncode == 0:
            return torch.load(out), f"transformers' ({python})"
        print(f"note: transformers' forward with {python} failed: {r.stderr[-400:]}")
    return load_file(ids_file)["logits"], ("the fixture's logits.safetensors (Megatron's, which moe_hf.py checked "
                                           "against transformers'; no transformers here: set HF_PYTHON)")


def moe_checks(ckpt, work):
    import torch
    import torch.multiprocessing as mp
    import yaml

    hf = os.path.join(MOE_FIXTURE, "hf")
    ids_file = os.path.join(MOE_FIXTURE, "logits.safetensors")
    want, source = reference_logits(hf, ids_file, work)
    for i, mesh in enumerate(("tp=1,pp=1,ep=2", "tp=2,pp=2")):
        out = os.path.join(work, "bridge-qwen3moe-" + mesh.replace(",", "-").replace("=", ""))
        run(ckpt, "reshard", hf, "--format", "megatron-bridge", "--mesh", mesh, "-o", out, "--quiet")
        fields, _ = check_sidecars(out, *[int(x.split("=")[1]) for x in mesh.split(",")[:2]], False)
        said = run(ckpt, "inspect", out)
        assert "Megatron-Bridge" in said.stdout + said.stderr, said.stdout + said.stderr
        saved = os.path.join(out, "iter_0000000")
        with open(os.path.join(saved, "run_config.yaml")) as f:
            m = yaml.safe_load(f)["model"]
        # TP x PP ranks, their data-parallel copies holding the EP ranks (TP 1 or EP 1 here).
        world = m["tensor_model_parallel_size"] * m["pipeline_model_parallel_size"] * \
            m.get("expert_model_parallel_size", 1)
        result = os.path.join(work, f"moe-logits-{i}.pt")
        mp.spawn(moe_worker, args=(world, saved, ids_file, result, 29840 + 10 * i), nprocs=world, join=True)
        got = torch.load(result)
        diff = (got - want).abs().max().item()
        assert got.shape == want.shape and diff <= FP32_TOL, f"qwen3_moe {mesh}: logits differ by {diff}"
        print(f"qwen3_moe: HF -> megatron-bridge {mesh} ({world} gloo ranks): megatron-core's "
              f"dist_checkpointing.load (every key asked held, none unasked) takes iter_0000000 into the GPTModel of its "
              f"run_config.yaml (num_moe_experts {m['num_moe_experts']}, topk {m['moe_router_topk']}, "
              f"pre_softmax {m['moe_router_pre_softmax']}, EP {m.get('expert_model_parallel_size', 1)}), logits "
              f"{source} within {diff:.2e}; {fields} run_config.yaml fields are Bridge's (the fixture's)")
    print("replaced for the CPU: " + "; ".join(f"{k}={v!r} ({why})" for k, v, why in MOE_CPU))


def main():
    ckpt = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "ckpt"))
    try:
        import torch  # noqa: F401
        import torch.multiprocessing as mp
        import yaml  # noqa: F401
        from safetensors.torch import load_file  # noqa: F401
        import megatron.core  # noqa: F401
    except ImportError as e:
        skipped(f"scripts/trainers_import_check.py needs torch, safetensors, pyyaml and megatron-core ({e})")
    runs = (("llama", 2, 2), ("llama", 1, 1), ("qwen2", 2, 2))
    with tempfile.TemporaryDirectory() as work:
        for i, (family, tp, pp) in enumerate(runs):
            hf = os.path.join(work, f"hf-{family}")
            if not os.path.exists(hf):
                run(ckpt, "merge", os.path.join(HF_FIXTURES, family, "dist_ckpt"), "--format", "hf", "-o", hf,
                    "--quiet")
            out = os.path.join(work, f"bridge-{family}-{tp}{pp}")
            dist = os.path.join(work, f"dist-{family}-{tp}{pp}")
            mesh = f"tp={tp},pp={pp}"
            run(ckpt, "reshard", hf, "--format", "megatron-bridge", "--mesh", mesh, "-o", out, "--quiet")
            run(ckpt, "reshard", hf, "--format", "megatron-dist", "--mesh", mesh, "-o", dist, "--quiet")
            fields, differ = check_sidecars(out, tp, pp, family == "llama")
            said = run(ckpt, "inspect", out)
            assert "Megatron-Bridge" in said.stdout + said.stderr, said.stdout + said.stderr
            result = os.path.join(work, f"logits-{family}-{tp}{pp}.pt")
            ref = os.path.join(HF_FIXTURES, family, "reference.safetensors")
            mp.spawn(load_worker, args=(tp * pp, tp, pp, 29640 + 10 * i, os.path.join(out, "iter_0000000"),
                                        os.path.join(dist, "release"), ref, result), nprocs=tp * pp, join=True)
            got, want = torch.load(result), load_file(ref)["logits"]
            diff = (got - want).abs().max().item()
            assert got.shape == want.shape and diff <= FP32_TOL, f"{family} TP{tp} x PP{pp}: logits differ by {diff}"
            same = ("the model's architecture equal, differing as an import: " + ", ".join(differ)
                    if family == "llama" else "another model than the fixture's: names and classes only")
            print(f"{family}: HF -> megatron-bridge TP{tp} x PP{pp}: megatron-core's dist_checkpointing.load takes "
                  f"iter_0000000 strictly into the GPTModel of its run_config.yaml, weights equal megatron-dist's, "
                  f"logits the reference's (max |diff| {diff:.2e}); {fields} run_config.yaml fields are Bridge's "
                  f"(the fixture's), {same}; train_state.pt, latest_train_state.pt, tracker, metadata.json and "
                  f"common.pt as the fixture's")
        moe_checks(ckpt, work)
        nemo2_checks(ckpt, work, runs)
    try:
        import megatron.bridge  # noqa: F401
    except ImportError:
        print("SKIPPED: Megatron-Bridge's own load_checkpoint (not installed: it needs CUDA, Transformer Engine "
              "and Python 3.12); megatron-core's load and the fixture's side files stand for it")


if __name__ == "__main__":
    main()
