"""The data order (training/batches.py): seeded permutations per (seed, stream, pass), dealt to ranks."""
import numpy as np
import pytest
import torch

from mcd_helpers.training.batches import Batches, pass_seed


def test_each_pass_is_a_permutation_and_passes_differ():
    b = Batches(20, 6, seed=0, stream=0)
    assert b.per_pass == 3  # 20 // 6; the last 2 samples of each pass are dropped
    for p in (0, 1):
        seen = torch.cat([b.batch(p, i) for i in range(3)])
        assert len(seen) == 18 and len(set(seen.tolist())) == 18 and seen.max() < 20
        assert sorted(b.permutation(p).tolist()) == list(range(20))
    assert not torch.equal(b.permutation(0), b.permutation(1))


def test_a_pass_is_randperm_from_the_seed_sequence_of_seed_stream_and_pass():
    # Independently: NumPy's SeedSequence([seed, stream, pass]) -> 63-bit seed -> torch.randperm.
    state = int(np.random.SeedSequence([5, 2, 3]).generate_state(1, dtype=np.uint64)[0]) >> 1
    assert pass_seed(5, 2, 3) == state
    want = torch.randperm(30, generator=torch.Generator().manual_seed(state))
    assert torch.equal(Batches(30, 4, seed=5, stream=2).permutation(3), want)
    assert torch.equal(Batches(30, 4, seed=5, stream=2).batch(3, 1), want[4:8])


def test_batches_are_a_function_of_seed_stream_and_pass_alone():
    a, b = Batches(50, 8, seed=3, stream=1), Batches(50, 8, seed=3, stream=1)
    b.batch(4, 0)  # b visits another pass first: no hidden state may leak
    assert torch.equal(a.batch(1, 2), b.batch(1, 2))
    assert torch.equal(a.batch_at(6 + 2), a.batch(1, 2))  # 6 batches per pass
    assert not torch.equal(a.permutation(0), Batches(50, 8, seed=3, stream=2).permutation(0))
    assert not torch.equal(a.permutation(0), Batches(50, 8, seed=4, stream=1).permutation(0))


@pytest.mark.parametrize("n, b, w", [(37, 8, 2), (64, 12, 3), (10, 4, 4)])
def test_ranks_shares_are_disjoint_and_make_up_the_single_process_batch(n, b, w):
    one = Batches(n, b, seed=5, stream=1)
    ranks = [Batches(n, b, seed=5, stream=1, rank=r, world_size=w) for r in range(w)]
    for k in range(2 * one.per_pass + 1):
        shares = [r.batch_at(k) for r in ranks]
        assert all(len(s) == b // w for s in shares)
        union = torch.cat(shares)
        assert len(set(union.tolist())) == b  # disjoint
        assert sorted(union.tolist()) == sorted(one.batch_at(k).tolist())
        assert torch.equal(shares[1], one.batch_at(k)[1::w])  # batch[rank::world]


def test_batches_reject_bad_sizes():
    with pytest.raises(ValueError, match="between 1 and the data set's size 5"):
        Batches(5, 8, seed=0, stream=0)
    with pytest.raises(ValueError, match="multiple of the number of processes 4"):
        Batches(50, 10, seed=0, stream=0, rank=0, world_size=4)
    with pytest.raises(IndexError, match="a pass has 2 batches"):
        Batches(10, 5, seed=0, stream=0).batch(0, 2)
