"""Large tables in 2 MB pages (models/formats/huge_pages.py): aligned, the same values, small ones plain."""

from __future__ import annotations

import torch

from specdraft.models.formats.huge_pages import HUGE_PAGE, _madvise, empty_huge, huge_copy


def test_a_large_table_starts_on_a_huge_page_and_keeps_its_values() -> None:
    src = torch.randn(3 * HUGE_PAGE // 4 + 17, dtype=torch.float32).view(-1, 1)  # 3 pages and a bit
    out = huge_copy(src, torch.float16)
    assert out.shape == src.shape and out.dtype == torch.float16 and out.is_contiguous()
    assert torch.equal(out, src.half())
    if _madvise() is not None:
        assert out.data_ptr() % HUGE_PAGE == 0


def test_a_small_tensor_is_a_plain_allocation() -> None:
    t = empty_huge((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.untyped_storage().nbytes() == 60
