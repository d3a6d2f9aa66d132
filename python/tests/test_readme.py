"""Every ```python block of the README runs as written, from the repository root (its
paths are the repository's fixtures): a block that starts a process group runs as 2
gloo ranks, as `torchrun --nproc-per-node 2` would start it, any other block once.
(The README's shell block is run by scripts/readme_examples.sh, its format table
checked by tests/readme.rs.)"""

import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO

BLOCKS = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_python_block_runs(i, tmp_path):
    code = BLOCKS[i]
    script = tmp_path / f"block{i}.py"
    script.write_text(code)
    ranks = 2 if "init_process_group" in code else 1
    if "torch" in code:
        pytest.importorskip("torch.distributed.tensor" if ranks > 1 else "torch")
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"README python block {i}, rank {r} of {ranks}:\n{code}\n{o}"
