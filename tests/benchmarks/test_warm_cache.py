"""benchmarks/warm_cache.py's choice of the batch that compiles the same kernel variants as a point's."""
from __future__ import annotations

import pytest

from conftest import import_benchmark


@pytest.mark.parametrize("batch,next_n,want", [
    (1, 1, 1),  # == 1 specializes: only 1 itself
    (96, 1, 48),  # % 16 and at or above the set select's 48 rows: 16 and 32 have fewer rows
    (32, 1, 16),  # % 16, below 48 rows
    (16, 1, 16),
    (8, 1, 2),  # neither == 1 nor % 16, below 48 rows
    (32, 2, 32),  # rows 64: both % 16 and >= 48 (16 x 2 = 32 rows is below)
    (8, 2, 8),  # rows 16: % 16 with the batch not, which only 8 itself gives
    (1, 2, 1),
    (49, 1, 49),  # the only batch in 1..49 with neither specialization and rows >= 48
])
def test_warm_batch_keeps_the_specialization_class(batch, next_n, want):
    warm = import_benchmark("warm_cache").warm_batch
    assert warm(batch, next_n) == want


def test_warm_batch_is_never_larger_and_matches_on_every_class():
    warm = import_benchmark("warm_cache").warm_batch
    for batch in range(1, 130):
        for next_n in (1, 2, 3, 4):
            b = warm(batch, next_n)
            assert 1 <= b <= batch
            for x, y in ((b, batch), (b * next_n, batch * next_n)):
                assert (x == 1) == (y == 1) and (x % 16 == 0) == (y % 16 == 0), (batch, next_n, b)
            assert (b * next_n >= 48) == (batch * next_n >= 48), (batch, next_n, b)


@pytest.mark.parametrize("batch,width,want", [
    (96, 2048, 48),  # 48 x 2048 blocks: the dense kernel prefetches at both sizes
    (32, 2048, 32),  # 32 x 2048 = 65536 blocks prefetch, 16 x 2048 do not: no smaller batch compiles the same
    (8, 8192, 8),  # 8 x 512K (65536 blocks) likewise
    (8, 2048, 2),  # 16384 and 4096 blocks: both without
])
def test_warm_batch_keeps_the_dense_logits_configuration(batch, width, want):
    warm = import_benchmark("warm_cache").warm_batch
    assert warm(batch, 1, width=width) == want
