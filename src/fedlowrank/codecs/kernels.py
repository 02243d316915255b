"""The codecs' tensor kernels: pure functions on flat tensors, each the inverse of the other up to its error bound.

* :func:`quantize_blocks` / :func:`dequantize_blocks` — blockwise absmax quantisation (QLoRA's: Dettmers et al.,
  "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314, §2 "Block-wise k-bit Quantization"): the
  flat tensor ``x [n]`` is cut into blocks of ``B`` consecutive entries (the last one shorter), each scaled by its
  largest magnitude ``s_j`` (stored as bfloat16, rounded up so that ``|x| ≤ s_j``), and each scaled entry
  ``x_i / s_j ∈ [-1, 1]`` is coded as the index of a level: :func:`uniform_levels` (``2^(b-1) − 1`` steps each side
  of 0) or :data:`NF4_LEVELS` (QLoRA's NormalFloat, §3 "4-bit NormalFloat Quantization", Appendix E). Nearest
  rounding errs by at most half the gap between the two levels around an entry (times ``s_j``); stochastic rounding
  picks the upper of the two with probability proportional to the distance from the lower, so that the expected
  decoded value is the entry itself.
* :func:`pack_codes` / :func:`unpack_codes` — non-negative integers of ``bits`` bits each, packed little-endian into
  bytes (two 4-bit codes a byte; ⌈log2 n⌉ bits per top-k index).
* :func:`top_k` — the k largest magnitudes of ``x [n]`` (ties: the lower index), as sorted indices and values.
"""

from __future__ import annotations

import numpy as np
import torch

# QLoRA's NF4 levels (Dettmers et al. 2023, arXiv:2305.14314, Appendix E), as bitsandbytes ships them
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float64)


def uniform_levels(bits: int) -> torch.Tensor:
    """The ``2·(2^(bits−1) − 1) + 1`` levels ``k / (2^(bits−1) − 1)`` for k from ``−(2^(bits−1) − 1)`` up (float64):
    symmetric about an exact 0, ending at ±1."""
    steps = (1 << (bits - 1)) - 1
    return torch.arange(-steps, steps + 1, dtype=torch.float64) / steps


def block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """``s [⌈n/B⌉]`` (bfloat16): each block's largest magnitude of ``x [n]`` (float64), rounded up to a bfloat16 at
    least as large."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float64)
    padded[:n] = x.abs()
    absmax = padded.view(-1, block).amax(dim=1)
    s = absmax.to(torch.bfloat16)
    low = s.to(torch.float64) < absmax  # round-to-nearest went below: one bfloat16 step up (positive: bits + 1)
    s[low] = (s[low].view(torch.int16) + 1).view(torch.bfloat16)
    return s


def quantize_blocks(x: torch.Tensor, block: int, levels: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [n] int64 indices into levels, scales [⌈n/B⌉] bfloat16)`` of ``x [n]`` (float64); nearest rounding,
    or stochastic with ``generator`` (one uniform draw per entry)."""
    scales = block_scales(x, block)
    s = scales.to(torch.float64).repeat_interleave(block)[: x.numel()]
    y = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).clamp(-1.0, 1.0)
    if generator is None:
        codes = torch.bucketize(y, (levels[1:] + levels[:-1]) / 2)  # a tie goes to the lower level
    else:
        low = (torch.bucketize(y, levels, right=True) - 1).clamp(0, len(levels) - 2)
        gap = levels[low + 1] - levels[low]
        up = torch.rand(y.shape, generator=generator, dtype=torch.float64) < (y - levels[low]) / gap
        codes = low + up.to(torch.int64)
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: int, levels: torch.Tensor) -> torch.Tensor:
    """``x̂ [n]`` (float64) of ``codes [n]`` (indices into ``levels``) and bfloat16 ``scales [⌈n/B⌉]``."""
    s = scales.to(torch.float64).repeat_interleave(block)[: codes.numel()]
    return levels[codes] * s


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [n]`` (integers in ``[0, 2^bits)``) packed into ``⌈n·bits/8⌉`` bytes (uint8), little-endian within
    each byte."""
    values = codes.numpy().astype(np.uint64)
    if bits == 8:
        return torch.from_numpy(values.astype(np.uint8))
    if bits == 4:
        pairs = np.zeros(-(-len(values) // 2) * 2, dtype=np.uint8)
        pairs[: len(values)] = values
        return torch.from_numpy(pairs[0::2] | (pairs[1::2] << 4))
    bit_array = ((values[:, None] >> np.arange(bits, dtype=np.uint64)) & 1).astype(np.uint8)
    return torch.from_numpy(np.packbits(bit_array.reshape(-1), bitorder="little"))


def packed_length(count: int, bits: int) -> int:
    """Bytes that :func:`pack_codes` makes of ``count`` codes of ``bits`` bits."""
    return -(-count * bits // 8)


def unpack_codes(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` codes (int64) in ``packed`` (uint8 bytes of :func:`pack_codes`)."""
    raw = packed.numpy()
    if bits == 8:
        return torch.from_numpy(raw.astype(np.int64))
    if bits == 4:
        both = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1)[:count]
        return torch.from_numpy(both.astype(np.int64))
    bit_array = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    return torch.from_numpy((bit_array.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=1))


def index_bits(n: int) -> int:
    """Bits of one index into ``n`` entries (at least 1)."""
    return max(1, (n - 1).bit_length())


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [k] int64 ascending, values [k])`` of the ``k`` entries of ``x [n]`` largest in magnitude (among
    equal magnitudes the lower index)."""
    order = torch.argsort(x.abs(), descending=True, stable=True)[:k]
    indices = order.sort().values
    return indices, x[indices]


def topk_count(n: int, fraction: float, count: int) -> int:
    """Entries top-k keeps of a tensor of ``n``: ``count`` (0: ``round(fraction·n)``), at least 1, at most ``n``."""
    if n == 0:
        return 0
    return min(n, max(1, count if count else round(fraction * n)))
