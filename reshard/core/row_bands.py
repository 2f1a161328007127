"""Bands of rows of a tensor's outputs, made from its bytes as a producer streams them.

A fused linear weight becomes its several output weights by byte runs: one output's rows after
another's, or the rows of several outputs interleaved group by group (a group's rows of the first
output, then of the second, then of the third). An encoder that quantizes a band of rows at a time
(FP8 blocks, compressed-tensors' codecs) needs only the band: :class:`RowBandSink` takes the
producer's bytes in the order they come, copies each into the band buffer of the output its run
names, and hands a band on the moment it is full. So neither the source tensor nor any output is
ever whole in memory: one band buffer per output, reused band after band.

    ======================  ===========================  ===========================
    what                    shape                        memory held
    ======================  ===========================  ===========================
    source (streamed)       ``[sum out_i, in]``          the producer's chunk
    band buffer of ``i``    ``[band_rows_i, in]``        one per output
    band handed on          ``[n <= band_rows_i, in]``   a view of the buffer
    ======================  ===========================  ===========================

This holds where every output's runs, taken in source order, fill it front to back (each output's
rows come in order, as in both layouts above); :func:`in_order` says whether they do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from reshard.core.torch_writer import RecordSink, WriterError, as_bytes, tensor_bytes

#: A byte run ``(src, length, out, dst)``: ``length`` bytes at ``src`` of the source are bytes ``dst
#: ..`` of output ``out``.
Run = tuple[int, int, int, int]


def in_order(runs: Sequence[Run], sizes: Sequence[int]) -> bool:
    """Do ``runs``, in source order, fill each output (of ``sizes`` bytes) front to back, each
    byte once? Then :class:`RowBandSink` can make its bands as the bytes stream."""
    filled = [0] * len(sizes)
    for _src, length, out, dst in sorted(runs):
        if not 0 <= out < len(sizes) or dst != filled[out]:
            return False
        filled[out] += length
    return filled == list(sizes)


class RowBandSink(RecordSink):
    """A source tensor's bytes, in order, made into bands of its outputs' rows: output ``i``
    (``shapes[i]``, 2-D, ``dtype``) in bands of ``band_rows[i]`` rows, each handed to ``on_band(i,
    first row, band)`` once full (the last may be shorter). ``band`` is a view of a buffer reused
    for the next band: ``on_band`` must not keep it. Bytes no run covers (padding) are dropped.
    ``runs`` must be :func:`in_order`."""

    def __init__(self, runs: Sequence[Run], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype,
                 band_rows: Sequence[int], on_band: Callable[[int, int, torch.Tensor], None], key: str = "") -> None:
        self.runs = sorted(runs)
        self.key = key
        self.on_band = on_band
        self.row_bytes = [(s[1] if len(s) > 1 else 1) * dtype.itemsize for s in shapes]
        self.rows = [int(s[0]) if s else 1 for s in shapes]
        if not in_order(self.runs, [r * b for r, b in zip(self.rows, self.row_bytes)]):
            raise WriterError(f"{key}: its byte runs do not fill its outputs in order")
        self.band_rows = [max(1, min(int(b), r)) for b, r in zip(band_rows, self.rows)]
        self.buffers = [torch.empty((b, s[1] if len(s) > 1 else 1), dtype=dtype)
                        for b, s in zip(self.band_rows, shapes)]
        self.views = [tensor_bytes(b) for b in self.buffers]
        self.first = [0] * len(shapes)  # the first row of each output's band being filled
        self.fill = [0] * len(shapes)  # bytes of it filled
        self.pos = 0
        self.next = 0

    def write(self, data: Any, release: Callable[[], None] | None = None, keep: Any = None) -> None:
        mv, _hold = as_bytes(data)
        lo, hi = self.pos, self.pos + len(mv)
        i = self.next
        while i < len(self.runs) and self.runs[i][0] < hi:
            src, length, out, _dst = self.runs[i]
            a, b = max(lo, src), min(hi, src + length)
            if a < b:
                self._take(out, mv[a - lo:b - lo])
            if src + length <= hi:
                self.next = i + 1
            i += 1
        self.pos = hi
        if release is not None:
            release()

    def _take(self, out: int, piece: memoryview) -> None:
        """Append ``piece`` to output ``out``'s band, handing on each band it completes."""
        view = self.views[out]
        while len(piece):
            room = self.band_rows[out] * self.row_bytes[out] - self.fill[out]
            room = min(room, (self.rows[out] - self.first[out]) * self.row_bytes[out] - self.fill[out])
            if room <= 0:
                raise WriterError(f"{self.key or 'a tensor'}: more bytes for output {out} than it holds")
            n = min(room, len(piece))
            view[self.fill[out]:self.fill[out] + n] = piece[:n]
            self.fill[out] += n
            piece = piece[n:]
            if n == room:
                self._hand_on(out)

    def _hand_on(self, out: int) -> None:
        n = self.fill[out] // self.row_bytes[out]
        self.on_band(out, self.first[out], self.buffers[out][:n])
        self.first[out] += n
        self.fill[out] = 0

    def finish(self, expected: int) -> None:
        """Check the producer wrote ``expected`` bytes and every output was handed on whole."""
        if self.pos != expected or self.first != self.rows or any(self.fill):
            raise WriterError(f"producer of {self.key or 'a tensor'} wrote {self.pos} of {expected} bytes")
