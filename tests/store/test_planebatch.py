"""Many keyframes decoded and checked with few calls (planebatch.decode_keyframes) decode as codec.decode decodes
each, pass only chunks whose bytes hash to their ids, and leave alone (never raise on, never half-decode as
passed) what they do not handle or what is damaged; the native kernel and its Python twin agree."""

import numpy as np
import pytest
import zstandard

from deltackpt import kernels
from deltackpt.kernels import twins
from deltackpt.store import codec
from deltackpt.store.chunking import chunk_id_of
from deltackpt.store.planebatch import decode_keyframes


def _batch(stored: list[bytes], raw_lens: list[int], elem_sizes: list[int]):
    """(buf, pos, stored_len, raw_len, elem_size, outs) for decode_keyframes, the stored bytes laid one after
    another with a gap between them (a bundle's headers), outs filled with garbage."""
    parts, pos, at = [], [], 0
    for s in stored:
        parts += [b"\xAA" * 64, s]
        pos.append(at + 64)
        at += 64 + len(s)
    buf = np.frombuffer(b"".join(parts) + b"\xAA" * 64, np.uint8).copy()
    outs = [np.full(n, 0xEE, np.uint8) for n in raw_lens]
    return (buf, np.array(pos, np.int64), np.array([len(s) for s in stored], np.int64), np.array(raw_lens, np.int64),
            np.array(elem_sizes, np.uint8), outs)


def _ids(raws: list[bytes]) -> bytes:
    return b"".join(chunk_id_of(r) for r in raws)


def _floats(rng, n: int, dtype) -> bytes:
    return (rng.standard_normal(n) * 0.02).astype(dtype).tobytes()


def test_decodes_as_codec_decode_does_every_element_size_and_length():
    rng = np.random.default_rng(5)
    raws = [_floats(rng, 2048, np.float32), _floats(rng, 1000, np.float64), _floats(rng, 3001, np.float16),
            rng.integers(0, 4, 5000, dtype=np.uint8).tobytes(), _floats(rng, 2048, np.float32)[:8190],
            rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),  # no plane compresses: all stored as is
            _floats(rng, 7, np.float32)]  # too short for a zstd plane
    elem = [4, 8, 2, 1, 4, 4, 4]
    stored = [bytes(codec.encode_planes(r, k, 1)) for r, k in zip(raws, elem)]
    modes = {b[4 + 5 * i] for b, k in zip(stored, elem) for i in range(k + 1)}
    assert modes == {codec.SEG_RAW, codec.SEG_ZSTD}
    buf, pos, slen, rlen, es, outs = _batch(stored, [len(r) for r in raws], elem)
    before = buf.copy()
    done = decode_keyframes(buf, pos, slen, rlen, es, outs, _ids(raws))
    assert done.all()
    assert [o.tobytes() for o in outs] == raws
    assert [codec.decode(codec.ZSTD, s, len(r), k).tobytes() for s, r, k in zip(stored, raws, elem)] == raws
    assert np.array_equal(buf, before)  # the stored bytes are only read


def test_leaves_alone_what_it_does_not_handle():
    rng = np.random.default_rng(6)
    good = _floats(rng, 2048, np.float32)
    sparse = np.where(rng.random(2048) < 0.8, 0, rng.standard_normal(2048)).astype(np.float32).tobytes()
    legacy = zstandard.ZstdCompressor().compress(kernels.shuffle(good, 4).tobytes())  # a single frame (0.1 stores)
    stored = [bytes(codec.encode_planes(good, 4, 1)), bytes(codec.encode_planes(sparse, 4, 1)), legacy,
              bytes(codec.encode_planes(good, 4, 1))]
    assert codec.SEG_SPARSE in {stored[1][4 + 5 * i] for i in range(5)}
    buf, pos, slen, rlen, es, outs = _batch(stored, [8192] * 4, [4, 4, 4, 4])
    done = decode_keyframes(buf, pos, slen, rlen, es, outs, _ids([good, sparse, good, good]))
    assert done.tolist() == [True, False, False, True]
    assert outs[0].tobytes() == outs[3].tobytes() == good
    assert codec.decode(codec.ZSTD, stored[1], 8192, 4).tobytes() == sparse  # what is left is codec.decode's


