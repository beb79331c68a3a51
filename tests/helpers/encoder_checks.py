"""What the per-family encoder tests (tests/fvx_models/test_encoders_*.py) share: the checks every record passes (video
latents are the VAE's posterior mean, a folder missing a component is refused in one line) and the tiny tokenizers,
models and latent statistics more than one family's folder is built from."""
import json
import pathlib
import shutil
from collections.abc import Callable

import pytest
import torch
import transformers
from diffusers import AutoencoderKLHunyuanVideo
from tokenizers.pre_tokenizers import ByteLevel

from fvx.core import random
from fvx.data import batching

# ------------------------------------------------------------------------------------------------- checks every record


def random_clip(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    """A seeded clip ``[3, F, H, W]`` drawn uniformly in [-1, 1], as preprocessing hands the video encoder."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def assert_video_latents_are_the_posterior_mean(record, folder: pathlib.Path, clip_shape: tuple[int, ...],
                                                latent_shape: tuple[int, ...]) -> None:
    """``record`` opened on ``folder`` for video encodes a random clip of ``clip_shape`` to exactly the mean of the
    pipeline VAE's posterior (unnormalised), of ``latent_shape``."""
    opened = record.open(folder, ["video"])
    video = random_clip(clip_shape)
    latents = opened.encode_video(video)
    expected = opened.pipe.vae.encode(video[None]).latent_dist.mean[0]
    assert latents.shape == latent_shape and torch.equal(latents, expected)


def assert_refused_without(record, folder: pathlib.Path, tmp_path: pathlib.Path, missing: str, kept: tuple[str, ...],
                           match: str, index_file: str = "model_index.json") -> None:
    """A copy of ``folder`` in ``tmp_path`` (its ``index_file`` with component ``missing`` nulled, the ``kept``
    component folders) opened for text raises a one-line ValueError matching ``match``."""
    index = json.loads((folder / index_file).read_text())
    index[missing] = [None, None] + index[missing][2:]  # library and class nulled; a modular index keeps its spec
    (tmp_path / index_file).write_text(json.dumps(index))
    for name in kept:
        shutil.copytree(folder / name, tmp_path / name)
    with pytest.raises(ValueError, match=match) as error:
        record.open(tmp_path, ["text"])
    assert "\n" not in str(error.value)


def assert_text_is_the_pipelines_encode_prompt_cut_to_its_tokens(opened) -> None:
    """A T5-encoded Wan-style record: each prompt's rows are ``encode_prompt``'s padded rows cut to its tokens, the
    rest of those zero."""
    prompts = ["red bars moving left", "a   cat"]
    rows = opened.encode_text(prompts)
    full, _ = opened.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512)
    assert [r.shape for r in rows] == [(5, 16), (3, 16)]  # 4 words + </s>; "a cat" + </s> (whitespace cleaned)
    for row, padded in zip(rows, full):
        assert torch.equal(row, padded[:len(row)]) and not padded[len(row):].any()


# -------------------------------------------------------------------------- Qwen's byte-level tokenizer, chat template

