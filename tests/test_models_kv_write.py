"""The KV write kernel (models/kv_write.py) stores what torch's indexing ops store, or nothing."""

from __future__ import annotations

import pytest
import torch

from models import kv_write
from models.kv_cache import PagedKVCache

pytestmark = pytest.mark.timeout(60)

BLOCKS, BLOCK, HEADS, DIM, ROWS, LEN = 6, 4, 2, 8, 5, 12


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    paged_k, paged_v = (torch.randn(2, BLOCKS, BLOCK, HEADS, DIM, generator=g) * 3).to(dtype)
    mirror_k, mirror_v = torch.randn(2, ROWS, HEADS, LEN, DIM, generator=g).to(dtype)  # [R, H, L, D]
    return paged_k, paged_v, mirror_k, mirror_v


def _paged_bits(paged_k: torch.Tensor, paged_v: torch.Tensor) -> tuple:
    return kv_write.bits(paged_k.view(-1, HEADS, DIM)), kv_write.bits(paged_v.view(-1, HEADS, DIM))


def test_the_kernel_builds() -> None:
    # numba is a dependency: a kernel that does not build is a failure, not a fallback to hide.
    assert kv_write.prepare()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_mirror", [True, False])
def test_stores_exactly_what_index_copy_and_index_put_store(dtype: torch.dtype, with_mirror: bool) -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 7, HEADS, DIM, generator=g).to(dtype)
    k[0, 0, 0] = float("nan")  # bits are copied, NaNs included
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:7]
    take, rows, positions = torch.tensor([6, 2, 3]), torch.tensor([4, 0, 1]), torch.tensor([11, 0, 5])
    paged_k, paged_v, mirror_k, mirror_v = _caches(dtype)
    want = [t.clone() for t in (paged_k, paged_v, mirror_k, mirror_v)]
    want[0].view(-1, HEADS, DIM).index_copy_(0, slots, k)
    want[1].view(-1, HEADS, DIM).index_copy_(0, slots, v)
    if with_mirror:
        want[2].permute(0, 2, 1, 3).index_put_((rows, positions), k[take])
        want[3].permute(0, 2, 1, 3).index_put_((rows, positions), v[take])
    mirror = (take, rows, positions, kv_write.bits(mirror_k), kv_write.bits(mirror_v)) if with_mirror else None
    assert kv_write.write_kv(k, v, slots, _paged_bits(paged_k, paged_v), mirror)
    for got, expected in zip((paged_k, paged_v, mirror_k, mirror_v), want):
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           expected.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize(
    "slot, take, row, position, error",
    [
        (BLOCKS * BLOCK, 0, 0, 0, IndexError),  # a slot past the cache
        (-1, 0, 0, 0, IndexError),
        (0, 3, 0, 0, IndexError),  # a decode row past the step's tokens
        (0, 0, ROWS, 0, IndexError),  # a mirror row past the buffer
        (0, 0, 0, LEN, IndexError),  # a position past the buffer
    ],
)
def test_a_bad_index_raises_and_writes_nothing(slot: int, take: int, row: int, position: int, error: type) -> None:
    k, v = torch.randn(2, 3, HEADS, DIM)
    paged_k, paged_v, mirror_k, mirror_v = _caches(torch.float32)
    before = [t.clone() for t in (paged_k, paged_v, mirror_k, mirror_v)]
    mirror = (torch.tensor([take]), torch.tensor([row]), torch.tensor([position]), kv_write.bits(mirror_k), kv_write.bits(mirror_v))
    with pytest.raises(error, match="out of range"):
        kv_write.write_kv(k, v, torch.tensor([1, 2, slot]), _paged_bits(paged_k, paged_v), mirror)
    assert all(torch.equal(a, b) for a, b in zip((paged_k, paged_v, mirror_k, mirror_v), before))


