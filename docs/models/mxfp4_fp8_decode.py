"""Bit model of the weight decode planned for an MXFP4 kernel on FP8 wgmmas (docs/perf-notes.md, seventh
session): the kernel-layout word, the decode by table lookup (PRMT) and the wgmma fragment / token-tile
K permutation. A model of instruction semantics, not kernel code; tests/test_models.py runs it.

Scheme (per weight row and 128-K block, MXFP4 scales e_0..e_3 per 32 K, E = max e_j):
- the kernel decodes each E2M1 weight w of sub-block j to the E4M3 byte of w * 2^-(E - e_j) (exact while
  E - e_j <= 8; rounded to nearest even below that, the error benchmarks/fold_error.py measures), and the
  promotion after each 128-K block multiplies by 2^E(row) * 2^T(token), as the FP8 kernel does per block;
- one table per (row, sub-block): the 8 magnitudes' E4M3 bytes for d = E - e_j (two 32-bit registers);
- one 32-bit word holds 8 consecutive K of a row. Magnitudes (3 bits) of w0..w3 in nibbles 0..3 and of
  w4..w7 in nibbles 4..7, so `word & 0x7777` and `(word >> 16) & 0x7777` are PRMT selectors; the sign bits
  fill each nibble's bit 3, placed so that they land on bit 7 of their output byte with one mask (w0..w3:
  bits 7, 15, 23, 31) or one shift by 4 and the same mask (w4..w7: bits 3, 11, 19, 27):
      lo = prmt(t0, t1, word & 0x7777)         | (word & 0x80808080)          # E4M3 of w0..w3
      hi = prmt(t0, t1, (word >> 16) & 0x7777) | ((word << 4) & 0x80808080)   # E4M3 of w4..w7
  8 instructions per 8 weights (the BF16 path: ~2.5 per weight).
- FP8 wgmma m64nNk32 with A from registers: thread (g = lane / 4, q = lane % 4) of warp w supplies
  a0 = A[r][4q..4q+3], a1 = A[r+8][4q..4q+3], a2 = A[r][16+4q..], a3 = A[r+8][16+4q..] (r = 16w + g). Step s
  (0..3) of a 128-K block maps its columns to natural K: 4q + i -> 32q + 8s + i and 16 + 4q + i ->
  32q + 8s + 4 + i, so a thread's A registers for step s are lo / hi of word s of its row's 16-byte chunk q
  (one 16-byte load per row and 128 K, the chunk grouping of today's FP4 kernel layout) and its table is that
  of sub-block q. The converter warps write the folded token tile in the same permuted K order.

Since the thirtieth session the kernel folds per row instead (E = the row's largest scale over the whole K, from
transform_weights; tables of 2^(6 - (E - e_j)), exact while E - e_j <= 14; the rows' 2^(E - 133) multiply the
accumulators after the tile's K). The decode, the tables' byte layout and the K permutation modelled here are the same.

    python3 docs/models/mxfp4_fp8_decode.py
"""
from __future__ import annotations

import numpy as np
import torch

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# Bit that holds the sign of weight i (0..7) of a word.
SIGN_BITS = [7, 15, 23, 31, 3, 11, 19, 27]
MAX_TABLE_SHIFT = 16  # tables for d > 16 are all zero (6 * 2^-17 rounds to 0 in E4M3)


