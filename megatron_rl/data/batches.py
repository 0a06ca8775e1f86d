"""The training data stream: a deterministic, resumable order of global batches over the data-parallel
ranks, and microbatches of a batch."""

import torch


class Batches:
    """Deterministic, resumable stream of global batches; each DP rank takes every dp_size-th sample.

    The position (`consumed`) is all the state: a resumed run continues with the same samples.
    """

    def __init__(self, data: dict[str, torch.Tensor], global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        self.data, self.gbs, self.seed = data, global_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.n = len(next(iter(data.values())))
        self.consumed = 0  # samples taken so far (over all DP ranks)
        self._epoch = (-1, None)  # the current epoch and its permutation, drawn once per epoch

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch = (epoch, torch.randperm(self.n, generator=g))
        return self._epoch[1]

    def next(self) -> dict[str, torch.Tensor]:
        idx = []
        pos, end = self.consumed, self.consumed + self.gbs
        while pos < end:  # across an epoch's end: the rest of it, then the next one's start
            epoch, offset = divmod(pos, self.n)
            take = min(end - pos, self.n - offset)
            idx.append(self._order(epoch)[offset : offset + take])
            pos += take
        self.consumed = pos
        # Every dp_size-th sample, starting at this rank's: a contiguous part of the global batch (a GRPO
        # minibatch) then consists of the same contiguous part of each rank's share, at any DP size.
        mine = torch.cat(idx)[self.dp_rank :: self.dp_size]
        return {k: v[mine] for k, v in self.data.items()}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict):
        self.consumed = int(state["consumed"])


def microbatches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    n = len(batch["tokens"])
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, n, micro_batch_size)]
