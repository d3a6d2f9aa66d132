"""The non-tensor part of a state dict (optimizer ``param_groups``, LR scheduler state,
step counters, what ``Stateful`` objects return that is not a tensor), as the file
``non_tensor_state.json`` beside the rank directories of a checkpoint
``ckpt.torch.save_state_dict`` wrote. Private; the format is documented in
python/README.md ("Non-tensor state").

The file is JSON, read with ``json.loads`` and a fixed set of tags: loading it runs no
code of the file's (unlike DCP's pickled entries). The document::

    {"format": "ckpt non-tensor state", "version": 1,
     "values": {"<dotted name>": <value>, ...}}

A value is ``null``, ``true``/``false``, an integer, a finite float, a string, a list,
or an object; an object with exactly one key starting with ``$`` is a tagged value:

- ``{"$float": "nan" | "inf" | "-inf"}``: a float JSON cannot write;
- ``{"$tuple": [...]}``: a tuple;
- ``{"$dict": [[key, value], ...]}``: a dict whose keys are not all strings (int keys,
  as an optimizer's ``state``), or whose only key starts with ``$``;
- ``{"$bytes": "<base64>"}``: bytes;
- ``{"$torch.dtype": "float32"}``, ``{"$torch.Size": [2, 3]}``,
  ``{"$torch.device": "cuda:0"}``.

Anything else is refused when saving (naming the entry and its type), never pickled.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any, Dict

from ckpt.errors import InvalidInput, Unsupported

FILE = "non_tensor_state.json"
FORMAT = "ckpt non-tensor state"
VERSION = 1


def encode(value: Any, name: str) -> Any:
    """``value`` as JSON-ready data (see the module's description); ``name`` for errors."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    torch = _torch()
    if torch is not None:
        if isinstance(value, torch.dtype):
            return {"$torch.dtype": str(value).replace("torch.", "")}
        if isinstance(value, torch.Size):
            return {"$torch.Size": [int(d) for d in value]}
        if isinstance(value, torch.device):
            return {"$torch.device": str(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, f"{name}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{name}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        keys = list(value)
        plain = all(isinstance(k, str) for k in keys) and not (
            len(keys) == 1 and keys[0].startswith("$")
        )
        if plain:
            return {k: encode(v, f"{name}.{k}") for k, v in value.items()}
        return {
            "$dict": [[encode(k, f"{name} (a key)"), encode(v, f"{name}.{k}")] for k, v in value.items()]
        }
    raise Unsupported(
        f"state dict entry `{name}`: a {type(value).__module__}.{type(value).__qualname__} "
        f"is neither a tensor nor a value ckpt stores (None, bool, int, float, str, bytes, "
        f"list, tuple, dict, torch.dtype/Size/device): ckpt never pickles; store it as one "
        f"of those, or give its object state_dict()/load_state_dict()"
    )


def decode(data: Any, where: str) -> Any:
    """The value :func:`encode` gave ``data`` for; ``where`` names it in errors."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, where) for v in data]
    if not isinstance(data, dict):
        raise InvalidInput(f"{where}: unexpected JSON value {data!r}")
    if len(data) == 1:
        (tag, v), = data.items()
        if tag.startswith("$"):
            return _tagged(tag, v, where)
    return {k: decode(v, where) for k, v in data.items()}


def _tagged(tag: str, v: Any, where: str) -> Any:
    try:
        if tag == "$float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if tag == "$tuple" and isinstance(v, list):
            return tuple(decode(x, where) for x in v)
        if tag == "$dict" and isinstance(v, list):
            out = {}
            for pair in v:
                k, x = pair
                k = decode(k, where)
                if isinstance(k, list):
                    raise TypeError("a list is no dict key")
                out[k] = decode(x, where)
            return out
        if tag == "$bytes" and isinstance(v, str):
            return base64.b64decode(v.encode("ascii"), validate=True)
        torch = _torch()
        if torch is not None:
            if tag == "$torch.dtype" and isinstance(v, str):
                d = getattr(torch, v, None)
                if isinstance(d, torch.dtype):
                    return d
            elif tag == "$torch.Size" and isinstance(v, list) and all(isinstance(x, int) for x in v):
                return torch.Size(v)
            elif tag == "$torch.device" and isinstance(v, str):
                return torch.device(v)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidInput(f"{where}: bad {tag} value {v!r}: {e}") from None
    raise InvalidInput(f"{where}: unknown or malformed tagged value {{{tag!r}: {v!r}}}")


def dumps(values: Dict[str, Any]) -> str:
    """The file's text for already :func:`encode`-d ``values`` (strict JSON), one value
    a line."""
    head = json.dumps({"format": FORMAT, "version": VERSION})[:-1]
    lines = [
        f" {json.dumps(k, ensure_ascii=False)}: {json.dumps(v, allow_nan=False, ensure_ascii=False)}"
        for k, v in values.items()
    ]
    return head + ', "values": {\n' + ",\n".join(lines) + "\n}}\n"


def loads(text: str, path: str) -> Dict[str, Any]:
    """dotted name -> encoded value, from the file's text (checked; not decoded)."""

    def no_constants(c):
        raise ValueError(f"{c} is not JSON")

    try:
        doc = json.loads(text, parse_constant=no_constants)
    except ValueError as e:
        raise InvalidInput(f"{path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("values"), dict):
        raise InvalidInput(f"{path}: not a ckpt non-tensor state file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise InvalidInput(f"{path}: version {doc.get('version')!r}; this ckpt reads version {VERSION}")
    return doc["values"]


def _torch():
    import sys

    return sys.modules.get("torch")
