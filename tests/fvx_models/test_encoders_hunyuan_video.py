"""HunyuanVideo's encoders (fvx_models.encoders, the record in fvx_models.hunyuan_video): a tiny random
HunyuanVideoPipeline folder (a LLaMA, CLIP's text model, the HunyuanVideo VAE) saved locally, opened as preprocessing
opens it, against diffusers' own calls. The LLaMA tokenizer is built here so that the pipeline's video template takes
exactly its 95 cropped tokens, as on the real one: the rows kept are the prompt's own tokens and the closing
<|eot_id|>."""
import json
import re
import shutil

import pytest
import torch
import transformers
from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

from fvx.core import random
from fvx.data import batching
from fvx_models import hunyuan_video
from fvx_models.hunyuan_video import HunyuanVideoConfig

PROMPTS = ["red bars moving left", "a cat"]
TEMPLATE, CROP = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama_tokenizer(vocab: dict, merges: list) -> transformers.LlamaTokenizerFast:
    tokenizer = transformers.LlamaTokenizerFast(
        vocab=vocab, merges=merges, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[1],
        unk_token="<unk>", add_bos_token=True, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    return tokenizer


def spelling_merges(words: list[str], vocab: dict) -> list[tuple[str, str]]:
    """BPE merges that spell each of ``words`` as one token, letter by letter (added to ``vocab``), in their order."""
    merges = []
    for word in words:
        for k in range(2, len(word) + 1):
            if (word[:k - 1], word[k - 1]) not in merges:
                merges.append((word[:k - 1], word[k - 1]))
                vocab[word[:k]] = len(vocab)
    return merges


def tiny_llama_tokenizer() -> transformers.LlamaTokenizerFast:
    """A BPE of the template's and prompts' words, split as Llama 3 splits text (letters, digits, punctuation, a space
    joining the next word), one token each, ``▁``-words ranked first (no other word's merges then cut one); the
    longest words of the template's part before the prompt are cut in two until that part is CROP tokens long."""
    texts, head = [TEMPLATE.format(p) for p in PROMPTS], TEMPLATE.split("{}")[0]
    vocab = {"<unk>": 0, **{s: i + 1 for i, s in enumerate(SPECIALS)}}
    for char in sorted({c for t in texts for c in t.replace(" ", "▁")}):
        vocab[char] = len(vocab)
    letters = llama_tokenizer(vocab, [])

    def words(text: str) -> list[str]:
        spelled = letters.convert_ids_to_tokens(letters(text).input_ids)
        spelled = "".join("\0" if t in SPECIALS else t for t in spelled)  # \0: no word spans a special token
        return re.findall(r"\n+|▁?[^\W\d_]+|▁?\d|[^\w▁\n\0]", spelled)

    whole = sorted({w for t in texts for w in words(t)}, key=lambda w: (w[0] != "▁", w))
    trial = dict(vocab)
    short = CROP - len(llama_tokenizer(trial, spelling_merges(whole, trial))(head).input_ids)
    cut = sorted({w for w in words(head) if words(head).count(w) == 1}, key=lambda w: (-len(w), w))[:short]
    halves = [half for w in cut for half in (w[:len(w) // 2], w[len(w) // 2:])]
    merges = spelling_merges([w for w in whole if w not in cut] + halves, vocab)
    return llama_tokenizer(vocab, merges)


def tiny_clip_tokenizer() -> transformers.CLIPTokenizer:
    """CLIP's BPE over single letters (a word's last one with ``</w>``)."""
    letters = sorted(set("".join(PROMPTS).replace(" ", "")))
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({t: len(vocab) + i for i, t in enumerate(letters + [c + "</w>" for c in letters])})
    return transformers.CLIPTokenizer(vocab=vocab, merges=[])


def tiny_hunyuan_vae() -> AutoencoderKLHunyuanVideo:
    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                     norm_num_groups=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer, clip_tokenizer = tiny_llama_tokenizer(), tiny_clip_tokenizer()
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    pipe = HunyuanVideoPipeline(text_encoder=llama, tokenizer=tokenizer, transformer=None, vae=tiny_hunyuan_vae(),
                                scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=clip,
                                tokenizer_2=clip_tokenizer)
    path = tmp_path_factory.mktemp("hunyuan_video")
    pipe.save_pretrained(path)
    return path


def test_the_template_takes_its_cropped_tokens(folder):
    tokenizer = transformers.LlamaTokenizerFast.from_pretrained(folder / "tokenizer")
    assert len(tokenizer(TEMPLATE.split("{}")[0]).input_ids) == CROP
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(TEMPLATE.format(PROMPTS[0])).input_ids)
    assert tokens[CROP:] == ["red", "▁bars", "▁moving", "▁left", "<|eot_id|>"]


def test_text_is_the_pooled_row_then_the_pipelines_tokens(folder):
    opened = hunyuan_video.ENCODERS.open(folder, ["text"])
    rows = opened.encode_text(PROMPTS)
    embeds, pooled, mask = opened.pipe.encode_prompt(PROMPTS, device=torch.device("cpu"))
    assert embeds.shape == (2, 256, 32) and pooled.shape == (2, 16)
    lengths = [5, 3]  # the words and <|eot_id|>: mask's ones, valid tokens first
    assert mask.sum(1).tolist() == lengths and not mask[:, :3].eq(0).any()
    for row, e, p, n in zip(rows, embeds, pooled, lengths):
        assert row.shape == (1 + n, 32)
        assert torch.equal(row[0, :16], p) and not row[0, 16:].any()
        assert torch.equal(row[1:], e[:n])


def test_training_reads_the_stored_rows_back_as_the_pipelines_conditioning(folder):
    opened = hunyuan_video.ENCODERS.open(folder, ["text"])
    samples = [{"text": row.numpy(), "where": f"row {i}"} for i, row in enumerate(opened.encode_text(PROMPTS))]
    batch = batching.collate(samples, [0, 1], text_len=12, cfg_rate=0.0, dropout_key=random.key(0))
    cond = hunyuan_video.cond_from_batch(HunyuanVideoConfig(preset="tiny"), batch)
    embeds, pooled, mask = opened.pipe.encode_prompt(PROMPTS, device=torch.device("cpu"))
    assert torch.equal(cond["pooled"], pooled) and torch.equal(cond["text_mask"], mask[:, :11].float())
    assert torch.equal(cond["text"], embeds[:, :11] * mask[:, :11, None])


def test_video_latents_are_the_vaes_posterior_mean(folder):
    opened = hunyuan_video.ENCODERS.open(folder, ["video"])
    video = torch.rand(3, 5, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = opened.encode_video(video)
    expected = opened.pipe.vae.encode(video[None]).latent_dist.mean[0]
    assert latents.shape == (4, 2, 4, 4) and torch.equal(latents, expected)


def test_a_folder_without_a_text_encoder_is_refused_in_one_line(folder, tmp_path):
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder_2"] = [None, None]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    for name in ("tokenizer", "text_encoder", "tokenizer_2"):
        shutil.copytree(folder / name, tmp_path / name)
    with pytest.raises(ValueError, match=r"has no 'text_encoder_2' component[^\n]*$"):
        hunyuan_video.ENCODERS.open(tmp_path, ["text"])
