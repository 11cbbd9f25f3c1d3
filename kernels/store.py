"""Write each new token's K and V into its cache slot (slot = block_id * block_size + offset)."""
from __future__ import annotations

from kernels.triton_or_standin import tl, triton
from torch import Tensor


def store_kv_torch(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    if bool((slot_mapping < 0).any()):  # rare (padding rows): drop them rather than clamp
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # the per-layer cache views are contiguous, so [blocks, bs, h, d] flattens to [slots, h, d]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slots, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     c_stride_b, c_stride_s, c_stride_h, BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr):
    t = tl.program_id(0)  # one program per token: all its heads at once
    slot = tl.load(slots + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_HEADS
    dst = (slot // BLOCK_SIZE) * c_stride_b + (slot % BLOCK_SIZE) * c_stride_s + h * c_stride_h + d
    k = tl.load(key + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(value + t * v_stride_t + h * v_stride_h + d, mask=mask)
    tl.store(k_cache + dst, k, mask=mask)
    tl.store(v_cache + dst, v, mask=mask)


def store_kv_triton(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    T, H, D = key.shape
    assert key.stride(-1) == value.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    if T:
        _store_kv_kernel[(T,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
                               value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
                               k_cache.stride(2), BLOCK_SIZE=k_cache.shape[1], NUM_HEADS=H, HEAD_DIM=D,
                               HEADS_PAD=triton.next_power_of_2(H))
