"""The live set at an allocator snapshot's peak, replayed from a synthetic record."""

from pathlib import Path

from megatron.bounded.budget.memory_snapshot import owner_of, owners_per_token, peak_live_set


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


LAYER = [_frame("/x/site-packages/torch/nn/modules/module.py", 1, "_call_impl"),
         _frame("/x/site-packages/megatron/core/transformer/layer.py", 640, "forward")]
LOSS = [_frame("/x/site-packages/megatron/core/tensor_parallel/cross_entropy.py", 25, "logits")]


def _snapshot(events, final_blocks):
    return {
        "segments": [{"device": 0, "blocks": [
            {"address": a, "size": s, "state": "active_allocated", "frames": f}
            for a, s, f in final_blocks]}],
        "device_traces": [events],
    }


def test_replay_finds_the_peak_and_its_live_set():
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": LAYER},
        {"action": "alloc", "addr": 2, "size": 300, "frames": LOSS},  # peak: 400
        {"action": "free_requested", "addr": 2, "size": 300, "frames": LOSS},
        {"action": "free_completed", "addr": 2, "size": 300, "frames": LOSS},
        {"action": "alloc", "addr": 3, "size": 50, "frames": LAYER},
    ]
    live = peak_live_set(_snapshot(events, [(1, 100, LAYER), (3, 50, LAYER)]))
    assert live.peak_bytes == 400 and live.final_bytes == 150
    assert sorted(b.address for b in live.blocks) == [1, 2]
    assert live.peak_owner == owner_of(LOSS)
    assert live.by_owner == {owner_of(LAYER): 100, owner_of(LOSS): 300}
    assert live.complete


def test_blocks_older_than_the_record_keep_their_place_without_a_stack():
    events = [{"action": "alloc", "addr": 5, "size": 10, "frames": LAYER}]
    # block 9 was allocated before the allocator's ring buffer begins
    live = peak_live_set(_snapshot(events, [(9, 1000, []), (5, 10, LAYER)]))
    assert live.peak_bytes == 1010
    assert not live.complete and live.by_owner["?"] == 1000


def test_owner_skips_torch_machinery_and_names_the_caller():
    assert owner_of(LAYER, depth=1) == "megatron/core/transformer/layer.py:640 forward"
    assert owner_of([]) == "?"


def test_owner_names_repository_files_relative_to_its_root():
    entry = str(Path(__file__).resolve().parents[3] / "pretrain_gpt.py")
    assert owner_of([_frame(entry, 66, "get_batch")]) == "pretrain_gpt.py:66 get_batch"


def test_owners_per_token_fits_each_owner():
    def at(tokens, per_token, constant):
        events = [{"action": "alloc", "addr": 1, "size": per_token * tokens, "frames": LOSS},
                  {"action": "alloc", "addr": 2, "size": constant, "frames": LAYER}]
        return tokens, peak_live_set(_snapshot(events, [(1, per_token * tokens, LOSS),
                                                        (2, constant, LAYER)]))

    fits = owners_per_token([at(1000, 6, 7), at(3000, 6, 7)])
    assert fits[owner_of(LOSS)] == (6.0, 0.0)
    assert fits[owner_of(LAYER)] == (0.0, 7.0)
