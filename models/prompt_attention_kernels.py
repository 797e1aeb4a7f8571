"""The numba kernel behind models/prompt_attention.py (imported only where numba is installed).

`attend_chunks` runs causal attention of prompt chunks over their sequences' keys (the
chunk's own, or a cached prefix and the chunk's), with the AVX512-BF16 micro-kernel of models/bf16_gemm_kernels.py for
both products. Per chunk and kv head, the keys are packed as a weight of [keys, head_dim]
(the scores' "output columns" are keys) and the values transposed as one of [head_dim,
keys]. Per query head of the group and per block of up to 64 query rows: the scores of
those rows against the keys they may see (whole panels of 32 up to the block's last
row) in float32, a softmax in float32 with the causal cut per row, the probabilities
rounded to bfloat16, and their product with the values summed in float32 and rounded
once into the output, as the bf16 GEMM does. Only build this module on a CPU that has
avx512_bf16 (models/bf16_gemm.py checks).
"""

from __future__ import annotations

import numba
import numpy as np

from models.bf16_gemm import PANEL
from models.bf16_gemm_kernels import ROWS, rows_times_panel, rows_times_panel_f32
from models.decode_attention_kernels import FASTMATH, softmax_rows

# Query rows per block: the scores of a block over 2048 keys are 512 KB in float32.
BLOCK = 64


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend_chunks(q, k, v, out, starts, stops, key_starts, key_counts, scale, lo, hi):  # noqa: ANN001 - typed by numba
    """Chunks [lo, hi): out[s:e, h] = softmax(q[s:e, h] K^T * scale, causal) V, K and V of kv head h // G.

    q, out [T, H, D] and k, v [L, KV, D]: C-contiguous int16 arrays of bfloat16 bits; D a
    multiple of 32, H a multiple of KV. Chunk i's queries are rows starts[i]:stops[i] of q
    (and out), its keys and values rows key_starts[i]:key_starts[i] + key_counts[i] of k and
    v, at least as many: the last query sees every key, each earlier one a key fewer.
    """
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    longest = 0
    for i in range(lo, hi):
        longest = max(longest, key_counts[i])
    cap = (longest + PANEL - 1) // PANEL * PANEL
    kp = np.zeros((cap // PANEL, dim // 2, PANEL, 2), np.int16)  # keys as a packed weight
    vp = np.zeros((dim // PANEL, cap // 2, PANEL, 2), np.int16)  # values, transposed, packed
    s = np.empty((BLOCK, cap), np.float32)
    p = np.zeros((BLOCK, cap), np.int16)
    bits = np.empty(cap, np.int32)
    # Addresses as int64: numba's uintp plus an int64 would be a float.
    kp_addr, vp_addr = np.int64(kp.ctypes.data), np.int64(vp.ctypes.data)
    s_addr, p_addr = np.int64(s.ctypes.data), np.int64(p.ctypes.data)
    q_base, o_base = np.int64(q.ctypes.data), np.int64(out.ctypes.data)
    kp_panel = dim // 2 * PANEL * 4  # bytes of one packed panel
    vp_panel = cap // 2 * PANEL * 4
    q_row = heads * dim * 2  # bytes between consecutive tokens of q and out
    for i in range(lo, hi):
        start, length = starts[i], stops[i] - starts[i]
        key_start, keys = key_starts[i], key_counts[i]
        before = keys - length  # keys every query of the chunk sees: a cached prefix
        for h in range(kv_heads):
            for t in range(keys):
                key, value = k[key_start + t, h], v[key_start + t, h]
                j, c, pair, e = t // PANEL, t % PANEL, t // 2, t % 2
                for d2 in range(dim // 2):
                    kp[j, d2, c, 0] = key[2 * d2]
                    kp[j, d2, c, 1] = key[2 * d2 + 1]
                for jd in range(dim // PANEL):
                    for cd in range(PANEL):
                        vp[jd, pair, cd, e] = value[jd * PANEL + cd]
            if keys % 2:
                # The last pair's second value meets a probability of 0: make it a finite 0
                # (an earlier chunk's value could be anything the model made, inf included).
                for d in range(dim):
                    vp[d // PANEL, keys // 2, d % PANEL, 1] = 0
            # Key panels past `keys` are read for scores that no row keeps: left as they are.
            for g in range(groups):
                head = h * groups + g
                q_addr = q_base + (start * heads + head) * dim * 2
                o_addr = o_base + (start * heads + head) * dim * 2
                for first in range(0, length, BLOCK):
                    rows = min(BLOCK, length - first)
                    seen = before + first + rows  # the block's last row sees keys [0, seen)
                    panels = (seen + PANEL - 1) // PANEL
                    for j in range(panels):
                        b_j = kp_addr + j * kp_panel
                        for blk in range(0, rows, ROWS):
                            r = min(ROWS, rows - blk)
                            rows_times_panel_f32(
                                r, q_addr + (first + blk) * q_row, b_j, s_addr + (blk * cap + j * PANEL) * 4,
                                dim // 2, q_row, cap * 4, b_j, 64, 0,
                            )
                    pairs = (seen + 1) // 2
                    for r in range(rows):
                        n = before + first + r + 1
                        row = s[r]
                        softmax_rows(s[r : r + 1], n, bits, scale)
                        # To bfloat16, rounding to nearest even (probabilities: finite, >= 0).
                        row_bits = row.view(np.int32)
                        for t in range(n):
                            b = row_bits[t]
                            p[r, t] = np.int16((b + np.int32(0x7FFF) + ((b >> 16) & 1)) >> 16)
                        for t in range(n, 2 * pairs):
                            p[r, t] = 0
                    for j in range(dim // PANEL):
                        b_j = vp_addr + j * vp_panel
                        for blk in range(0, rows, ROWS):
                            r = min(ROWS, rows - blk)
                            rows_times_panel(
                                r, p_addr + blk * cap * 2, b_j, o_addr + (first + blk) * q_row + j * PANEL * 2,
                                pairs, cap * 2, q_row, b_j, 64, 0,
                            )
