"""The data order: a seeded permutation per (seed, stream, pass), cut into batches.

Pass ``p`` of stream ``s`` (pre-training 0, labeled 1, unlabeled 2) of a run with seed ``seed`` is
``torch.randperm(n)`` drawn from a generator seeded with NumPy's ``SeedSequence([seed, s, p])``
(its hashing keeps nearby seeds, streams and passes independent). Batch ``i`` of the pass is
``perm[i*B:(i+1)*B]``; a last incomplete batch is dropped. Nothing depends on what was drawn
before, so a resumed run finds its batch by arithmetic and the data set can live on the GPU.

Under ``torchrun`` every rank computes the same permutation and takes ``batch[rank::world]``
(``B / W`` samples, as nanoGPT and airbench deal batches): the W ranks' shares of batch ``i`` are
disjoint and together are the single-process batch ``i``.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["Batches", "pass_seed", "PRETRAIN", "LABELED", "UNLABELED"]

PRETRAIN, LABELED, UNLABELED = 0, 1, 2  # the streams of a run


def pass_seed(seed: int, stream: int, p: int) -> int:
    """The generator seed of pass ``p`` of ``stream``: ``SeedSequence([seed, stream, p])``'s first 63 bits."""
    return int(np.random.SeedSequence([seed, stream, p]).generate_state(1, dtype=np.uint64)[0] >> 1)


class Batches:
    """Index batches of shuffled passes over ``n`` samples, a pure function of (seed, stream, pass).

    Args:
        n: samples in the data set; batch_size: the global batch ``B``; seed, stream: see the module;
        device: where the index tensors are put (the data's device);
        rank, world_size: this process's share of each batch (``batch[rank::world_size]``).

    Raises:
        ValueError: if ``batch_size`` is not in ``[1, n]`` (no full batch) or not a multiple of
            ``world_size`` (each rank takes ``B / W`` samples).
    """

    def __init__(self, n: int, batch_size: int, seed: int, stream: int, device="cpu", rank: int = 0,
                 world_size: int = 1):
        if not 1 <= batch_size <= n:
            raise ValueError(f"batch_size must be between 1 and the data set's size {n}, got {batch_size}; "
                             "lower the batch size or use more data.")
        if batch_size % world_size:
            raise ValueError(f"the global batch size {batch_size} must be a multiple of the number of processes "
                             f"{world_size}; choose a batch size divisible by --nproc_per_node.")
        self.n, self.batch_size, self.seed, self.stream = n, batch_size, seed, stream
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.per_pass = n // batch_size  # full batches per pass
        self._pass, self._perm = None, None

    def permutation(self, p: int) -> torch.Tensor:
        """The order of pass ``p``: a permutation of ``range(n)``, shape ``(n,)``."""
        if p != self._pass:
            g = torch.Generator().manual_seed(pass_seed(self.seed, self.stream, p))
            self._perm, self._pass = torch.randperm(self.n, generator=g).to(self.device), p
        return self._perm

    def batch(self, p: int, i: int) -> torch.Tensor:
        """This rank's indices of batch ``i`` of pass ``p``, shape ``(B / W,)``."""
        if not 0 <= i < self.per_pass:
            raise IndexError(f"a pass has {self.per_pass} batches, asked for batch {i}.")
        return self.permutation(p)[i * self.batch_size:(i + 1) * self.batch_size][self.rank::self.world_size]

    def batch_at(self, k: int) -> torch.Tensor:
        """Indices of the ``k``-th batch of the endless stream (pass ``k // per_pass``)."""
        return self.batch(*divmod(k, self.per_pass))
