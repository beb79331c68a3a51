"""fvx_models.block_causal: the attention plan against hand-written token ranges, the mask it implies, the two
attention forms against a dense masked reference, and the ring cache's slots, writes and checks."""
import pytest
import torch

from fvx.core import random
from fvx_models import block_causal as bc


def test_plan_blocks_of_a_plain_sequence_attend_to_their_prefix():
    # 3 blocks of 2 frames, 1 token per frame
    blocks = bc.plan_blocks((), 0, 6, 1, frames_per_block=2, window=-1, sink=0)
    assert blocks == (bc.QueryBlock((0, 2), ((0, 2),)), bc.QueryBlock((2, 4), ((0, 4),)),
                      bc.QueryBlock((4, 6), ((0, 6),)))


def test_plan_blocks_with_a_window_and_a_sink_keep_the_sink_and_the_last_frames():
    # window 4 frames from the block's end, frame 0 a sink; 2 tokens per frame
    blocks = bc.plan_blocks((), 0, 8, 2, frames_per_block=2, window=4, sink=1)
    assert [b.keys for b in blocks] == [((0, 4),), ((0, 8),), ((0, 2), (4, 12)), ((0, 2), (8, 16))]


def test_plan_blocks_after_a_cache_index_keys_as_cache_then_chunk():
    # cached frames 0 (sink) and 3, 4 of a window-3 model; the chunk is frames 5, 6
    blocks = bc.plan_blocks((0, 3, 4), 5, 2, 1, frames_per_block=2, window=3, sink=1)
    assert blocks == (bc.QueryBlock((0, 2), ((0, 1), (2, 5))),)  # frame 0, frames 4..6 = keys 2..4


def test_teacher_forcing_plan_noisy_blocks_see_earlier_clean_blocks_and_themselves():
    blocks = bc.plan_blocks((), 0, 4, 1, frames_per_block=2, window=-1, sink=0, teacher_forcing=True)
    # keys: clean frames 0..3 (tokens 0..3), noisy frames 0..3 (tokens 4..7)
    assert blocks == (bc.QueryBlock((0, 2), ((0, 2),)), bc.QueryBlock((2, 4), ((0, 4),)),
                      bc.QueryBlock((4, 6), ((4, 6),)), bc.QueryBlock((6, 8), ((0, 2), (6, 8))))


def test_both_attention_forms_equal_dense_attention_under_the_mask():
    blocks = bc.plan_blocks((0, 3, 4), 5, 4, 3, frames_per_block=2, window=4, sink=1)
    k = random.split(random.key(0), 3)
    q = random.normal(k[0], (2, 12, 2, 8))
    keys, values = random.normal(k[1], (2, 21, 2, 8)), random.normal(k[2], (2, 21, 2, 8))
    mask = bc.mask_of(blocks, 12, 21, q.device)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) / 8 ** 0.5
    want = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(bc.attend(q, keys, values, blocks), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bc.attend(q, keys, values, blocks, mask), want, rtol=1e-5, atol=1e-6)


def _chunk_kv(batch, frames, tokens, value):
    return torch.full((batch, frames * tokens, 1, 2), float(value))


def stream(blocks, *, batch=1, frames=2, tokens=1, window=4, sink=1, total=8):
    """A ring cache after ``blocks`` chunks of ``frames`` frames whose keys are the block's number (values + 10)."""
    layout = dict(frames_per_block=frames, window=window, sink=sink)
    cache = bc.empty(total, **layout)
    for block in range(blocks):
        k = _chunk_kv(batch, frames, tokens, block)
        cache = bc.allocate(cache, layers=1, batch=batch, tokens_per_frame=tokens, heads=1, head_dim=2,
                            dtype=torch.float32, device=k.device)
        cache = bc.write(cache, [k], [k + 10], frames, tokens, **layout)
    return cache


def test_the_ring_keeps_what_the_next_block_can_see_in_a_fixed_shape():
    cache = stream(4)  # blocks of 2 frames, window 4, sink 1, one token per frame: 1 + 4 - 2 = 3 slots
    # the next block is frames 8, 9: it sees frames 6..9 and the sink 0
    assert cache.frames == (0, 6, 7) and cache.next_frame == 8 and len(cache.slots) == 3
    assert tuple(cache.keys[0].shape) == (1, 3, 1, 2)
    held = {frame: cache.keys[0][0, slot, 0, 0].item() for slot, frame in enumerate(cache.slots)}
    assert held == {0: 0.0, 6: 3.0, 7: 3.0}
    assert {frame: cache.values[0][0, slot, 0, 0].item() for slot, frame in enumerate(cache.slots)}[7] == 13.0


def test_a_global_ring_holds_every_frame_of_the_stream_in_its_own_slot():
    cache = stream(3, batch=2, frames=1, tokens=3, window=-1, sink=0, total=4)
    assert cache.slots == (0, 1, 2, -1) and tuple(cache.keys[0].shape) == (2, 12, 1, 2)
    assert cache.keys[0][0, 3:6, 0, 0].tolist() == [1.0, 1.0, 1.0]


def test_cached_keys_are_planned_in_frame_order_whatever_their_slots():
    # slots hold frames 0 (sink), 7 and 6 (wrapped); the chunk is frames 8, 9; one token per frame
    blocks = bc.plan_blocks((0, 7, 6), 8, 2, 1, frames_per_block=2, window=4, sink=1)
    assert blocks == (bc.QueryBlock((0, 2), ((0, 1), (2, 3), (1, 2), (3, 5))),)  # frames 0, 6, 7, then the chunk
    empty = bc.plan_blocks((-1, -1), 0, 2, 1, frames_per_block=2, window=-1, sink=0)
    assert empty == (bc.QueryBlock((0, 2), ((2, 4),)),)  # empty slots are never read


def test_check_cache_names_a_wrong_batch_length_or_layer_count():
    k = _chunk_kv(2, 2, 3, 0)
    cache = bc.KVCache((k, k), (k, k), (0, 1), 2)
    bc.check_cache(cache, batch=2, layers=2, tokens_per_frame=3, heads=1, head_dim=2, who="m")
    with pytest.raises(ValueError, match=r"layer 0 is \(2, 6, 1, 2\), but a batch of 3 .* needs \(3, 6, 1, 2\)"):
        bc.check_cache(cache, batch=3, layers=2, tokens_per_frame=3, heads=1, head_dim=2, who="m")
    with pytest.raises(ValueError, match="has 2 layers, the model 3"):
        bc.check_cache(cache, batch=2, layers=3, tokens_per_frame=3, heads=1, head_dim=2, who="m")
    with pytest.raises(ValueError, match=r"2 cache slots of 4 tokens needs"):
        bc.check_cache(cache, batch=2, layers=2, tokens_per_frame=4, heads=1, head_dim=2, who="m")
    with pytest.raises(ValueError, match="must be a fvx_models.block_causal.KVCache"):
        bc.check_cache({"k": k}, batch=2, layers=2, tokens_per_frame=3, heads=1, head_dim=2, who="m")
