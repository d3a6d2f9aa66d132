"""torchtitan's own DCP -> Hugging Face converter, for scripts/trainers_bench.sh.

torchtitan ships its converter as a script of its repository
(`scripts/checkpoint_conversion/convert_to_hf.py`), not in its wheel; this is that
script's `convert_to_hf` with torchtitan 0.3.0's names: the model built on the CPU from
its config, `ModelWrapper(model)._get_state_dict()` as the buffers, `dcp.load` of the
step directory into them (the model's keys only: the optimizer, scheduler and
dataloader states beside them are not read), the model's `Llama3StateDictAdapter.to_hf`,
then `dcp.save` with torch's `HuggingFaceStorageWriter(save_distributed=True,
enable_consolidation=True, thread_count_consolidation=5)`, fp32 (its default
`--export_dtype`). The repository's script takes a model flavor from torchtitan's
registry; the benchmark's model is not one, so the config is the fixture generator's
(`scripts/fixtures/trainers_torchtitan.py`, sized by the same TRAINERS_FX_* variables),
and `_ParallelFileSystemReader` (newer than 0.3.0) is torch's `FileSystemReader`.

    python scripts/torchtitan_to_hf.py STEP_DIR OUT_DIR
"""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402


@torch.inference_mode()
def convert_to_hf(input_dir, output_dir, model_config):
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageWriter
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    with torch.device("cpu"):
        model = model_config.build()
    model = ModelWrapper(model)
    sd_adapter = Llama3StateDictAdapter(model_config, None)
    state_dict = model._get_state_dict()
    dcp.load(state_dict, storage_reader=FileSystemReader(input_dir))
    hf_state_dict = sd_adapter.to_hf(state_dict)
    storage_writer = HuggingFaceStorageWriter(path=output_dir, save_distributed=True,
                                              fqn_to_index_mapping=sd_adapter.fqn_to_index_mapping,
                                              enable_consolidation=True, thread_count_consolidation=5)
    dcp.save(hf_state_dict, storage_writer=storage_writer)


def main():
    spec = importlib.util.spec_from_file_location(
        "trainers_torchtitan", os.path.join(_here, "fixtures", "trainers_torchtitan.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    convert_to_hf(sys.argv[1], sys.argv[2], gen.model_config())


if __name__ == "__main__":
    main()
