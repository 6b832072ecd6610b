"""Scatter the per-member batches of a :class:`~feedpipe.datasets.mixed.MixedDataset` into one.

Each part is ``(positions, batch)``: the rows of ``batch`` (a collated batch of one member) go to
``positions`` of the merged batch. Tensors are scattered with one indexed copy per leaf and
part; per-sample lists (strings, records of varying size) are interleaved. Every member must give
the same structure, dtypes and trailing shapes: a mismatch is a ``DatasetError`` naming the two
members, never a silent cast.

The fast path, :func:`read_members`, is for members whose batches are tensors or dicts of
tensors (every fixed-record feedpipe dataset): each member reads its rows with
``read_batch(rows, out=...)`` straight into a per-thread buffer that is reused from batch to batch,
in member order (a fresh buffer per batch is faulted in page by page, which costs as much as
the read); then one ``np.take`` per tensor puts the rows in the sampler's order, into ``out`` or
a new tensor. A member that ignores ``out`` is copied into the buffer; one whose batch has
another structure sends the whole batch to :func:`merge_parts`, with the parts already read.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from feedpipe.errors import DatasetError

__all__ = ["fill_out", "merge_parts", "read_members"]

# {leaf key (None: the batch is one tensor): (dtype, shape per sample)}, in the batch's key order
_Spec = tuple[tuple[Any, torch.dtype, tuple[int, ...]], ...]
_Read = Callable[[Any, np.ndarray, Any], Any]
_PAGE = 4096


def read_members(  # noqa: PLR0917 - internal
    members: list[tuple[Any, np.ndarray]],
    names: list[str],
    order: np.ndarray,
    tls: threading.local,
    read: _Read,
    out: Any = None,
) -> Any:
    """The batch whose rows ``order[a:b]`` are ``read(member, rows, dest)`` of each member.

    ``members`` are ``(dataset, rows)`` in the order of ``order``'s groups: member ``i``'s
    batch holds the positions ``order[a_i:b_i]`` of the merged batch, ``b_i - a_i == len(rows)``.
    """
    n = len(order)
    known: dict[int, _Spec | None] = tls.__dict__.setdefault("specs", {})  # last batch's
    spec: _Spec | None = None
    bufs: dict[Any, torch.Tensor] | None = None
    parts: list[tuple[np.ndarray, Any]] = []
    a = 0
    for ds, rows in members:
        b = a + len(rows)
        mine = known.get(id(ds))
        if not parts and mine is not None:  # the first member's structure sets the buffers'
            spec, bufs = mine, _buffers(tls, mine, n)
        batch = None
        if bufs is not None and mine == spec and _takes_out(tls, ds):
            try:
                batch = read(ds, rows, _views(bufs, a, b))
            except ValueError:  # it cannot fill this out after all: read it as it is
                tls.takes_out[id(ds)] = False
        if batch is None:
            batch = read(ds, rows, None)
        got = known[id(ds)] = _spec(batch, b - a)
        if not parts and bufs is None and got is not None:
            spec, bufs = got, _buffers(tls, got, n)
        if bufs is not None and not _landed(batch, got, spec, bufs, a, b):
            bufs = None  # another structure: merge_parts raises or interleaves
        parts.append((order[a:b], batch))
        a = b
    if bufs is None or spec is None:
        return merge_parts(parts, n, names, out)
    inv = np.empty_like(order)
    inv[order] = np.arange(n)  # merged row p is buffer row inv[p]
    dests: Mapping[Any, Any] = out if isinstance(out, Mapping) else {}
    merged = {
        key: _permute(bufs[key], inv, out if key is None else dests.get(key), key)
        for key, _, _ in spec
    }
    return merged[None] if spec[0][0] is None else merged


def _spec(batch: Any, rows: int) -> _Spec | None:
    """The structure of a batch of plain CPU tensors of ``rows`` rows; ``None`` for another."""
    items = [(None, batch)] if isinstance(batch, torch.Tensor) else None
    if type(batch) is dict:
        items = list(batch.items())
    if not items:
        return None
    for _, t in items:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.ndim == 0:
            return None
        if t.shape[0] != rows or t.is_quantized or t.is_sparse:
            return None
    return tuple((k, t.dtype, tuple(t.shape[1:])) for k, t in items)


def _buffers(tls: threading.local, spec: _Spec, n: int) -> dict[Any, torch.Tensor]:
    """This thread's reused buffers of ``n`` rows for ``spec``, one per leaf."""
    raw: dict[Any, torch.Tensor] = tls.__dict__.setdefault("raw", {})
    bufs = {}
    for key, dtype, shape in spec:
        size = dtype.itemsize * n
        for d in shape:
            size *= d
        buf = raw.get(key)
        if buf is None or buf.numel() < size:
            buf = raw[key] = torch.from_numpy(_aligned(size, _PAGE // 2))
        bufs[key] = buf[:size].view(dtype).view(n, *shape) if size else _empty((n, *shape), dtype)
    return bufs


def _views(bufs: dict[Any, torch.Tensor], a: int, b: int) -> Any:
    if None in bufs:
        return bufs[None][a:b]
    return {k: v[a:b] for k, v in bufs.items()}


def _takes_out(tls: threading.local, ds: Any) -> bool:
    """Whether ``ds.read_batch`` has an ``out`` parameter (cached per thread and member)."""
    known: dict[int, bool] = tls.__dict__.setdefault("takes_out", {})
    got = known.get(id(ds))
    if got is None:
        got = False
        read = getattr(ds, "read_batch", None)
        if callable(read):
            try:
                params = inspect.signature(read).parameters
            except (TypeError, ValueError):
                params = {}  # type: ignore[assignment]
            got = "out" in params or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
            )
        known[id(ds)] = got
    return got


def _landed(  # noqa: PLR0917 - internal
    batch: Any, got: _Spec | None, spec: _Spec | None, bufs: dict[Any, torch.Tensor], a: int, b: int
) -> bool:
    """Whether ``batch`` (of structure ``got``) is now in rows ``a:b`` of ``bufs`` (copied
    there when it was not read there)."""
    if spec is None or got != spec:
        return False
    for key, buf in bufs.items():
        leaf: torch.Tensor = batch if key is None else batch[key]
        want = buf[a:b]
        if leaf.data_ptr() != want.data_ptr() or leaf.stride() != want.stride():
            want.copy_(leaf)
    return True


def _permute(src: torch.Tensor, inv: np.ndarray, out: Any, key: Any) -> torch.Tensor:
    """``src[inv]`` into ``out`` (or a new tensor): one row gather."""
    where = "batch" if key is None else f"batch[{key!r}]"
    n = len(inv)
    dest = _dest(src, n, out, where)
    row = src[0].numel() * src.element_size() if n else 0
    if dest.device.type == "cpu" and dest.is_contiguous() and row:
        whole = np.dtype((np.void, row))  # a row is one item: np.take copies it in one memcpy
        rows = dest.view(n, -1).view(torch.uint8).numpy().view(whole).reshape(n)
        src_rows = src.view(n, -1).view(torch.uint8).numpy().view(whole).reshape(n)
        np.take(src_rows, inv, out=rows, mode="clip")  # "raise" would buffer ``out``
    else:
        dest.copy_(src[torch.from_numpy(inv)])
    return dest


def merge_parts(
    parts: list[tuple[np.ndarray, Any]], n: int, names: list[str], out: Any = None
) -> Any:
    """The batch of ``n`` rows made of ``parts`` (positions, member batch); into ``out``."""
    return _merge([p for _, p in parts], [pos for pos, _ in parts], n, names, out, "batch")


def fill_out(batch: Any, out: Any) -> Any:
    """Copy ``batch`` into the first rows of ``out`` and return views of ``out``."""
    n = _rows(batch)
    if n is None:
        return batch
    return _merge([batch], [np.arange(n, dtype=np.int64)], n, ["member"], out, "batch")


def _rows(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, Mapping):
        for v in batch.values():
            r = _rows(v)
            if r is not None:
                return r
    if isinstance(batch, (list, tuple)):
        for v in batch:
            r = _rows(v)
            if r is not None:
                return r
    return None


def _mismatch(names: list[str], where: str, what: str) -> DatasetError:
    return DatasetError(
        f"MixedDataset: members {names[0]!r} and {names[-1]!r} give different batches at "
        f"{where}: {what}"
    )


def _merge(  # noqa: PLR0917 - internal recursion
    values: list[Any], positions: list[np.ndarray], n: int, names: list[str], out: Any, where: str
) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return _merge_tensors(values, positions, n, names, out, where)
    if isinstance(first, Mapping):
        for v in values[1:]:
            if not isinstance(v, Mapping) or list(v) != list(first):
                raise _mismatch(names, where, f"keys {list(first)} and {_keys(v)}")
        dests: Mapping[Any, Any] = out if isinstance(out, Mapping) else {}
        fields = {
            k: _merge([v[k] for v in values], positions, n, names, dests.get(k), f"{where}[{k!r}]")
            for k in first
        }
        return fields if type(first) is dict else type(first)(fields)  # type: ignore[call-arg]
    if isinstance(first, (list, tuple)):
        if _is_fields(values, positions):
            width = len(first)
            sub: Any = (
                out if isinstance(out, (list, tuple)) and len(out) == width else [None] * width
            )
            items = [
                _merge([v[i] for v in values], positions, n, names, sub[i], f"{where}[{i}]")
                for i in range(width)
            ]
            if isinstance(first, tuple) and hasattr(first, "_fields"):
                return type(first)(*items)
            return type(first)(items)
        merged: list[Any] = [None] * n
        for v, pos in zip(values, positions, strict=True):
            if len(v) != len(pos):
                raise _mismatch(names, where, f"a list of {len(v)} for {len(pos)} samples")
            for p, item in zip(pos.tolist(), v, strict=True):
                merged[p] = item
        return merged
    raise _mismatch(names, where, f"cannot merge a {type(first).__name__}")


def _keys(v: Any) -> Any:
    return list(v) if isinstance(v, Mapping) else type(v).__name__


def _is_fields(values: list[Any], positions: list[np.ndarray]) -> bool:
    """A list of collated fields (default_collate of tuple samples), not a per-sample list."""
    width = len(values[0])
    for v, pos in zip(values, positions, strict=True):
        if not isinstance(v, (list, tuple)) or len(v) != width:
            return False
        for item in v:
            if isinstance(item, torch.Tensor):
                if item.ndim == 0 or item.shape[0] != len(pos):
                    return False
            elif not isinstance(item, (Mapping, list, tuple)):
                return False
    return True


def _dest(first: torch.Tensor, n: int, out: Any, where: str) -> torch.Tensor:
    """``out[:n]`` after checking it can hold ``n`` rows like ``first``; a new tensor without."""
    shape = (n, *first.shape[1:])
    if out is None:
        return _empty(shape, first.dtype)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out{where[5:]}: expected a tensor, got {type(out).__name__}")
    if out.dtype != first.dtype or out.ndim != len(shape) or out.shape[1:] != shape[1:]:
        raise ValueError(
            f"out{where[5:]}: {out.dtype} {tuple(out.shape)} cannot hold {first.dtype} {shape}"
        )
    if out.shape[0] < n:
        raise ValueError(f"out{where[5:]}: {out.shape[0]} rows, the batch has {n}")
    return out[:n]


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``, page-aligned, from numpy's allocator (torch's
    returns a large block to the system when freed, so the next batch's is faulted in page by
    page; the alignment is :func:`_aligned`'s)."""
    size = dtype.itemsize
    for d in shape:
        size *= d
    if not size:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(_aligned(size, 0)).view(dtype).view(shape)


def _aligned(size: int, phase: int) -> np.ndarray:
    """``size`` bytes whose address is ``phase`` modulo 4096.

    A copy whose destination lies just after its source modulo 4096 bytes runs several times
    slower on common x86 CPUs (4K aliasing), and the malloc-returned addresses sit 16 bytes
    past a page. Source rows read from a page-aligned map, the staging buffer at ``phase``
    2048 and the batch at 0 keep both copies of this module half a page apart.
    """
    raw = np.empty(size + _PAGE, np.uint8)
    start = (phase - raw.ctypes.data) % _PAGE
    return raw[start : start + size]


def _merge_tensors(  # noqa: PLR0917 - internal
    values: list[Any], positions: list[np.ndarray], n: int, names: list[str], out: Any, where: str
) -> torch.Tensor:
    first = values[0]
    for v, pos in zip(values, positions, strict=True):
        if not isinstance(v, torch.Tensor):
            raise _mismatch(names, where, f"a tensor and a {type(v).__name__}")
        if v.dtype != first.dtype or v.shape[1:] != first.shape[1:]:
            raise _mismatch(
                names,
                where,
                f"{first.dtype} {tuple(first.shape[1:])} and {v.dtype} {tuple(v.shape[1:])} "
                "per sample",
            )
        if v.ndim == 0 or v.shape[0] != len(pos):
            raise _mismatch(names, where, f"{tuple(v.shape)} for {len(pos)} samples")
    dest = _dest(first, n, out, where)
    if len(values) == 1:
        dest.copy_(values[0])
        return dest
    if dest.device.type != "cpu" or not dest.is_contiguous() or dest.dtype == torch.bfloat16:
        for v, pos in zip(values, positions, strict=True):
            dest[torch.from_numpy(pos)] = v.to(dest.device)
        return dest
    flat = dest.view(n, -1).numpy() if n and dest[0].numel() else None
    for v, pos in zip(values, positions, strict=True):  # numpy: one single-threaded scatter
        if flat is not None and len(pos):
            flat[pos] = v.reshape(len(pos), -1).numpy(force=True)
    return dest
