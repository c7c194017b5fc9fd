"""``toolkit/layout.py``: each rank's place against megatron-core's own rank groups, the padded
vocabulary, the converter's and the reshard's layouts, a layout grown to more ranks."""
from __future__ import annotations

import itertools

import pytest

from toolkit.layout import Layout, padded_vocab_size

DIMS = ("tp", "cp", "dp", "pp")


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 1, 2, 2), (2, 2, 1, 2), (1, 2, 3, 1), (4, 1, 1, 2)])
def test_a_ranks_place_is_where_megatron_groups_it(tp, cp, dp, pp):
    """Every group megatron-core's ``RankGenerator`` forms for a dimension (its default order) holds
    ranks that agree on every other coordinate and count 0..n-1 along that one."""
    from megatron.core.parallel_state import RankGenerator
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    lay = Layout(backend="megatron", world=tp * cp * dp * pp, dp=dp, tp=tp, pp=pp, cp=cp)
    groups = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for dim in DIMS:
        for ranks in groups.get_ranks(dim):
            places = [lay.place(r)._asdict() for r in ranks]
            assert [p[dim] for p in places] == list(range(sizes[dim])), (dim, ranks)
            assert len({tuple(v for k, v in p.items() if k != dim) for p in places}) == 1, (dim, ranks)


def test_ulysses_ranks_of_a_row_are_consecutive():
    """DeepSpeed's sequence groups (``adapters/deepspeed/ulysses.py``) hold ranks ``first, first + sp, ...``:
    those of one sp rank; a row's sp ranks are consecutive (one dp rank)."""
    lay = Layout(backend="deepspeed", world=6, dp=3, sp=2)
    assert [tuple(lay.place(r)) for r in range(6)] == [(d, 0, 0, 0, s) for d, s in itertools.product(range(3), range(2))]
    with pytest.raises(ValueError, match="outside this layout's world of 6"):
        lay.place(6)


def test_the_padded_vocabulary_has_one_rule():
    lay = Layout.of_sizes("megatron", dp=1, tp=2, vocab_divisor=64)
    assert lay.padded(250) == padded_vocab_size(250, 64, 2) == 256 and lay.with_vocab(250).padded_vocab == 256


def test_a_reshard_writes_at_the_converters_sizes():
    """What a resume converts to: ZeRO partitions dp x sp at stage 2 for a stage-0 run; megatron's
    sizes and divisor (its record as the converter writes it)."""
    ds = Layout(backend="deepspeed", world=4, dp=2, sp=2, zero_stage=0)
    assert ds.for_checkpoint().record() == {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 2}
    mc = Layout(backend="megatron", world=8, dp=2, tp=2, pp=2, ep=2, vocab_divisor=64, padded_vocab=256)
    assert mc.for_checkpoint() == Layout.of_sizes("megatron", dp=2, tp=2, pp=2, ep=2, vocab_divisor=64)


def test_a_layout_grows_by_data_parallel_replicas():
    """The estimate's scaling rows: cp counts in a replica (dp was world / (tp x pp x sp) there before)."""
    lay = Layout(backend="megatron", world=8, dp=2, tp=2, cp=2)
    assert lay.fits(16) and not lay.fits(10) and lay.at_world(16).dp == 4
    with pytest.raises(ValueError, match="do not divide into replicas of 4"):
        lay.at_world(6)
