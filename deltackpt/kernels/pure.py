"""pure: the numpy kernels, byte-identical to the C ones in ``native/`` (the fallback backend's raw kernels).

Each takes 1-D uint8 arrays and writes a preallocated, non-overlapping ``out``, as the C kernels do; the
checks are :class:`~.impl.Impl`'s. FastCDC's gear table (:data:`GEAR`) is shared with the C code's.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from .arguments import ELEM_SIZES

_U64 = (1 << 64) - 1
_UINTS = {k: np.dtype(f"<u{k}") for k in ELEM_SIZES}  # element bit patterns, little-endian
_SINTS = {k: np.dtype(f"<i{k}") for k in ELEM_SIZES}


def _top_bits(nbits: int) -> int:
    if nbits <= 0:
        return 0
    return ((1 << nbits) - 1) << (64 - nbits)


def _gear_table() -> np.ndarray:
    state = 0x64656C7461636B70
    vals = []
    for _ in range(256):
        state = (state + 0x9E3779B97F4A7C15) & _U64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
        vals.append(z ^ (z >> 31))
    table = np.array(vals, dtype=np.uint64)
    table.flags.writeable = False
    return table


GEAR = _gear_table()


class NumpyRaw:
    """Pure numpy kernels (byte-identical to the C ones)."""

    # hash block: positions per vectorised pass (bounds memory to ~3 x 8 B x this)
    _HASH_BLOCK = 1 << 21

    @staticmethod
    def shuffle(src, k, out):
        n = src.nbytes // k
        m = n * k
        if k == 1 or n == 0:
            out[...] = src
            return
        out[:m].reshape(k, n)[...] = src[:m].reshape(n, k).T
        out[m:] = src[m:]

    @staticmethod
    def unshuffle(src, k, out):
        n = src.nbytes // k
        m = n * k
        if k == 1 or n == 0:
            out[...] = src
            return
        out[:m].reshape(n, k)[...] = src[:m].reshape(k, n).T
        out[m:] = src[m:]

    @classmethod
    def xor_shuffle(cls, a, b, k, out):
        cls.shuffle(np.bitwise_xor(a, b), k, out)

    @classmethod
    def unshuffle_xor(cls, planes, base, k, out):
        cls.unshuffle(planes, k, out)
        np.bitwise_xor(out, base, out=out)

    @classmethod
    def zigzag_shuffle(cls, a, b, k, out):
        m = a.nbytes // k * k
        d = a[:m].view(_UINTS[k]) - b[:m].view(_UINTS[k])  # modulo 2**(8k)
        z = (d << 1) ^ (d.view(_SINTS[k]) >> (8 * k - 1)).view(d.dtype)  # arithmetic shift: 0 or all ones
        tmp = np.empty_like(a)
        tmp[:m] = z.astype(_UINTS[k], copy=False).view(np.uint8)
        np.bitwise_xor(a[m:], b[m:], out=tmp[m:])
        cls.shuffle(tmp, k, out)

    @classmethod
    def sparse_apply(cls, bitmaps, vals, counts, dst, k, zigzag):
        n, b = dst.size // k, bitmaps.size // k
        planes = np.empty(n * k, dtype=np.uint8)
        for j in range(k):
            if int(counts[j]) > n:
                raise ValueError("sparse plane is damaged: its bitmap does not match its values")
            cls.sparse_merge(bitmaps[j * b:(j + 1) * b], vals[j * n:j * n + int(counts[j])], planes[j * n:(j + 1) * n])
        res = np.empty_like(dst)
        (cls.unshuffle_zigzag if zigzag else cls.unshuffle_xor)(planes, dst, k, res)
        dst[...] = res

    @classmethod
    def unshuffle_zigzag(cls, planes, base, k, out):
        cls.unshuffle(planes, k, out)
        m = out.nbytes // k * k
        z = out[:m].view(_UINTS[k])
        np.add(base[:m].view(_UINTS[k]), (z >> 1) ^ np.negative(z & 1), out=z)
        np.bitwise_xor(out[m:], base[m:], out=out[m:])

    @staticmethod
    def sparse_split(src, bitmap, vals):
        nz = src != 0
        bitmap[...] = np.packbits(nz, bitorder="little")
        v = src[nz]
        vals[:v.size] = v
        return v.size

    @staticmethod
    def sparse_merge(bitmap, vals, out):
        n = out.size
        bits = np.unpackbits(bitmap, bitorder="little")
        mask = bits[:n].view(bool)
        if bits[n:].any() or np.count_nonzero(mask) != vals.size or not vals.all():
            raise ValueError("sparse plane is damaged: its bitmap does not match its values")
        out[...] = 0
        out[mask] = vals

    @classmethod
    def _candidates(cls, d: np.ndarray, mask_s: int, mask_l: int):
        """Positions i whose windowed gear hash h_i satisfies (h_i & mask) == 0."""
        ms, ml = np.uint64(mask_s), np.uint64(mask_l)
        zero = np.uint64(0)
        out_s, out_l = [], []
        n = d.size
        step = cls._HASH_BLOCK
        for a in range(0, n, step):
            b = min(n, a + step)
            # g covers positions [a - 63, b); positions before 0 contribute 0
            ctx = min(a, 63)
            g = np.zeros(b - a + 63, dtype=np.uint64)
            g[63 - ctx:] = GEAR[d[a - ctx:b]]
            # doubling: S_{2m}[t] = S_m[t] + (S_m[t - m] << m); S_1 = g; S_64 = h
            tmp = np.empty_like(g)
            m = 1
            while m < 64:
                np.left_shift(g[:-m], np.uint64(m), out=tmp[m:])
                g[m:] += tmp[m:]
                m <<= 1
            h = g[63:]
            # mask_l's bits are a subset of mask_s's, so s-candidates are l-candidates
            idx_l = np.flatnonzero((h & ml) == zero)
            idx_s = idx_l[(h[idx_l] & ms) == zero]
            out_l.append(idx_l + a)
            out_s.append(idx_s + a)
        cand_s = np.concatenate(out_s) if out_s else np.empty(0, np.int64)
        cand_l = np.concatenate(out_l) if out_l else np.empty(0, np.int64)
        return cand_s.astype(np.int64, copy=False), cand_l.astype(np.int64, copy=False)

    @classmethod
    def fastcdc_cuts(cls, d, mn, avg, mx):
        n = d.size
        bits = avg.bit_length() - 1
        mask_s, mask_l = _top_bits(bits + 2), _top_bits(bits - 2)
        cand_s, cand_l = cls._candidates(d, mask_s, mask_l)
        ls = cand_s.tolist()
        ll = cand_l.tolist()
        ns, nl = len(ls), len(ll)

        cuts = []
        s = 0
        while s < n:
            rem = n - s
            if rem <= mn:
                cut = n
            else:
                end = s + min(rem, mx)
                i = s + mn - 1
                mid = min(s + avg - 1, end)
                cut = end
                j = bisect_left(ls, i)
                if j < ns and ls[j] < mid:
                    cut = ls[j] + 1
                else:
                    j = bisect_left(ll, mid)
                    if j < nl and ll[j] < end:
                        cut = ll[j] + 1
            cuts.append(cut)
            s = cut
        return np.array(cuts, dtype=np.int64)
