# Type stubs of the native module (python/src/*.rs). Private: use the `ckpt` package.
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

_Path = Union[str, os.PathLike]
_Paths = Union[_Path, Sequence[_Path]]

__version__: str

class Checkpoint:
    def __new__(
        cls,
        paths: _Paths,
        source_strategy: Optional[_Paths] = None,
        strip_prefix: Optional[str] = None,
        lora: List[str] = ...,
        lora_alpha: Optional[float] = None,
        dtype: Optional[str] = None,
    ) -> "Checkpoint": ...
    @property
    def kind(self) -> str: ...
    @property
    def formats(self) -> List[str]: ...
    @property
    def files(self) -> List[Tuple[str, Optional[int], str]]: ...
    @property
    def mesh(self) -> Optional[str]: ...
    @property
    def strategy(self) -> Optional[str]: ...
    @property
    def notes(self) -> List[str]: ...
    @property
    def tensors(self) -> Dict[str, Dict[str, Any]]: ...
    @property
    def metadata(self) -> Optional[Dict[str, str]]: ...
    def plan(
        self,
        names: Optional[List[str]] = None,
        rank: Optional[int] = None,
        to: Optional[int] = None,
        mesh: Optional[str] = None,
        strategy: Optional[_Path] = None,
        dtype: Optional[str] = None,
    ) -> LoadPlan: ...
    def plan_boxes(
        self, requests: List[Tuple[str, List[int], str, List[int], List[int]]]
    ) -> LoadPlan: ...

class LoadPlan:
    def entries(self) -> List[Tuple[str, str, List[int], Optional[Tuple[str, int]]]]: ...
    def bytes_read(self) -> int: ...
    def check_checksums(self) -> Tuple[int, int]: ...
    def fill(self, items: List[Tuple[int, int, int]]) -> None: ...
    def chunks(self, indices: List[int], max_bytes: int, part_bytes: int) -> Chunks: ...
    def __len__(self) -> int: ...

class Chunks:
    def buffer_bytes(self) -> int: ...
    def layout(self, k: int) -> List[Tuple[int, int, int, int]]: ...
    def fill(self, k: int, addr: int, n: int) -> None: ...
    def __len__(self) -> int: ...

def merge(
    src: _Paths,
    out: _Path,
    *,
    max_shard_size: Union[int, str, None] = None,
    dtype: Optional[str] = None,
    include: List[str] = ...,
    exclude: List[str] = ...,
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    format: str = "safetensors",
    one_file: bool = False,
    force: bool = False,
    compress: Optional[str] = None,
    source_strategy: Optional[_Paths] = None,
    checksums: bool = True,
    split_qkv: bool = False,
    keep_vocab_padding: bool = False,
    hf_config: Optional[_Path] = None,
    hf_arch: Optional[str] = None,
    tokenizer: Optional[_Path] = None,
    lora: List[str] = ...,
    lora_alpha: Optional[float] = None,
    quantize: Optional[str] = None,
) -> Dict[str, Any]: ...
def reshard(
    src: _Paths,
    out: _Path,
    *,
    to: Optional[int] = None,
    mesh: Optional[str] = None,
    strategy: Optional[_Path] = None,
    rank: Optional[int] = None,
    format: str = "ckpt",
    compress: Optional[str] = None,
    dtype: Optional[str] = None,
    include: List[str] = ...,
    exclude: List[str] = ...,
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    keep_all: bool = False,
    shard: List[Tuple[str, int]] = ...,
    force: bool = False,
    source_strategy: Optional[_Paths] = None,
    checksums: bool = True,
    lora: List[str] = ...,
    lora_alpha: Optional[float] = None,
) -> Dict[str, Any]: ...
def verify(
    src: _Paths,
    *,
    deep: bool = False,
    checksums: bool = True,
    source_strategy: Optional[_Paths] = None,
    strip_prefix: Optional[str] = None,
) -> Dict[str, Any]: ...
def inspect(
    src: _Paths,
    *,
    source_strategy: Optional[_Paths] = None,
    strip_prefix: Optional[str] = None,
    json: bool = False,
) -> str: ...
def convert(
    src: _Path, out: _Path, *, compress: bool, level: int = 1, chunk_bytes: Optional[int] = None, force: bool = False
) -> Dict[str, Any]: ...
def strategy_json(
    mesh: List[Tuple[str, int]], tensors: List[Tuple[str, str, List[int], List[str]]]
) -> str: ...
def write_rank(
    dir: _Path,
    strategy: str,
    rank: int,
    tensors: List[Tuple[str, int, int]],
    keep_all: bool = False,
    checksums: bool = True,
) -> str: ...
def cli_main(argv: List[str]) -> int: ...
