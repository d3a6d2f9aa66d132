"""The exceptions of ckpt: one class per kind of problem, each carrying the message the
``ckpt`` command prints (file, tensor, problem).

They are plain Python classes so that they pickle (across ``multiprocessing`` and
``torch.multiprocessing`` workers) like any built-in exception.

Where a standard exception means the same thing, ckpt's class is also that one, so
code written for the standard library catches it:

- :class:`PathNotFound` (a path given, or a file a checkpoint names, that does not
  exist) is a :class:`MissingData` and a :class:`FileNotFoundError`;
- :class:`UsageError` (arguments that do not make sense) is a :class:`ValueError`;
- :class:`OutputExists` is a :class:`FileExistsError`.
"""

from __future__ import annotations

import errno

__all__ = [
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


class CheckpointError(Exception):
    """Base class of every error ckpt raises. ``str(e)`` is the CLI's message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # keep the class and message through pickle
        return (type(self), (self.message,))


class MissingData(CheckpointError):
    """Elements, tensors, ranks or files are missing (a rank's file deleted, a tensor the
    state dict has and the checkpoint lacks, a path that does not exist)."""


class PathNotFound(MissingData, FileNotFoundError):
    """A path that does not exist: an input given to ckpt, or a file a checkpoint names
    (a shard of a Hugging Face index, a rank's file). Also a :class:`FileNotFoundError`
    (``errno`` is ``ENOENT``; ``filename`` is the path when ckpt knows it)."""

    def __init__(self, message: str, filename: "str | None" = None) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT
        self.strerror = message
        self.filename = filename

    def __str__(self) -> str:  # the message, as every ckpt error (not OSError's form)
        return self.message

    def __reduce__(self):
        return (type(self), (self.message, self.filename))


class ChecksumMismatch(CheckpointError):
    """Bytes do not match the checksum recorded for them: the file is damaged."""


class AmbiguousInput(CheckpointError):
    """Several files hold a tensor and nothing says how their parts fit together; give
    the strategy (``source_strategy=``) or fewer inputs."""


class UsageError(CheckpointError, ValueError):
    """Arguments that do not make sense (the CLI's exit code 2)."""


class InvalidInput(CheckpointError):
    """A malformed or inconsistent file: bad header, overlapping pieces, bad strategy."""


class Mismatch(CheckpointError):
    """Two things that must agree do not (shapes, dtypes, world sizes); the message
    names the tensor and both values."""


class Unsupported(CheckpointError):
    """A conversion or layout ckpt does not do (e.g. casting an integer tensor)."""


class OutputExists(CheckpointError, FileExistsError):
    """The output already exists (pass ``force=True`` to replace it)."""


_PRIORITY = (ChecksumMismatch, PathNotFound, MissingData, AmbiguousInput)


def _raise_problems(problems: list) -> None:
    """Raises one exception for several problems: the most telling class among them
    (damage, then missing data, then ambiguity, else the first one's), every message."""
    if not problems:
        return
    cls = next(
        (c for c in _PRIORITY if any(isinstance(p, c) for p in problems)),
        type(problems[0]),
    )
    raise cls("\n".join(str(p) for p in problems))