# A Qwen-style chat template (string or typed-text contents) over a tokenizer of single bytes: every character a token
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_qwen_tokenizer() -> transformers.Qwen2Tokenizer:
    """Qwen2's tokenizer over the 256 byte-level symbols (no merges), ChatML's markers and CHAT_TEMPLATE."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=[],
                                            additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------- a prompt template's cropped tokens (HunyuanVideo's LLaMA, Kandinsky 5's Qwen)


def spelling_merges(words: list[str], vocab: dict) -> list[tuple[str, str]]:
    """BPE merges that spell each of ``words`` as one token, letter by letter (added to ``vocab``), in their order."""
    merges = []
    for word in words:
        for k in range(2, len(word) + 1):
            if (word[:k - 1], word[k - 1]) not in merges:
                merges.append((word[:k - 1], word[k - 1]))
                vocab[word[:k]] = len(vocab)
    return merges


def template_cropping_tokenizer(make: Callable[[dict, list], transformers.PreTrainedTokenizerBase], base_vocab: dict,
                                specials: list[str], texts: list[str], head: str, crop: int):
    """``make(vocab, merges)`` over ``base_vocab`` then the letters of ``texts``' words (``make``'s own pre-tokenizer
    splits the text between ``specials``), each word one token, ``Ġ``-words ranked first (no other word's merges then
    cut one); the longest words of ``head`` (the template before the prompt) are cut in two until ``head`` is ``crop``
    tokens long, as the real vocabulary makes it."""
    letters = make(dict(base_vocab), [])

    def words(text: str) -> list[str]:
        parts = [text]
        for special in specials:
            parts = [p for part in parts for p in part.split(special)]
        return [w for part in parts for w, _ in letters.backend_tokenizer.pre_tokenizer.pre_tokenize_str(part)]

    whole = sorted({w for t in texts for w in words(t)}, key=lambda w: (w[0] != "Ġ", w))
    vocab = {**base_vocab, **{c: len(base_vocab) + i for i, c in enumerate(sorted({c for w in whole for c in w}))}}
    trial = dict(vocab)
    short = crop - len(make(trial, spelling_merges(whole, trial))(head).input_ids)
    cut = sorted({w for w in words(head) if words(head).count(w) == 1}, key=lambda w: (-len(w), w))[:short]
    halves = [half for w in cut for half in (w[:len(w) // 2], w[len(w) // 2:])]
    return make(vocab, spelling_merges([w for w in whole if w not in cut] + halves, vocab))


# --------------------------------------------- CLIP's pooled text and the HunyuanVideo VAE (HunyuanVideo, Kandinsky 5)


def tiny_clip_tokenizer(prompts: list[str]) -> transformers.CLIPTokenizer:
    """CLIP's BPE over the single letters of ``prompts`` (a word's last one with ``</w>``)."""
    letters = sorted(set("".join(prompts).replace(" ", "")))
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({t: len(vocab) + i for i, t in enumerate(letters + [c + "</w>" for c in letters])})
    return transformers.CLIPTokenizer(vocab=vocab, merges=[])


def tiny_clip_text(vocab_size: int) -> transformers.CLIPTextModel:
    """CLIP's text model, width 16 (the pooled row), 2 layers, drawn from torch's global generator."""
    return transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1))


def tiny_hunyuan_vae() -> AutoencoderKLHunyuanVideo:
    """The HunyuanVideo VAE, 4 channels of 4x time and 8x space compression, drawn from torch's global generator."""
    return AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                     norm_num_groups=4)


def assert_pooled_row_then_tokens(rows: list[torch.Tensor], pooled: torch.Tensor, tokens: list[torch.Tensor]) -> None:
    """Each stored row ``[1 + n, D]`` is its pooled vector ``[P]`` zero-padded to D, then its token rows ``[n, D]``."""
    for row, p, t in zip(rows, pooled, tokens):
        assert row.shape == (1 + len(t), t.shape[-1])
        assert torch.equal(row[0, :len(p)], p) and not row[0, len(p):].any()
        assert torch.equal(row[1:], t)


def collate_stored_rows(rows: list[torch.Tensor], text_len: int) -> dict:
    """The training batch the stored text rows make (no caption dropout), padded or cut to ``text_len``."""
    samples = [{"text": row.numpy(), "where": f"row {i}"} for i, row in enumerate(rows)]
    return batching.collate(samples, list(range(len(rows))), text_len=text_len, cfg_rate=0.0,
                            dropout_key=random.key(0))


# ------------------------------------------------------------------------------------ LTX's latents (LTX-Video, LTX-2)


def draw_latent_statistics(vae):
    """``vae`` with per-channel latent statistics not 0/1 (8 channels): a mean from -0.5 to 0.5, a std 0.5 to 2."""
    vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, 8))
    vae.latents_std.copy_(torch.linspace(0.5, 2.0, 8))
    return vae


def ltx_normalised_mean(vae, video: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """The posterior mean ``[C, T, H, W]`` of ``video [3, F, H, W]``, normalised as the LTX pipelines normalise it:
    ``(mean - latents_mean) * scaling_factor / latents_std``."""
    mean = vae.encode(video[None]).latent_dist.mean[0]
    return (mean - vae.latents_mean.view(-1, 1, 1, 1)) * scaling_factor / vae.latents_std.view(-1, 1, 1, 1)
