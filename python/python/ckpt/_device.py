"""Loads into GPU memory through a few small, reused pinned buffers.

A load is cut into chunks of at most ``chunk_mb`` (ckpt's ``LoadPlan.chunks``); each
chunk is assembled by ckpt's copy engine into one of ``streams`` pinned buffers (in
parallel, without the GIL, source pages released as they are consumed), then copied to
the GPU on that buffer's own CUDA stream without blocking, so that the host assembles
chunk k+1 while chunk k crosses the link. A buffer is filled again only once its last
copy has finished (its CUDA event). The host memory a load adds is therefore
``chunk_mb * streams`` of pinned memory plus a window of the mapped sources, whatever
the checkpoint's size, where staging the whole load in pinned memory (as ckpt did
before) added the checkpoint's size.

The copies go through a ``Copier``: :class:`CudaCopier` on GPUs, :class:`HostCopier`
(plain memory, synchronous copies) for the CPU tests of the same pipeline.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

#: Defaults of ``chunk_mb`` and ``streams``: two 64 MiB buffers keep a host-to-device
#: link busy while the next chunk is assembled (the issue's probes on an H200 found
#: 64-128 MiB chunks and 2-4 buffers best for a bounce-buffer pipeline).
CHUNK_MB = 64
STREAMS = 2
#: The pieces a chunk is assembled in, in parallel.
PART_BYTES = 8 << 20


class Staging(NamedTuple):
    """How device loads are staged: chunk size in bytes and buffers (streams)."""

    chunk_bytes: int = CHUNK_MB << 20
    streams: int = STREAMS

    @staticmethod
    def of(chunk_mb: Optional[float], streams: Optional[int]) -> "Staging":
        from ckpt.errors import UsageError

        mb = CHUNK_MB if chunk_mb is None else chunk_mb
        n = STREAMS if streams is None else streams
        if not mb > 0:
            raise UsageError(f"chunk_mb={chunk_mb!r}: a positive number of MiB")
        if not isinstance(n, int) or n < 1:
            raise UsageError(f"streams={streams!r}: a positive integer")
        return Staging(max(1, int(mb * (1 << 20))), n)


class CudaCopier:
    """Pinned buffers, one CUDA stream and event per buffer."""

    def __init__(self, device: Any, streams: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(streams)]
        self.events: List[Any] = [None] * streams

    def buffer(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.torch.uint8, pin_memory=True)

    def wait(self, slot: int) -> None:
        if self.events[slot] is not None:
            self.events[slot].synchronize()

    def copy(self, slot: int, pairs: Sequence[Tuple[Any, Any]]) -> None:
        stream = self.streams[slot]
        with self.torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = self.torch.cuda.Event()
            event.record(stream)
        self.events[slot] = event

    def finish(self) -> None:
        for s in self.streams:
            s.synchronize()


class HostCopier:
    """The same pipeline into host memory (plain buffers, copies done at once): what
    the CPU tests run in place of the device copy. Counts the buffer bytes it was asked
    for, which the tests bound."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.buffer_bytes = 0
        self.copies = 0

    def buffer(self, n: int) -> Any:
        self.buffer_bytes += n
        return self.torch.empty(n, dtype=self.torch.uint8)

    def wait(self, slot: int) -> None:
        pass

    def copy(self, slot: int, pairs: Sequence[Tuple[Any, Any]]) -> None:
        for dst, src in pairs:
            dst.copy_(src)
            self.copies += 1

    def finish(self) -> None:
        pass


def byte_view(t: Any) -> Any:
    """The bytes of contiguous tensor ``t``, as a flat ``uint8`` tensor on its device."""
    import torch

    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def fill_through_buffers(
    plan: Any, dests: Dict[int, Any], staging: Staging, copier: Any
) -> None:
    """Fills the contiguous tensors ``dests`` (plan index -> tensor, on one device) with
    their plan entries through ``staging.streams`` buffers of at most one chunk."""
    if not dests:
        return
    views = {i: byte_view(t) for i, t in dests.items()}
    chunks = plan.chunks(list(dests), staging.chunk_bytes, min(PART_BYTES, staging.chunk_bytes))
    if len(chunks) == 0:
        return
    size = chunks.buffer_bytes()
    buffers = [copier.buffer(size) for _ in range(min(staging.streams, len(chunks)))]
    for k in range(len(chunks)):
        slot = k % len(buffers)
        copier.wait(slot)
        buf = buffers[slot]
        chunks.fill(k, buf.data_ptr(), size)
        copier.copy(
            slot,
            [(views[i][off : off + n], buf[at : at + n]) for i, off, n, at in chunks.layout(k)],
        )
    copier.finish()


def copier_for(device: Any, staging: Staging) -> Any:
    import torch

    if torch.device(device).type == "cuda":
        return CudaCopier(device, staging.streams)
    return HostCopier()
