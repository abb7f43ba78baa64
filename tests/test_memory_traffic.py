"""The HBM traffic counts of tfedu.experiments.memory_traffic: their terms, their growth, and their bad inputs."""

import pytest

from tfedu.experiments.memory_traffic import flash_attention_traffic, matmul_traffic, standard_attention_traffic


def test_matmul_reads_both_inputs_and_writes_the_product():
    t = matmul_traffic(2, 3, 5)
    assert (t.reads, t.writes) == (2 * 3 + 3 * 5, 2 * 5)


def test_both_counts_grow_with_n_squared_flash_with_a_smaller_constant():
    for backward in (False, True):
        std = [standard_attention_traffic(n, 64, backward=backward).total for n in (4096, 8192)]
        fa = [flash_attention_traffic(n, 64, block=128, backward=backward).total for n in (4096, 8192)]
        assert 3.9 < std[1] / std[0] < 4.0  # the n^2 terms dominate
        # flash: (n / block) tiles, each reading O(n d): also n^2, but divided by the block, not multiplied by it
        assert 3.9 < fa[1] / fa[0] < 4.0
        assert fa[0] < std[0]


def test_flash_traffic_falls_as_the_block_grows():
    totals = [flash_attention_traffic(2048, 64, block=b, backward=True).total for b in (64, 128, 256, 2048)]
    assert totals == sorted(totals, reverse=True)
    # One tile holding everything: Q, K, V read once and O written once (version 2).
    one = flash_attention_traffic(2048, 64, block=2048, version=2)
    assert (one.reads, one.writes) == (3 * 2048 * 64, 2048 * 64 + 2048)


def test_mask_and_dropout_add_a_pass_over_the_n_by_n_matrix_each_way():
    n, d = 512, 32
    plain = standard_attention_traffic(n, d, backward=True)
    both = standard_attention_traffic(n, d, backward=True, mask=True, dropout=True)
    assert both.total - plain.total == 8 * n * n


def test_gigabytes_and_the_deck_000_sizes():
    heads = 64 * 16
    assert round(standard_attention_traffic(1024, 64, backward=True).gigabytes(heads), 1) == 25.2
    assert round(standard_attention_traffic(1024, 64, backward=True, mask=True, dropout=True).gigabytes(heads), 1) == 42.4


@pytest.mark.parametrize("call", [
    lambda: matmul_traffic(0, 1, 1),
    lambda: standard_attention_traffic(10, 2.0),
    lambda: flash_attention_traffic(10, 4, block=0),
    lambda: flash_attention_traffic(10, 4, block=2, version=3),
    lambda: standard_attention_traffic(8, 4).gigabytes(heads=0),
])
def test_bad_inputs_say_what_was_expected(call):
    with pytest.raises(ValueError, match="positive int|version"):
        call()
