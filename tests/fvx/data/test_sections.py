"""Kind "framepack"'s sections (fvx.data.sections) against musubi-tuner's fpack_cache_latents.py, worked by hand on
clips whose frame f holds the value f (zero: a frame the clip does not have, or frame 0)."""
import pytest
import torch

from fvx.data import sections
from fvx.data.sections import SectionsConfig


def clip(frames: int) -> torch.Tensor:
    """Latents [1, frames, 1, 1] whose frame f is f."""
    return torch.arange(frames, dtype=torch.float32).view(1, frames, 1, 1)


def values(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in tensor.flatten()]


def test_inverted_anti_drifting_sections_see_the_first_frame_and_the_frames_after_them():
    parts = sections.cut(clip(7), SectionsConfig(window=2))
    assert [values(p["latents"]) for p in parts] == [[1, 2], [3, 4], [5, 6]]
    # made last first: each history is [frame 0 | 1x | 2x, 2x | 4x ...] of the frames after the section
    assert values(parts[2]["history"]) == [0] * 20
    assert values(parts[1]["history"]) == [0, 5, 6] + [0] * 17
    assert values(parts[0]["history"]) == [0, 3, 4, 5, 6] + [0] * 15
    # positions: the section after a gap of (sections still to make) windows, frame 0 at 0, the history after it
    assert values(parts[2]["frame_indices"]) == [5, 6, 0] + list(range(7, 26))
    assert values(parts[1]["frame_indices"]) == [3, 4, 0] + list(range(5, 24))
    assert values(parts[0]["frame_indices"]) == [1, 2, 0] + list(range(3, 22))


def test_a_long_clip_caps_the_gap_at_three_windows_as_musubi_tuner_does():
    parts = sections.cut(clip(13), SectionsConfig(window=2))  # 6 sections: paddings 3, 2, 2, 2, 1, 0 (last first)
    assert [int(p["frame_indices"][0]) for p in parts] == [1, 3, 5, 5, 5, 7]
    assert values(parts[5]["history"]) == [0] * 20
    assert values(parts[2]["history"])[:8] == [0, 7, 8, 9, 10, 11, 12, 0]


def test_vanilla_sections_see_the_nineteen_frames_before_them():
    parts = sections.cut(clip(8), SectionsConfig(window=3, order="vanilla"))  # 7 frames used: 2 sections
    assert [values(p["latents"]) for p in parts] == [[1, 2, 3], [4, 5, 6]]
    # [frame 0 | 1x: the newest | 2x: the two before | 4x: the sixteen before those], zeros where none
    assert values(parts[0]["history"]) == [0, 0] + [0, 0] + [0] * 16
    assert values(parts[1]["history"]) == [0, 3, 1, 2] + [0] * 15 + [0]
    expected = [20, 21, 22, 0, 19, 17, 18] + list(range(1, 17))
    assert values(parts[0]["frame_indices"]) == expected == values(parts[1]["frame_indices"])


def test_frames_past_the_last_whole_section_are_dropped_and_a_short_clip_is_refused():
    assert len(sections.cut(clip(8), SectionsConfig(window=3))) == 2
    with pytest.raises(ValueError, match=r"a clip: 3 latent frames hold no section of data.sections.window=3"):
        sections.cut(clip(3), SectionsConfig(window=3))


def test_chunks_tile_the_clip_from_its_first_frame_and_the_first_is_given_no_first_frame():
    """Helios's cut: sections from frame 0, each with the 19 frames before it; the clip's first frame is given to all
    but the first section, which makes it."""
    parts = sections.cut(clip(7), SectionsConfig(window=3, order="chunks"))  # frame 6 left over
    assert [values(p["latents"]) for p in parts] == [[0, 1, 2], [3, 4, 5]]
    assert values(parts[0]["history"]) == [0] * 20
    frame_zero = clip(7) + 1  # frame f holds f + 1: frame 0 is told from a zero
    given = sections.cut(frame_zero, SectionsConfig(window=3, order="chunks"))
    assert values(given[0]["history"]) == [0] * 20
    assert values(given[1]["history"]) == [1, 3, 1, 2] + [0] * 16  # [frame 0 | 1x frame 2 | 2x frames 0, 1 | 4x]
    assert values(parts[1]["frame_indices"]) == [20, 21, 22, 0, 19, 17, 18] + list(range(1, 17))
    with pytest.raises(ValueError, match=r"2 latent frames hold no section of data.sections.window=3 \(it needs "
                                         r"at least 3\)"):
        sections.cut(clip(2), SectionsConfig(window=3, order="chunks"))


def test_one_frame_makes_the_last_frame_from_the_first_at_musubis_indices():
    """musubi-tuner's --one_frame cache (fpack_cache_latents.py, encode_and_save_batch_one_frame, no masks,
    control_index 0, target_index = latent_window_size W, post kept, 2x and 4x kept): the target latent at W; clean
    latents [control, zero post] at [0, 1 + W]; 2x at 1 + W + 1 + arange(2); 4x at 1 + W + 1 + 2 + arange(16); the
    2x and 4x latents zeros (fpack_train_network.py's call_dit)."""
    w = 9
    part, = sections.cut(clip(6) + 1, SectionsConfig(window=w, order="one_frame"))  # frame f holds f + 1
    assert values(part["latents"]) == [6]
    assert values(part["history"]) == [1] + [0] * 19
    musubi = [w] + [0, 1 + w] + [1 + w + 1 + i for i in range(2)] + [1 + w + 1 + 2 + i for i in range(16)]
    assert values(part["frame_indices"]) == musubi
    assert sections.count(2, SectionsConfig(order="one_frame")) == 1 and sections.first_frame(
        SectionsConfig(order="one_frame"), 0) == 1  # a one-frame clip [control, made]
    with pytest.raises(ValueError, match=r"a clip: 1 latent frame holds no one-frame section .* at least 2"):
        sections.cut(clip(1), SectionsConfig(order="one_frame"))


@pytest.mark.parametrize("family", ["helios", "hunyuan_framepack"])
def test_history_tokens_are_what_the_dit_adds_to_a_sections_tokens(family):
    """``history_tokens`` (the dry run's count) against the sequence the tiny DiT's first block gets, less the
    section's own tokens, at latent 16 x 16 and 32 x 32."""
    from family_cases import inputs
    from fvx.core import random
    from fvx_models import build
    from fvx_models.helios import HeliosConfig
    from fvx_models.hunyuan_framepack import FramepackConfig

    config = (HeliosConfig if family == "helios" else FramepackConfig)(preset="tiny")
    model, module = config.build(), build.skeleton(config)
    block = module.get_submodule(next(iter(build.unit_groups(config.family, module).values()))[0][:-1])
    params, patch = model.weights.init(random.key(0)), model.memory_spec().patch
    for size in (16, 32):
        x, t, cond = inputs(model, random.key(1), batch=1, frames=4, size=size, text_len=5)
        seen = []
        hook = block.register_forward_pre_hook(lambda _, args, kwargs: seen.append(
            (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True)
        with torch.no_grad():
            torch.func.functional_call(module, (params, dict(module.named_buffers())), (),
                                       build.native_inputs(config, x, t, cond)[0])
        hook.remove()
        section = 4 * (size // patch[1]) * (size // patch[2])
        assert seen[0] - section == sections.history_tokens(size, size, patch), size
