"""A weight source's one slicing rule (no torch): what every source (safetensors, GGUF) checks a row or column
range against before it reads. Apart from cpllm/model/loaders/loader.py so that the sources, which the loader opens,
import nothing from it."""

from __future__ import annotations


def resolve_slice(
    name: str, shape: tuple[int, ...], dim: int | None, start: int, end: int | None
) -> tuple[int, int, int] | None:
    """Check a slice request against the tensor's shape.

    Returns (dim, start, end) with `end` filled in, or None when the whole
    tensor was asked for (dim is None, or the slice covers the full dimension).
    """
    if dim is None:
        if start != 0 or end is not None:
            raise ValueError(f"{name}: start={start}, end={end} given without dim")
        return None
    if not 0 <= dim < len(shape):
        raise ValueError(f"{name}: dim={dim} is out of range for a tensor of shape {tuple(shape)}")
    size = shape[dim]
    stop = size if end is None else end
    if not 0 <= start <= stop <= size:
        raise ValueError(
            f"{name}: slice [{start}:{end}) along dim {dim} is out of range; the dimension has {size} entries"
        )
    if start == 0 and stop == size:
        return None
    return dim, start, stop
