"""Host-side checkpoint parts as data only: a tree of containers, scalars and numpy arrays in one `.npz` file.

A checkpoint is something a user downloads, copies and hands to `--resume`; a pickle in it runs any code it names
when read. This format cannot: the arrays are read with `np.load(allow_pickle=False)` (an object array or a
pickle is refused) and the structure is JSON, rebuilt from a closed set of tags:

    null, bool, int, float, str     as JSON
    {"l": [...]} / {"t": [...]}     list / tuple (a NamedTuple is written as a tuple; the reader rebuilds its type)
    {"d": [[key, value], ...]}      dict with any of these as keys (int keys stay ints)
    {"b": "<base64>"}               bytes
    {"a": i, "dtype": name}         array i of the file ("__tree__" holds the JSON); "s": 1 marks a numpy scalar

Arrays of dtypes numpy cannot store (bfloat16 and the other ml_dtypes) are stored as unsigned words of the same
width and viewed back, so every array round-trips bit for bit. Costs one copy of the arrays (numpy's zip writer).
"""

from __future__ import annotations

import base64
import io
import json

import ml_dtypes
import numpy as np

from twocircuit_jax.model.hf_io import CheckpointError

_TREE = "__tree__"


class BlobError(CheckpointError):
    """A checkpoint part that is not in this format (a pickle, an object array, a malformed tree); the message
    names the file."""


def _dtype(name: str) -> np.dtype:
    if hasattr(ml_dtypes, name) and name not in ("finfo", "iinfo"):
        return np.dtype(getattr(ml_dtypes, name))
    dt = np.dtype(name)
    if dt.hasobject or dt.kind == "V":
        raise ValueError(f"dtype {name!r} is not a plain numeric type")
    return dt


def dumps(tree) -> bytes:
    """`tree` as .npz bytes; TypeError (naming the path) for anything outside the supported types."""
    arrays = {}

    def enc(x, path):
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, (int, float)) and not isinstance(x, (np.generic,)):
            return x
        if isinstance(x, bytes):
            return {"b": base64.b64encode(x).decode("ascii")}
        if isinstance(x, dict):
            return {"d": [[enc(k, f"{path}.<key>"), enc(v, f"{path}[{k!r}]")] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"t": [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return {"l": [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        scalar = isinstance(x, np.generic)
        if scalar or isinstance(x, np.ndarray) or hasattr(x, "__array__"):
            a = np.asarray(x)
            if a.dtype.hasobject:
                raise TypeError(f"{path}: object array cannot be stored without pickle")
            name = str(a.dtype)
            _dtype(name)  # refuses structured/void dtypes now, not at load
            if a.dtype.kind == "V" or hasattr(ml_dtypes, name):  # ml_dtypes: store the raw words
                a = a.view(f"u{a.dtype.itemsize}")
            key = f"a{len(arrays)}"
            arrays[key] = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
            return {"a": key, "dtype": name, **({"s": 1} if scalar else {})}
        raise TypeError(f"{path}: {type(x).__name__} cannot be stored in a checkpoint part (data only)")

    tree_json = json.dumps(enc(tree, "blob"))
    buf = io.BytesIO()
    np.savez(buf, **{_TREE: np.frombuffer(tree_json.encode(), np.uint8)}, **arrays)
    return buf.getvalue()


def loads(data: bytes, where: str):
    """The tree of `dumps`; BlobError naming `where` when `data` is anything else. Never unpickles."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            files = {k: z[k] for k in z.files}
        tree = json.loads(bytes(files.pop(_TREE)).decode())
    except Exception as e:  # noqa: BLE001 - a pickle, a truncated zip, an object array: all one answer
        raise BlobError(f"{where}: not a data-only checkpoint part ({type(e).__name__}: {e})") from None

    def dec(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, dict) and len(x) == 1:
            ((tag, v),) = x.items()
            if tag == "l":
                return [dec(i) for i in v]
            if tag == "t":
                return tuple(dec(i) for i in v)
            if tag == "d":
                return {_key(dec(k)): dec(val) for k, val in v}
            if tag == "b":
                return base64.b64decode(v)
        if isinstance(x, dict) and "a" in x and "dtype" in x:
            a = files[x["a"]]
            dt = _dtype(x["dtype"])
            if a.dtype != dt:
                a = a.view(dt)
            return a[()] if x.get("s") else a
        raise ValueError(f"unknown node {str(x)[:80]}")

    try:
        return dec(tree)
    except (ValueError, KeyError, TypeError) as e:
        raise BlobError(f"{where}: malformed checkpoint part ({type(e).__name__}: {e})") from None


def _key(k):
    return tuple(k) if isinstance(k, list) else k