@pytest.mark.parametrize("damage", ["frame byte", "table length", "stored length", "magic", "truncated frame"])
def test_damage_is_left_alone_never_raised(damage):
    rng = np.random.default_rng(7)
    raws = [_floats(rng, 2048, np.float32) for _ in range(4)]
    stored = [bytearray(bytes(codec.encode_planes(r, 4, 1))) for r in raws]
    victim = stored[1]
    z_at = 29 + 3 * 2048  # float32 noise: three planes stored as is, then the sign and exponent plane's frame
    assert victim[4 + 5 * 3] == codec.SEG_ZSTD
    if damage == "frame byte":
        victim[z_at + 20] ^= 0xFF
    elif damage == "table length":
        victim[5] ^= 1  # plane 0's stored length
    elif damage == "magic":
        victim[0] ^= 1
    elif damage == "truncated frame":  # the table and the length agree, the frame is cut short
        del victim[-10:]
        victim[5 + 5 * 3:9 + 5 * 3] = (int.from_bytes(victim[5 + 5 * 3:9 + 5 * 3], "little") - 10).to_bytes(4, "little")
    stored = [bytes(s) for s in stored]
    buf, pos, slen, rlen, es, outs = _batch(stored, [8192] * 4, [4] * 4)
    if damage == "stored length":
        slen[1] -= 1  # the index says one byte less than the container holds
    done = decode_keyframes(buf, pos, slen, rlen, es, outs, _ids(raws))
    assert not done[1]
    with pytest.raises(ValueError):
        codec.decode(codec.ZSTD, buf[pos[1]:pos[1] + slen[1]], 8192, 4)  # one at a time names it
    for k in np.flatnonzero(done):
        assert outs[k].tobytes() == raws[k]
    if damage in ("table length", "stored length", "magic"):
        assert done.tolist() == [True, False, True, True]  # caught in the table: the others decode


def test_a_chunk_whose_bytes_do_not_hash_to_its_id_does_not_pass():
    """The batch checks each chunk's hash itself: an intact container under the wrong id is not passed."""
    rng = np.random.default_rng(8)
    raws = [_floats(rng, 2048, np.float32) for _ in range(3)]
    stored = [bytes(codec.encode_planes(r, 4, 1)) for r in raws]
    buf, pos, slen, rlen, es, outs = _batch(stored, [8192] * 3, [4] * 3)
    ids = bytearray(_ids(raws))
    ids[16 + 7] ^= 1
    assert decode_keyframes(buf, pos, slen, rlen, es, outs, bytes(ids)).tolist() == [True, False, True]
    assert outs[1].tobytes() == raws[1]  # decoded all the same: only its check failed


@pytest.mark.skipif(kernels._native is None or not hasattr(kernels._native, "unshuffle_check"),
                    reason="the native extension is not built")
def test_native_batch_kernel_and_its_python_twin_agree(monkeypatch):
    """The same bundle through the C kernel and the Python twin: the same bytes out, the same verdicts, for
    every element size, odd lengths (a tail, planes of 0 bytes), and chunks whose ids do not match."""
    rng = np.random.default_rng(9)
    raws = [_floats(rng, 2048, np.float32), _floats(rng, 1001, np.float64), _floats(rng, 3001, np.float16),
            rng.integers(0, 4, 4099, dtype=np.uint8).tobytes(), _floats(rng, 2048, np.float32)[:8190],
            _floats(rng, 2048, np.float32)[:8191], _floats(rng, 4, np.float64)[:31], _floats(rng, 7, np.float32)]
    elem = [4, 8, 2, 1, 4, 4, 8, 4]
    stored = [bytes(codec.encode_planes(r, k, 1)) for r, k in zip(raws, elem)]
    ids = bytearray(_ids(raws))
    ids[16 * 2] ^= 0x80  # one wrong id: both must fail it
    results = []
    for fn in (kernels._native.unshuffle_check, twins.unshuffle_check):
        monkeypatch.setattr(kernels, "unshuffle_check", fn)
        buf, pos, slen, rlen, es, outs = _batch(stored, [len(r) for r in raws], elem)
        done = decode_keyframes(buf, pos, slen, rlen, es, outs, bytes(ids))
        results.append((done.tolist(), [o.tobytes() for o in outs]))
    assert results[0] == results[1]
    assert results[0][0] == [k != 2 for k in range(len(raws))]
    assert results[0][1] == raws
