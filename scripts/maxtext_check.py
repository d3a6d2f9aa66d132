"""MaxText <-> Hugging Face, checked against the libraries (issue 48; not in CI).

    python -P scripts/maxtext_check.py hf CKPT_BIN [unscanned]       (venv with torch, transformers, numpy)
    python -P scripts/maxtext_check.py maxtext CKPT_BIN [unscanned]  (venv with jax, orbax-checkpoint)

`hf`: `ckpt merge` of tests/fixtures/maxtext/ckpt (a MaxText step) with `--format hf`,
loaded by transformers' AutoModelForCausalLM in fp32; its logits on the fixture's
tokens against the reference (tests/fixtures/maxtext/logits.npy, computed by a
forward written from MaxText's layer code). Then `ckpt reshard` of that HF export
with `--format maxtext` (`--to 2`, the heads and the MLP split: several chunks per array), and the transformers logits are saved
beside it for the second half.

`maxtext`: orbax restores the `--format maxtext` step's `items` (what MaxText's
`load_parameters_path` restores), and the fixture's MaxText forward
(scripts/fixtures/maxtext_fixtures.py) runs on the restored `params/params` tree;
its logits against transformers'.

`unscanned`: the same with tests/fixtures/maxtext/unscanned (MaxText's unscanned
tree, `scan_layers=False`: `decoder/layers_<l>/...`), written back with
`--maxtext-scan-layers false`; work files under /tmp/maxtext_check_unscanned.

Prints SKIPPED (exit 0) when a library is missing. Work files under /tmp/maxtext_check.
"""

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(ROOT, "tests", "fixtures", "maxtext")
CONFIG = os.path.join(FIX, "config.json")
WORK = "/tmp/maxtext_check"
TOL = 1e-4
# --format maxtext's extra arguments and the split of the sharded write (the heads
# and the MLP): the scanned tree's layer axis is 1, the unscanned tree has none.
WRITE = ["--shard", "*.query.kernel=2,*.key.kernel=2,*.mlp.wi_*=2,*.mlp.wo.kernel=0,*.out.kernel=0"]


def run(*args):
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        raise SystemExit(f"FAILED: {' '.join(args)}")
    return r


def check_hf(ckpt):
    try:
        import numpy as np
        import torch
        import transformers
    except ImportError as e:
        print(f"SKIPPED: {e}")
        return
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    hf = os.path.join(WORK, "hf")
    run(ckpt, "merge", os.path.join(FIX, "ckpt"), "--format", "hf", "--hf-config", CONFIG, "-o", hf)
    tokens = np.load(os.path.join(FIX, "tokens.npy"))
    ref = np.load(os.path.join(FIX, "logits.npy"))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
    diff = float(np.abs(logits - ref).max())
    print(f"MaxText -> HF (transformers {transformers.__version__}): max |logits - reference| = {diff:.3e}")
    if not diff <= TOL:
        raise SystemExit(f"FAILED: above {TOL}")
    np.save(os.path.join(WORK, "hf_logits.npy"), logits)
    out = os.path.join(WORK, "maxtext")
    run(ckpt, "reshard", hf, "--format", "maxtext", "--to", "2", *WRITE, "-o", out)
    # And back: HF -> maxtext -> HF is the identity.
    back = os.path.join(WORK, "hf_back")
    run(ckpt, "merge", out, "--format", "hf", "--hf-config", CONFIG, "-o", back)
    from safetensors.numpy import load_file

    a = load_file(os.path.join(hf, "model.safetensors"))
    b = load_file(os.path.join(back, "model.safetensors"))
    same = a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    print(f"HF -> maxtext (--to 2) -> HF: {len(a)} tensors, byte for byte {'equal' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit("FAILED: round trip")
    print("OK (run the `maxtext` half in the jax venv)")


def check_maxtext(ckpt):
    del ckpt
    # The step is sharded over 2 devices (its `_sharding`): as many CPU devices.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    try:
        import numpy as np
        import jax
        import orbax.checkpoint as ocp

        jax.config.update("jax_platforms", "cpu")
    except ImportError as e:
        print(f"SKIPPED: {e}")
        return
    sys.path.insert(0, os.path.join(HERE, "fixtures"))
    import maxtext_fixtures as mf

    out = os.path.join(WORK, "maxtext")
    hf_logits = os.path.join(WORK, "hf_logits.npy")
    if not os.path.exists(hf_logits):
        raise SystemExit("FAILED: run the `hf` half first")
    items = os.path.join(out, "items")
    restored = ocp.PyTreeCheckpointer().restore(items)
    params = jax.tree.map(np.asarray, restored["params"]["params"])
    tokens = np.load(os.path.join(FIX, "tokens.npy"))
    if UNSCANNED:
        assert "layers_0" in params["decoder"] and "layers" not in params["decoder"], sorted(params["decoder"])
    logits = mf.forward(params, tokens)
    want = np.load(hf_logits)
    diff = float(np.abs(logits - want).max())
    print(f"HF -> --format maxtext, restored by orbax {ocp.__version__}, MaxText forward: max |logits - transformers| = {diff:.3e}")
    ref = np.load(os.path.join(FIX, "logits.npy"))
    print(f"  (against the MaxText reference: {float(np.abs(logits - ref).max()):.3e})")
    if not diff <= TOL:
        raise SystemExit(f"FAILED: above {TOL}")
    print("OK")


UNSCANNED = False

if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in ("hf", "maxtext") or sys.argv[3:] not in ([], ["unscanned"]):
        raise SystemExit(__doc__)
    if sys.argv[3:] == ["unscanned"]:
        UNSCANNED = True
        FIX = os.path.join(FIX, "unscanned")
        WORK = "/tmp/maxtext_check_unscanned"
        WRITE = [
            "--maxtext-scan-layers",
            "false",
            "--shard",
            "*.query.kernel=1,*.key.kernel=1,*.mlp.wi_*=1,*.mlp.wo.kernel=0,*.out.kernel=0",
        ]
    (check_hf if sys.argv[1] == "hf" else check_maxtext)(os.path.abspath(sys.argv[2]))