def e4m3_bytes(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(values, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def fold_table(d: int) -> tuple[int, int]:
    """E4M3 bytes of the 8 E2M1 magnitudes times 2^-d, as the two PRMT source registers (t0: 0..3, t1: 4..7)."""
    b = e4m3_bytes(np.array(E2M1_MAGNITUDES) * 2.0 ** -min(d, MAX_TABLE_SHIFT + 1)).astype(np.uint64)
    t0 = int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24)
    t1 = int(b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24)
    return t0, t1


def pack_word(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes [..., 8] (sign << 3 | magnitude) of 8 consecutive K -> the kernel-layout uint32 words."""
    codes = codes.astype(np.uint32)
    word = np.zeros(codes.shape[:-1], np.uint32)
    for i in range(8):
        word |= (codes[..., i] & 7) << np.uint32(4 * i)  # magnitude of weight i in nibble i
        word |= ((codes[..., i] >> 3) & 1) << np.uint32(SIGN_BITS[i])
    return word


def unpack_word(word: np.ndarray) -> np.ndarray:
    word = word.astype(np.uint32)
    codes = np.zeros(word.shape + (8,), np.uint32)
    for i in range(8):
        codes[..., i] = ((word >> np.uint32(4 * i)) & 7) | (((word >> np.uint32(SIGN_BITS[i])) & 1) << 3)
    return codes


def prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel[4i+2:4i]) of {b, a}; sel bit 4i+3 set
    replicates that byte's sign bit instead."""
    a, b, sel = (np.asarray(v, np.uint64) for v in (a, b, sel))
    src = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint64)
    for i in range(4):
        n = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> ((n & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(n & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def decode_word(word: np.ndarray, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's decode: the E4M3 bytes of w0..w3 (lo) and w4..w7 (hi) times 2^-d."""
    word = np.asarray(word, np.uint32)
    lo = prmt(t0, t1, word & np.uint32(0x7777)) | (word & np.uint32(0x80808080))
    hi = prmt(t0, t1, (word >> np.uint32(16)) & np.uint32(0x7777)) | ((word << np.uint32(4)) & np.uint32(0x80808080))
    return lo.astype(np.uint32), hi.astype(np.uint32)


def decode_word_natural(word: np.ndarray, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
    """The same decode from today's kernel layout (checkpoint packing: nibble i = K element i of the word,
    sign in its bit 3), 10 instructions per 8 weights: the magnitudes as above; the signs by PRMT in
    sign-replicate mode (selector nibble 8 | byte: 0xFF where that byte's bit 7 is set) over {word, word << 4}
    (bits 3 of the low nibbles become bits 7), masked into the magnitude bytes by one LOP3.
        x4 = word << 4
        lo = prmt(t0, t1, word & 0x7777)         | (prmt(word, x4, 0x9D8C) & 0x80808080)
        hi = prmt(t0, t1, (word >> 16) & 0x7777) | (prmt(word, x4, 0xBFAE) & 0x80808080)"""
    word = np.asarray(word, np.uint32)
    x4 = (word.astype(np.uint64) << np.uint64(4)).astype(np.uint32)
    lo = prmt(t0, t1, word & np.uint32(0x7777)) | (prmt(word, x4, 0x9D8C) & np.uint32(0x80808080))
    hi = prmt(t0, t1, (word >> np.uint32(16)) & np.uint32(0x7777)) | (prmt(word, x4, 0xBFAE) & np.uint32(0x80808080))
    return lo.astype(np.uint32), hi.astype(np.uint32)


def pack_natural(codes: np.ndarray) -> np.ndarray:
    """Checkpoint packing of 8 consecutive K: code i in nibble i (byte i / 2, low nibble first)."""
    codes = codes.astype(np.uint32)
    word = np.zeros(codes.shape[:-1], np.uint32)
    for i in range(8):
        word |= codes[..., i] << np.uint32(4 * i)
    return word


def word_bytes(w: np.ndarray) -> np.ndarray:
    return np.stack([(w >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], -1)


def check_decode(num_words: int = 20000, seed: int = 0) -> None:
    """Every code at every position, random neighbours, every table shift: the decode gives the E4M3 byte of
    e2m1 * 2^-d (the sign of zero included: E4M3 -0 is 0x80)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(num_words, 8)).astype(np.uint32)
    for i in range(8):  # each code at each position at least once
        codes[16 * i:16 * i + 16, i] = np.arange(16)
    words = pack_word(codes)
    assert np.array_equal(unpack_word(words), codes), "pack / unpack"
    values = np.where(codes & 8, -1.0, 1.0) * np.array(E2M1_MAGNITUDES)[codes & 7]
    for d in range(MAX_TABLE_SHIFT + 3):
        t0, t1 = fold_table(d)
        want = e4m3_bytes(values * 2.0 ** -min(d, MAX_TABLE_SHIFT + 1))
        for decode, packed in ((decode_word, words), (decode_word_natural, pack_natural(codes))):
            lo, hi = decode(packed, t0, t1)
            got = np.concatenate([word_bytes(lo), word_bytes(hi)], -1)
            assert np.array_equal(got, want), f"{decode.__name__} differs at d={d}"
    # exact for d <= 8 (E2M1 x 2^-d is an E4M3 value down to 0.5 x 2^-8 = 2^-9)
    for d in range(9):
        t0, t1 = fold_table(d)
        lo, hi = decode_word(words, t0, t1)
        got = torch.from_numpy(np.concatenate([word_bytes(lo), word_bytes(hi)], -1).astype(np.uint8))
        assert np.array_equal(got.view(torch.float8_e4m3fn).float().numpy(), (values * 2.0 ** -d).astype(np.float32))


def fragment_dot(words: np.ndarray, tables: np.ndarray, tokens: np.ndarray, decode=None) -> np.ndarray:
    """One 64-row slice x one 128-K block as the kernel would compute it: words [64 rows, 4 q, 4 s] (the row's
    16-byte chunks), tables [64, 4 q, 2] (per row and sub-block), tokens [N, 128] already folded (float values
    of E4M3). Emulates the A registers of each thread, the permuted token tile B and the 4 k32 steps."""
    decode = decode or decode_word
    n = tokens.shape[0]
    out = np.zeros((64, n))
    for s in range(4):
        a = np.zeros((64, 32))
        b = np.zeros((32, n))
        for warp in range(4):
            for lane in range(32):
                g, q = lane // 4, lane % 4
                r = 16 * warp + g
                regs = []
                for row in (r, r + 8):
                    lo, hi = decode(words[row, q, s], *tables[row, q])
                    regs.append((lo, hi))
                (lo_r, hi_r), (lo_r8, hi_r8) = regs
                for reg, row, col0 in ((lo_r, r, 4 * q), (lo_r8, r + 8, 4 * q), (hi_r, r, 16 + 4 * q),
                                       (hi_r8, r + 8, 16 + 4 * q)):
                    vals = torch.from_numpy(word_bytes(np.uint32(reg)).astype(np.uint8)).view(torch.float8_e4m3fn)
                    a[row, col0:col0 + 4] = vals.double().numpy()
        for q in range(4):  # the converters' token tile: column kappa of step s holds natural K
            for i in range(4):
                b[4 * q + i] = tokens[:, 32 * q + 8 * s + i]
                b[16 + 4 * q + i] = tokens[:, 32 * q + 8 * s + 4 + i]
        out += a @ b
    return out


def check_fragments(seed: int = 1) -> None:
    """The fragment / permutation scheme computes the natural-order dot products exactly (float64 holds every
    partial sum of these E4M3 products exactly)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(64, 128)).astype(np.uint32)
    shifts = rng.integers(0, 9, size=(64, 4))  # d per (row, sub-block)
    words = pack_word(codes.reshape(64, 4, 4, 8))  # [row, q, s] words of natural K 32q + 8s + 0..7
    tables = np.array([[fold_table(int(d)) for d in row] for row in shifts], dtype=np.uint64)
    tokens = torch.randn(8, 128).to(torch.float8_e4m3fn).double().numpy()
    weights = np.where(codes & 8, -1.0, 1.0) * np.array(E2M1_MAGNITUDES)[codes & 7]
    weights = weights * 2.0 ** -np.repeat(shifts, 32, axis=1)
    got = fragment_dot(words, tables, tokens)
    assert np.array_equal(got, weights @ tokens.T), "fragment order"
    natural = pack_natural(codes.reshape(64, 4, 4, 8))
    got = fragment_dot(natural, tables, tokens, decode_word_natural)
    assert np.array_equal(got, weights @ tokens.T), "fragment order (natural layout)"


if __name__ == "__main__":
    check_decode()
    check_fragments()
    print("decode (both layouts): E4M3 bytes of e2m1 x 2^-d for every code, position and shift 0..18; "
          "fragments: exact dot products")
