"""read_rows: the rows of a global tensor from whichever shards (boxes) meet them, for any sharding, touching
only the boxes that do (an export reads a tensor a slab at a time)."""

from __future__ import annotations

import numpy as np
import pytest

from deltackpt.interop.layout import Box, TensorLayout, read_rows, slabs
from deltackpt.store import Item


class _Reader:
    """Serves each item's bytes from a dict and counts the reads."""

    def __init__(self, data: dict[str, np.ndarray]):
        self.data, self.reads = data, 0

    def read_into(self, key, out, offset):
        self.reads += 1
        out[:] = self.data[key][offset:offset + len(out)]

    def read(self, key, offset, length):
        self.reads += 1
        return self.data[key][offset:offset + length]


def _layout(full: np.ndarray, grid: tuple[int, int]) -> tuple[TensorLayout, _Reader]:
    """``full`` (2-D float32) cut into a grid of boxes: (R, 1) are byte ranges of the whole tensor (contiguous
    boxes, placed by their global offset), others are blocks (rows and columns)."""
    rows, cols = full.shape
    t = TensorLayout("w", "float32", 4, full.shape)
    data = {}
    rcuts = np.linspace(0, rows, grid[0] + 1).astype(int)
    ccuts = np.linspace(0, cols, grid[1] + 1).astype(int)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r0, r1, c0, c1 = rcuts[i], rcuts[i + 1], ccuts[j], ccuts[j + 1]
            block = np.ascontiguousarray(full[r0:r1, c0:c1]).view(np.uint8).reshape(-1)
            key = f"w@{r0},{c0}"
            data[key] = block
            contiguous = grid[1] == 1
            item = Item(key=key, kind="array", nbytes=len(block), chunks=[], dtype="float32", elem_size=4,
                        shape=[int(r1 - r0), int(c1 - c0)], group="w",
                        global_offset=int(r0 * cols * 4) if contiguous else 0)
            t.boxes.append(Box((int(r0), int(c0)), (int(r1 - r0), int(c1 - c0)), item, contiguous))
    return t, _Reader(data)


@pytest.mark.parametrize("grid", [(1, 1), (7, 1), (50, 1), (1, 5), (6, 4), (300, 1)])
def test_rows_of_any_sharding_come_back_exactly(grid):
    rng = np.random.default_rng(sum(grid))
    full = rng.standard_normal((300, 12)).astype(np.float32)
    t, reader = _layout(full, grid)
    for r0, r1 in [(0, 300), (0, 1), (299, 300), (17, 18), (5, 211), *((a, min(a + 37, 300)) for a in range(0, 300, 37))]:
        got = read_rows(reader, t, r0, r1).view(np.float32).reshape(r1 - r0, 12)
        assert np.array_equal(got, full[r0:r1]), (grid, r0, r1)


def test_a_slab_reads_only_the_boxes_that_meet_it():
    """Row-sharded over R boxes and read a slab of 2 rows at a time: about R + slabs reads, not R x slabs
    (each box was looked at for every slab: quadratic in the ranks)."""
    full = np.arange(2000 * 3, dtype=np.float32).reshape(2000, 3)
    t, reader = _layout(full, (1000, 1))
    looked = []
    boxes_over = t.boxes_over
    t.boxes_over = lambda r0, r1: looked.append(len(boxes_over(r0, r1))) or boxes_over(r0, r1)
    out = [read_rows(reader, t, r0, r1) for r0, r1 in slabs(t, max_bytes=2 * 3 * 4 * 5)]
    assert np.array_equal(np.concatenate(out).view(np.float32).reshape(2000, 3), full)
    assert max(looked) <= 6 and sum(looked) <= 1000 + len(out) * 2
