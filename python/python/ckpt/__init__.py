"""ckpt: merge, reshard, verify and load checkpoints of models trained on many devices.

Every format the ``ckpt`` command reads is read here too (safetensors and Hugging Face
indexes, PyTorch DCP, ``torch.save`` files, MindSpore, ckpt's sliced and compressed
checkpoints), through the same Rust library::

    import ckpt
    ck = ckpt.open_checkpoint("run/step_220")  # checked: every element held once
    ck.format, ck.kind, ck.tensors["embed.weight"]
    w = ckpt.load("merged")                   # whole tensors, numpy views of the file
    mine = ckpt.load("run", rank=1, to=2)     # what rank 1 of 2 holds, only its bytes
    ckpt.reshard("run", "r2", to=2)           # as `ckpt reshard run -o r2 --to 2`

PyTorch (``import ckpt.torch``): ``load_state_dict`` fills a state dict of tensors and
DTensors in place, ``save_state_dict`` writes each rank's shards with their strategy.
Errors are ``ckpt.CheckpointError`` subclasses carrying the CLI's messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ckpt import _ckpt
from ckpt._arrays import dtype_name as _dtype_name, materialize
from ckpt._lazy import Slice, iter_tensors, safe_open
from ckpt.errors import (
    AmbiguousInput,
    CheckpointError,
    ChecksumMismatch,
    InvalidInput,
    Mismatch,
    MissingData,
    OutputExists,
    PathNotFound,
    Unsupported,
    UsageError,
    _raise_problems,
)

__version__ = _ckpt.__version__

PathLike = Union[str, "os.PathLike[str]"]
Paths = Union[PathLike, Sequence[PathLike]]

__all__ = [
    "open_checkpoint",
    "load",
    "safe_open",
    "iter_tensors",
    "Slice",
    "merge",
    "reshard",
    "verify",
    "compress",
    "decompress",
    "Checkpoint",
    "TensorInfo",
    "CopyReport",
    "ConvertReport",
    "VerifyReport",
    "CheckpointError",
    "MissingData",
    "PathNotFound",
    "ChecksumMismatch",
    "AmbiguousInput",
    "UsageError",
    "InvalidInput",
    "Mismatch",
    "Unsupported",
    "OutputExists",
]


def _fspaths(p: Paths) -> List[str]:
    if isinstance(p, (str, bytes, os.PathLike)):
        return [os.fspath(p)]
    return [os.fspath(x) for x in p]


_URL_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https")


def _is_url(x: str) -> bool:
    """Whether ``x`` names an object store location (pass URLs as strings: pathlib
    folds their ``//``)."""
    scheme, sep, _ = x.partition("://")
    return bool(sep) and scheme.lower() in _URL_SCHEMES


def _existing(p: Paths) -> List[str]:
    """:func:`_fspaths`, each checked to exist: a missing one raises
    :class:`PathNotFound` (a ``FileNotFoundError``) with the CLI's message."""
    paths = _fspaths(p)
    for x in paths:
        # Object store URLs (s3://, gs://, az://, http(s)://) are checked by the store.
        if _is_url(x):
            continue
        if not os.path.lexists(x):
            raise PathNotFound(f"{x}: no such file or directory", x)
    return paths


@dataclass(frozen=True)
class TensorInfo:
    """One global tensor of a checkpoint."""

    dtype: str
    """safetensors dtype name: ``F32``, ``BF16``, ``F8_E4M3``, ..."""
    shape: Tuple[int, ...]
    """The global shape."""
    placements: Optional[Tuple[str, ...]]
    """One placement per mesh axis (``Shard(0)``, ``Replicate``) for sliced checkpoints."""
    pieces: Tuple[Tuple[str, Tuple[int, ...], Tuple[int, ...]], ...]
    """``(file, global start, shape)`` of each stored piece (each element once)."""


@dataclass(frozen=True)
class CopyReport:
    """What a merge or reshard wrote (the CLI's ``--json`` summary)."""

    tensors: int
    pieces: int
    files: int
    bytes_written: int
    bytes_read: int
    checksums_verified: int
    checksums_unchecked: int
    seconds: float
    output: str


@dataclass(frozen=True)
class ConvertReport:
    """What ``compress``/``decompress`` did."""

    files: int
    copied: int
    raw_bytes: int
    bytes_read: int
    bytes_written: int
    seconds: float
    output: str


@dataclass(frozen=True)
class VerifyReport:
    """A sound checkpoint: counts of what was checked."""

    files: int
    tensors: int
    checksums: int
    """Recorded tensor checksums that matched (0 with ``checksums=False``)."""
    seconds: float
    notes: List[str] = field(default_factory=list)
    """What could not be checked from these inputs."""


class Checkpoint:
    """An opened checkpoint (see :func:`open_checkpoint`): files mapped, layout checked."""

    def __init__(
        self,
        paths: Paths,
        *,
        source_strategy: Optional[Paths] = None,
        strip_prefix: Optional[str] = None,
        lora: Sequence[PathLike] = (),
        lora_alpha: Optional[float] = None,
        dtype: Optional[str] = None,
    ) -> None:
        self._paths = _existing(paths)
        self._source_strategy = None if source_strategy is None else _existing(source_strategy)
        self._strip_prefix = strip_prefix
        self._native = _ckpt.Checkpoint(
            self._paths,
            self._source_strategy,
            strip_prefix,
            [os.fspath(p) for p in lora],
            lora_alpha,
            _dtype_name(dtype),
        )
        self._tensors: Optional[Dict[str, TensorInfo]] = None

    @property
    def format(self) -> str:
        """The file format(s) read, e.g. ``"safetensors"`` or ``"PyTorch DCP .distcp"``."""
        return ", ".join(self._native.formats)

    @property
    def kind(self) -> str:
        """``"sliced"`` (ckpt rank directories with a strategy), ``"integrated"`` (whole
        tensors) or ``"dcp"`` (PyTorch DCP pieces with offsets)."""
        return self._native.kind

    @property
    def mesh(self) -> Optional[str]:
        """The device mesh of a sliced checkpoint, e.g. ``"dp=2,tp=2"``."""
        return self._native.mesh

    @property
    def strategy(self) -> Optional[str]:
        """The strategy of a sliced checkpoint, as ckpt's ``strategy.json`` text."""
        return self._native.strategy

    @property
    def files(self) -> List[Tuple[str, Optional[int], str]]:
        """``(path, rank, format)`` of every file read."""
        return [(os.fspath(p), r, f) for p, r, f in self._native.files]

    @property
    def notes(self) -> List[str]:
        """What could not be checked from these inputs (not problems)."""
        return list(self._native.notes)

    @property
    def tensors(self) -> Dict[str, TensorInfo]:
        """name -> :class:`TensorInfo` (dtype, global shape, placements, pieces)."""
        if self._tensors is None:
            self._tensors = {
                name: TensorInfo(
                    dtype=d["dtype"],
                    shape=tuple(d["shape"]),
                    placements=None if d["placements"] is None else tuple(d["placements"]),
                    pieces=tuple(
                        (os.fspath(f), tuple(s), tuple(n)) for f, s, n in d["pieces"]
                    ),
                )
                for name, d in self._native.tensors.items()
            }
        return self._tensors

    def keys(self) -> List[str]:
        """The tensor names."""
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        mesh = f" on {self.mesh}" if self.mesh else ""
        return f"<ckpt.Checkpoint {self.kind} {self.format}{mesh}, {len(self)} tensors>"

    def verify(self, deep: bool = False, checksums: bool = True) -> VerifyReport:
        """As ``ckpt verify``: every element owned once, recorded checksums match, and
        with ``deep=True`` replicated copies identical. Raises the problem's
        :class:`CheckpointError` subclass (every problem in the message)."""
        return verify(
            self._paths,
            deep=deep,
            checksums=checksums,
            source_strategy=self._source_strategy,
            strip_prefix=self._strip_prefix,
        )

    def inspect(self, json: bool = False) -> Union[str, Dict[str, Any]]:
        """``ckpt inspect``'s text (shapes, dtypes, placements, bytes per file), computed
        in this process; ``json=True``: its ``--json`` document as a dict."""
        text = _ckpt.inspect(
            self._paths, source_strategy=self._source_strategy, strip_prefix=self._strip_prefix, json=json
        )
        if json:
            import json as _json

            return _json.loads(text)
        return text

    def load(self, **kwargs: Any) -> Dict[str, Any]:
        """:func:`load` from this opened checkpoint."""
        return load(self, **kwargs)


def open_checkpoint(
    path: Paths,
    *,
    source_strategy: Optional[Paths] = None,
    strip_prefix: Optional[str] = None,
    lora: Sequence[PathLike] = (),
    lora_alpha: Optional[float] = None,
    dtype: Optional[str] = None,
) -> Checkpoint:
    """Opens a checkpoint of any format ckpt reads and checks its layout.

    ``path``: a directory (ckpt's sliced ``ckpt_<r>/``, a Hugging Face model, a DCP
    directory, MindSpore ``rank_<r>/``), a file, or a list of them.
    ``source_strategy``: MindSpore strategy file(s) for checkpoints saved without one
    beside them. ``strip_prefix``: remove it from every name (DDP's ``"module."``).
    ``lora``: PEFT adapter directories merged into the weights as they are read
    (``lora_alpha`` for an adapter that records 0); ``dtype``: block-scaled FP8 weights
    are dequantized to it (docs/serving.md).

    Raises :class:`MissingData` (a rank or file missing, elements no rank holds),
    :class:`AmbiguousInput`, :class:`InvalidInput`, ... with the CLI's message.
    """
    return Checkpoint(
        path,
        source_strategy=source_strategy,
        strip_prefix=strip_prefix,
        lora=lora,
        lora_alpha=lora_alpha,
        dtype=dtype,
    )


# ``ckpt.open`` stays, for code written before ``open_checkpoint``; it is not in
# ``__all__``, so ``from ckpt import *`` leaves the builtin ``open`` alone.
open = open_checkpoint


def load(
    path: Union[Paths, Checkpoint],
    *,
    names: Optional[Sequence[str]] = None,
    rank: Optional[int] = None,
    to: Optional[int] = None,
    mesh: Optional[str] = None,
    strategy: Optional[PathLike] = None,
    framework: str = "numpy",
    device: Optional[str] = None,
    source_strategy: Optional[Paths] = None,
    strip_prefix: Optional[str] = None,
    checksums: bool = True,
    dtype: Optional[str] = None,
    chunk_mb: Optional[float] = None,
    streams: Optional[int] = None,
    lora: Sequence[PathLike] = (),
    lora_alpha: Optional[float] = None,
) -> Dict[str, Any]:
    """Loads tensors into memory: whole, or the piece a target rank owns.

    - No ``rank``: every tensor (or those in ``names``) whole.
    - ``rank=r`` with ``to=N`` / ``mesh="dp=2,tp=2"`` / ``strategy=path``: what target
      rank ``r`` holds when the checkpoint is resharded that way (``ckpt reshard``'s
      target layouts, uneven ``torch.chunk`` pieces and empty pieces included); with
      ``rank`` alone, what rank ``r`` holds under the checkpoint's own strategy.

    Only the bytes those pieces need are read. ``framework="numpy"`` gives numpy arrays,
    ``"torch"`` torch tensors. A tensor whose bytes are one contiguous run of an
    uncompressed file is a zero-copy view of a copy-on-write mapping of that file
    (writable; writes never reach the file); the others are assembled by ckpt's copy
    engine into new arrays. numpy has no bfloat16 or 8-bit floats: ``BF16`` comes back
    as ``uint16`` holding the bit patterns (``torch.from_numpy(a).view(torch.bfloat16)``
    restores it), ``F8_*`` as ``uint8``, sub-byte ``F4``/``F6`` as their packed bytes
    (1-D ``uint8``); with ``framework="torch"`` they are real torch dtypes.
    ``device="cuda:N"`` (torch): the tensors are allocated on the device and filled
    through ``streams`` (default 2) reused pinned buffers of ``chunk_mb`` (default 64)
    MiB, each chunk assembled while the previous ones cross the link on their own CUDA
    streams: the host memory the load adds stays near ``chunk_mb * streams``, whatever
    the checkpoint's size (docs/gpu.md).

    ``checksums=True`` checks the recorded checksum of every source tensor read whole
    before returning (:class:`ChecksumMismatch`); pieces of larger tensors cannot be.

    ``dtype`` (``"bf16"``, ``"f16"``, ``"f32"``, ``"f64"``, or a torch/safetensors
    name): floating-point tensors are converted to it as they are assembled (no second
    copy); integer and boolean tensors come back as stored (as ``ckpt merge --dtype``);
    block-scaled FP8 weights are dequantized with their ``_scale_inv`` blocks.

    ``lora``: PEFT adapter directories merged into the weights as they load, as
    ``ckpt merge --lora`` merges them (``lora_alpha`` for an adapter that records 0).
    """
    if isinstance(path, Checkpoint):
        if lora:
            raise ValueError("lora= goes to open_checkpoint when the checkpoint is already open")
        ck = path
    else:
        ck = Checkpoint(
            path,
            source_strategy=source_strategy,
            strip_prefix=strip_prefix,
            lora=lora,
            lora_alpha=lora_alpha,
            dtype=dtype,
        )
    plan = ck._native.plan(
        None if names is None else list(names),
        rank,
        to,
        mesh,
        None if strategy is None else os.fspath(strategy),
        _dtype_name(dtype),
    )
    from ckpt._device import Staging

    return materialize(
        plan,
        framework=framework,
        device=device,
        checksums=checksums,
        staging=Staging.of(chunk_mb, streams),
    )



def merge(
    src: Paths,
    out: PathLike,
    *,
    max_shard_size: Union[int, str, None] = None,
    dtype: Optional[str] = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    format: str = "safetensors",
    one_file: bool = False,
    force: bool = False,
    compress: Optional[str] = None,
    source_strategy: Optional[Paths] = None,
    checksums: bool = True,
    split_qkv: bool = False,
    keep_vocab_padding: bool = False,
    hf_config: Optional[PathLike] = None,
    hf_arch: Optional[str] = None,
    tokenizer: Optional[PathLike] = None,
    lora: Sequence[PathLike] = (),
    lora_alpha: Optional[float] = None,
    quantize: Optional[str] = None,
) -> CopyReport:
    """As ``ckpt merge SRC -o OUT``: one integrated checkpoint (Hugging Face's file
    layout), or with ``format="hf"`` a Hugging Face model that transformers'
    ``from_pretrained`` loads (from Megatron: names, config.json and shards of the model
    family; ``hf_config`` an HF config.json to follow, ``hf_arch`` the family where the
    args do not settle it, ``tokenizer`` a directory whose tokenizer files are copied).

    Options (the CLI's flags): ``max_shard_size`` (bytes or ``"5GB"``), ``dtype``
    (``"bf16"``...), ``include``/``exclude`` (lists of globs), ``strip_prefix``,
    ``add_prefix``, ``format`` (``"safetensors"``, ``"torch"``, ``"mindspore"``,
    ``"ucp"``: DeepSpeed's universal checkpoint, from a ZeRO source; ``"gguf"``: one
    GGUF file ``out`` for llama.cpp, ``dtype`` ``"f32"``/``"f16"``/``"bf16"``/``"q8_0"``,
    ``tokenizer`` the directory of its ``tokenizer.model``),
    ``one_file``, ``force``, ``compress`` (``"zstd"``, ``"zstd:9"``),
    ``source_strategy``, ``checksums`` (check the sources' and record the output's
    CRC-32C; this call only); for a Megatron legacy source ``split_qkv`` (fused QKV as
    ``linear_q``/``linear_k``/``linear_v``) and ``keep_vocab_padding``; ``lora`` (PEFT
    adapter directories merged in turn; ``lora_alpha`` for one that records 0) and
    ``quantize="fp8"`` (docs/serving.md; ``dtype`` dequantizes an FP8 checkpoint).
    Nothing is written unless everything checks.
    """
    r = _ckpt.merge(
        _existing(src),
        os.fspath(out),
        max_shard_size=max_shard_size,
        dtype=_dtype_name(dtype),
        include=list(include),
        exclude=list(exclude),
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        format=format,
        one_file=one_file,
        force=force,
        compress=compress,
        source_strategy=None if source_strategy is None else _existing(source_strategy),
        checksums=checksums,
        split_qkv=split_qkv,
        keep_vocab_padding=keep_vocab_padding,
        hf_config=None if hf_config is None else os.fspath(hf_config),
        hf_arch=hf_arch,
        tokenizer=None if tokenizer is None else os.fspath(tokenizer),
        lora=[os.fspath(p) for p in lora],
        lora_alpha=lora_alpha,
        quantize=quantize,
    )
    return CopyReport(**{**r, "output": os.fspath(r["output"])})



def reshard(
    src: Paths,
    out: PathLike,
    *,
    to: Optional[int] = None,
    mesh: Optional[str] = None,
    strategy: Optional[PathLike] = None,
    rank: Optional[int] = None,
    format: Optional[str] = None,
    compress: Optional[str] = None,
    dtype: Optional[str] = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    keep_all: bool = False,
    shard: Sequence[Tuple[str, int]] = (),
    force: bool = False,
    source_strategy: Optional[Paths] = None,
    checksums: bool = True,
    lora: Sequence[PathLike] = (),
    lora_alpha: Optional[float] = None,
) -> CopyReport:
    """As ``ckpt reshard SRC -o OUT``: sliced for another mesh.

    One of ``to=N`` (the innermost axis becomes N, others 1), ``mesh="dp=1,tp=2"``, or
    ``strategy=path`` (ckpt's ``strategy.json`` or a MindSpore strategy). ``rank``:
    build only that target rank. ``format``: ``"ckpt"`` (default), ``"dcp"``,
    ``"distcp"``, ``"mindspore"``, ``"megatron"`` (from a Megatron legacy source; a
    mixture of experts with ``mesh="tp=T,pp=P,ep=K"``, ``etp=1`` for whole experts),
    ``"deepspeed"`` (a ZeRO-1/2/3 checkpoint for ``to`` data-parallel ranks, from a ZeRO
    source; a ZeRO-1/2 mixture of experts also at another EP size with
    ``mesh="dp=N,ep=K"``). ``shard``: ``(glob, dim)`` pairs, the dimension to split the matching
    tensors of an integrated source along. ``keep_all``: every rank stores its
    replicated tensors too. ``lora``/``lora_alpha``: adapters merged as each rank's
    piece is written (FP8 is dequantized with ``dtype``). Other options as :func:`merge`.
    """
    r = _ckpt.reshard(
        _existing(src),
        os.fspath(out),
        to=to,
        mesh=mesh,
        strategy=None if strategy is None else os.fspath(strategy),
        rank=rank,
        format=format or "ckpt",
        compress=compress,
        dtype=_dtype_name(dtype),
        include=list(include),
        exclude=list(exclude),
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        keep_all=keep_all,
        shard=[(g, int(d)) for g, d in shard],
        force=force,
        source_strategy=None if source_strategy is None else _existing(source_strategy),
        checksums=checksums,
        lora=[os.fspath(p) for p in lora],
        lora_alpha=lora_alpha,
    )
    return CopyReport(**{**r, "output": os.fspath(r["output"])})



def verify(
    src: Paths,
    *,
    deep: bool = False,
    checksums: bool = True,
    source_strategy: Optional[Paths] = None,
    strip_prefix: Optional[str] = None,
) -> VerifyReport:
    """As ``ckpt verify``: returns a :class:`VerifyReport` when the checkpoint is sound,
    raises the problem's :class:`CheckpointError` subclass otherwise (every problem in
    the message, one per line). ``checksums=False`` is ``--fast``."""
    r = _ckpt.verify(
        _existing(src),
        deep=deep,
        checksums=checksums,
        source_strategy=None if source_strategy is None else _fspaths(source_strategy),
        strip_prefix=strip_prefix,
    )
    _raise_problems(r["problems"])
    return VerifyReport(
        files=r["files"],
        tensors=r["tensors"],
        checksums=r["checksums"],
        seconds=r["seconds"],
        notes=list(r["notes"]),
    )


def compress(
    src: PathLike,
    out: PathLike,
    *,
    level: int = 1,
    chunk_bytes: Optional[int] = None,
    force: bool = False,
) -> ConvertReport:
    """As ``ckpt compress SRC -o OUT``: byte-grouped zstd ``.ckptz`` files that every
    ckpt command (and :func:`load`) reads."""
    r = _ckpt.convert(
        _existing(src)[0], os.fspath(out), compress=True, level=level, chunk_bytes=chunk_bytes, force=force
    )
    return ConvertReport(**{**r, "output": os.fspath(r["output"])})


def decompress(src: PathLike, out: PathLike, *, force: bool = False) -> ConvertReport:
    """As ``ckpt decompress SRC -o OUT``: the original safetensors, byte for byte."""
    r = _ckpt.convert(_existing(src)[0], os.fspath(out), compress=False, force=force)
    return ConvertReport(**{**r, "output": os.fspath(r["output"])})
