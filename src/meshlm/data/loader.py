"""`PreparedLoader`: `BatchLoader`'s walk over prepared (memory-mapped) data, reading only this rank's samples (and,
for conversations, every sample's mask bytes: the global batch's counted targets), one step ahead in a background
thread.

Responsible for: the global batch of each optimizer step, taken from the dataset's epoch order
(`dataset.order(seed, epoch, positions)`: a seeded permutation, or a blend's schedule); this data-parallel
rank's contiguous slice of it as micro-batches, read from the memory-mapped shards; reading the next
step's slice in a thread while the caller trains (`last_wait_s`: how long the last `next_batch` waited for
it, 0 when it was ready); saving and restoring the position.
Not responsible for: what a sample is or where it lies on disk (dataset.py).

The interface, the checks, the epoch rule (a partial batch at an epoch's end is dropped) and `state_dict`
are `meshlm.data.text.BatchLoader`'s, so a trainer can take either. The state is five integers (epoch,
position, seed, num_samples, global_batch_size) and names no rank: a run resumed with another number of
data-parallel ranks continues with exactly the samples the uninterrupted run would have seen. The order is
not `BatchLoader`'s (`torch.randperm`) but a permutation computed per position (permutation.py), so memory
stays flat however many samples there are.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from meshlm.data.dataset import BlendedDataset, PreparedDataset
from meshlm.data.text import BatchLoader, micro_batch

Batch = list[tuple[torch.Tensor, torch.Tensor]]


class PreparedLoader(BatchLoader):
    """One global batch per optimizer step from a `PreparedDataset` or `BlendedDataset` (see the module docstring).

    `last_indices`: the sample ids of each micro-batch last returned by `next_batch`. `documents`
    (data.document_mask): micro-batches are (inputs, targets, document ids), as `BatchLoader`'s. `prefetch=False` reads in the caller's thread. Call `close()` when done.
    """

    def __init__(self, dataset: PreparedDataset | BlendedDataset, *, global_batch_size: int, micro_batch_size: int,
                 seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1, prefetch: bool = True,
                 documents: bool = False):
        super().__init__(dataset, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                         seq_len=seq_len, seed=seed, dp_rank=dp_rank, dp_size=dp_size, documents=documents)
        self.last_wait_s = 0.0
        self.last_indices: list[torch.Tensor] = []
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="meshlm-data") if prefetch else None
        self._ahead: tuple[tuple[int, int], Future] | None = None  # (epoch, position) being read, its future

    def _next_start(self) -> tuple[int, int]:
        """(epoch, position) of the next global batch, as BatchLoader.next_global_indices moves."""
        if self.position + self.global_batch_size > len(self.dataset):
            return self.epoch + 1, 0
        return self.epoch, self.position

    def _global_indices(self, start: tuple[int, int]) -> np.ndarray:
        epoch, position = start
        return self.dataset.order(self.seed, epoch, np.arange(position, position + self.global_batch_size))

    def next_global_indices(self) -> torch.Tensor:
        """Sample ids of the next global batch (all ranks), advancing the position."""
        start = self._next_start()
        idx = self._global_indices(start)
        self.epoch, self.position = start[0], start[1] + self.global_batch_size
        return torch.from_numpy(idx)

    def _read(self, start: tuple[int, int]) -> tuple[Batch, list[torch.Tensor], int]:
        """This rank's micro-batches, their sample ids, and the global batch's targets that count in the loss."""
        local = self.global_batch_size // self.dp_size
        everyone = self._global_indices(start)
        mine = everyone[self.dp_rank * local: (self.dp_rank + 1) * local]
        chunks = [torch.from_numpy(c) for c in np.split(mine, local // self.micro_batch_size)]
        return ([micro_batch(self.dataset, c, documents=self.documents) for c in chunks], chunks,
                self.dataset.loss_targets(everyone))

    def next_batch(self) -> Batch:
        """This rank's micro-batches (inputs, targets) of the next global batch (`loss_targets`: its targets that
        count in the loss, all of them but a conversation folder's masked ones)."""
        start = self._next_start()
        began = time.perf_counter()
        if self._ahead is not None and self._ahead[0] == start:
            batch, chunks, self.loss_targets = self._ahead[1].result()
        else:  # the first step, after load_state_dict or next_global_indices, or without prefetching
            batch, chunks, self.loss_targets = self._read(start)
        self.last_wait_s = time.perf_counter() - began
        self.epoch, self.position = start[0], start[1] + self.global_batch_size
        self.last_indices = chunks
        self._ahead = None
        if self._thread is not None:
            following = self._next_start()
            self._ahead = (following, self._thread.submit(self._read, following))
        return batch

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._ahead = None  # read for the old position

    def close(self) -> None:
        """Stop the prefetch thread (a read in progress finishes; its result is dropped)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread, self._ahead = None, None

    def __enter__(self) -> PreparedLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