def test_mismatched_shapes_raise_and_write_nothing() -> None:
    paged_k, paged_v, mirror_k, mirror_v = _caches(torch.float32)
    before = paged_k.clone()
    paged = _paged_bits(paged_k, paged_v)
    with pytest.raises(ValueError, match="heads or head size"):
        kv_write.write_kv(torch.randn(2, HEADS + 1, DIM), torch.randn(2, HEADS + 1, DIM), torch.tensor([0, 1]), paged)
    with pytest.raises(ValueError, match="disagree"):
        kv_write.write_kv(torch.randn(2, HEADS, DIM), torch.randn(2, HEADS, DIM), torch.tensor([0, 1, 2]), paged)
    with pytest.raises(ValueError, match="disagree"):
        kv_write.write_kv(torch.randn(2, HEADS, DIM), torch.randn(3, HEADS, DIM), torch.tensor([0, 1]), paged)
    # The decode rows' indices and the mirror, which the kernel takes by address and as arrays.
    k, v = torch.randn(2, 2, HEADS, DIM)
    one, two = torch.tensor([0]), torch.tensor([0, 1])
    mirror_bits = (kv_write.bits(mirror_k), kv_write.bits(mirror_v))
    with pytest.raises(ValueError, match="disagree in length"):
        kv_write.write_kv(k, v, two, paged, (two, one, two, *mirror_bits))
    with pytest.raises(ValueError, match="1-D"):
        kv_write.write_kv(k, v, two, paged, (two.view(2, 1), two.view(2, 1), two.view(2, 1), *mirror_bits))
    wide = torch.zeros(ROWS, HEADS + 1, LEN, DIM)
    with pytest.raises(ValueError, match="mirror's heads"):
        kv_write.write_kv(k, v, two, paged, (two, two, two, kv_write.bits(wide), kv_write.bits(wide)))
    assert torch.equal(paged_k, before) and not wide.any()


def test_indices_of_another_integer_type_or_layout_store_the_same() -> None:
    # The engine's indices are contiguous int64; others are converted, not misread.
    k, v = torch.randn(2, 3, HEADS, DIM)
    got, want = _caches(torch.float32), _caches(torch.float32)
    slots = torch.tensor([[5, 0], [9, 0], [2, 0]])[:, 0]  # strided
    take, rows, positions = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([1, 4]), torch.tensor([3, 11])
    assert kv_write.write_kv(k, v, slots.to(torch.int32), _paged_bits(*got[:2]),
                             (take, rows, positions, kv_write.bits(got[2]), kv_write.bits(got[3])))
    assert kv_write.write_kv(k, v, slots.contiguous(), _paged_bits(*want[:2]),
                             (take.long(), rows, positions, kv_write.bits(want[2]), kv_write.bits(want[3])))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0], _caches(torch.float32)[0])  # something was written


def test_what_the_kernel_cannot_take_is_left_to_torch() -> None:
    paged_k, paged_v, _, _ = _caches(torch.float32)
    before = paged_k.clone()
    paged = _paged_bits(paged_k, paged_v)
    kv = torch.randn(3, 2, HEADS, DIM)
    # Non-contiguous keys (a slice of a [T, 2, H, D] buffer), another element size, autograd.
    assert not kv_write.write_kv(kv[:, 0], kv[:, 1], torch.tensor([0, 1, 2]), paged)
    assert not kv_write.write_kv(kv[:, 0].contiguous().double(), kv[:, 1].contiguous().double(), torch.tensor([0, 1, 2]), paged)
    k = torch.randn(3, HEADS, DIM, requires_grad=True)
    assert not kv_write.write_kv(k, k.detach(), torch.tensor([0, 1, 2]), paged)
    assert torch.equal(paged_k, before)


def test_a_cache_layer_stores_alike_with_and_without_the_kernel() -> None:
    """LayerKV.write without a decode group (a prompt step's tokens), contiguous and strided inputs."""
    caches = [PagedKVCache([0], BLOCKS, BLOCK, HEADS, DIM, torch.bfloat16, write_kernel=w) for w in (False, True)]
    assert [c.layer(0).write_kernel for c in caches] == [False, True]
    kv = torch.randn(5, 2, HEADS, DIM).to(torch.bfloat16)
    slots = torch.tensor([3, 17, 4, 22, 9])
    for cache in caches:
        layer = cache.layer(0)
        layer.write(kv[:, 0].contiguous(), kv[:, 1].contiguous(), slots)
        layer.write(kv[:2, 1], kv[:2, 0], slots[3:])  # strided: torch's ops
    assert torch.equal(caches[0].storage, caches[1].storage)
    assert caches[0].storage.abs().sum() > 0
