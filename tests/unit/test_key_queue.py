"""The key queue split over 1, 2 and 3 ranks (simulated: the queue itself has no collective, each
rank's object is built here): every slot holds the same sample's key whatever the split, across
wrap-arounds; its checkpoint state re-splits for another number of ranks; bad sizes are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.moco_reference import replayed_slot_ids
from trainer.objectives.moco.key_queue import EMPTY_SLOT, KeyQueue
from trainer.parallel.sharded_state import ShardedRows, decode_state, split_state

SIZE, DIM, GLOBAL_BATCH = 20, 4, 4  # 5 steps fill the queue; 20 slots split 7/7/6 over 3 ranks


def _step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's global batch: sample ids as a sampler would give them, and a key per sample."""
    ids = 100 * step + torch.randperm(100, generator=torch.Generator().manual_seed(step))[:GLOBAL_BATCH]  # unique
    keys = F.normalize(torch.randn(GLOBAL_BATCH, DIM, generator=torch.Generator().manual_seed(100 + step)), dim=1)
    return keys, ids


def _queues(ranks: int, steps: int) -> list[KeyQueue]:
    queues = [KeyQueue(SIZE, DIM, GLOBAL_BATCH, rank, ranks, seed=7) for rank in range(ranks)]
    for step in range(steps):
        keys, ids = _step(step)
        for queue in queues:  # every rank enqueues the same all-gathered batch
            queue.enqueue(keys, ids)
    return queues


def _joined(queues: list[KeyQueue]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([q.keys for q in queues]), torch.cat([q.ids for q in queues])


@pytest.mark.parametrize("steps", [3, 5, 13])  # part full, just full, wrapped around twice and a bit
def test_each_slot_holds_the_same_sample_on_any_number_of_ranks(steps):
    expected_ids = torch.tensor(replayed_slot_ids(SIZE, [_step(step)[1].tolist() for step in range(steps)]))
    reference_keys = None
    for ranks in (1, 2, 3):
        queues = _queues(ranks, steps)
        bounds = [(q.slot_start, q.slot_end) for q in queues]
        assert [start for start, _ in bounds] == [0] + [end for _, end in bounds[:-1]] and bounds[-1][1] == SIZE
        keys, ids = _joined(queues)
        assert torch.equal(ids, expected_ids), f"{ranks} ranks"
        assert {q.pointer for q in queues} == {(steps * GLOBAL_BATCH) % SIZE}
        reference_keys = keys if reference_keys is None else reference_keys
        assert torch.equal(keys, reference_keys), f"{ranks} ranks: the keys differ from one rank's"
    # A written slot holds its sample's key; an unwritten one still a random unit key.
    for step in range(steps):
        step_keys, step_ids = _step(step)
        for key, sample in zip(step_keys, step_ids.tolist()):
            slot = (expected_ids == sample).nonzero()
            if len(slot):
                assert torch.equal(reference_keys[slot[0, 0]], key)
    untouched = expected_ids == EMPTY_SLOT
    assert untouched.any() == (steps * GLOBAL_BATCH < SIZE)
    torch.testing.assert_close(reference_keys[untouched].norm(dim=1), torch.ones(int(untouched.sum())))


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 3), (3, 1)])
def test_checkpoint_state_reloads_on_another_number_of_ranks(saved_on, loaded_on):
    saved = _queues(saved_on, 7)  # wrapped once: the pointer is not 0
    stored: dict[str, list[ShardedRows]] = {}
    plains = []
    for queue in saved:
        plain, rows = split_state(queue.state_dict())
        plains.append(plain)
        for path, piece in rows.items():
            stored.setdefault(path, []).append(piece)

    def read_rows(template: ShardedRows, node: dict, path: str) -> torch.Tensor:
        whole = torch.cat([piece.rows for piece in sorted(stored[path], key=lambda piece: piece.start)])
        return whole[template.start: template.end].clone()

    loaded = [KeyQueue(SIZE, DIM, GLOBAL_BATCH, rank, loaded_on, seed=99) for rank in range(loaded_on)]
    for queue in loaded:
        queue.load_state_dict(decode_state(queue.state_dict(), plains[0], "", read_rows))
    assert [q.pointer for q in loaded] == [saved[0].pointer] * loaded_on
    for got, want in zip(_joined(loaded), _joined(saved)):
        assert torch.equal(got, want)
    # The reloaded queue carries on exactly as the saved one would have.
    keys, ids = _step(7)
    for queue in (*saved, *loaded):
        queue.enqueue(keys, ids)
    for got, want in zip(_joined(loaded), _joined(saved)):
        assert torch.equal(got, want)


def test_bad_sizes_and_batches_are_refused():
    with pytest.raises(ValueError, match=r"objective.queue_size=18 is invalid: .* multiple of it \(e.g. 16\)"):
        KeyQueue(18, DIM, GLOBAL_BATCH, 0, 1)
    with pytest.raises(ValueError, match="moco.K=2 is invalid"):
        KeyQueue(2, DIM, GLOBAL_BATCH, 0, 1, field="moco.K")
    queue = KeyQueue(SIZE, DIM, GLOBAL_BATCH, 0, 2)
    with pytest.raises(ValueError, match="takes the whole global batch"):
        queue.enqueue(torch.zeros(2, DIM), torch.zeros(2, dtype=torch.int64))
    state = queue.state_dict()
    state["pointer"] = 6
    with pytest.raises(ValueError, match="pointer 6 is not a multiple of this run's global batch 4"):
        queue.load_state_dict(state)
