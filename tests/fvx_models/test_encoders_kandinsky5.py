"""Kandinsky 5's encoders (fvx_models.encoders, the record in fvx_models.kandinsky5): a tiny random
Kandinsky5T2VPipeline folder (a Qwen2.5-VL, CLIP's text model, the HunyuanVideo VAE) saved locally, opened as
preprocessing opens it, against diffusers' own calls. The Qwen tokenizer is built here so that the pipeline's template
takes exactly the tokens it crops, as on the real one: the rows kept are the prompt's own tokens and the closing
<|im_end|>.

The real folder's ``tokenizer`` is a ``Qwen2VLProcessor``, which transformers 5 builds only with torchvision (its
video processor's base class); torchvision is not installed here. The pipeline calls it on text alone, which a
processor hands to its tokenizer unchanged (``ProcessorMixin.__call__``: no image or video placeholders to expand), so
the record loads that tokenizer itself (``kandinsky5.qwen_tokenizer``) and this folder, named as the real one, holds
only the tokenizer's files; the last test checks the claim where torchvision is."""
import json
import shutil

import pytest
import torch
import transformers
from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline

from fvx.core import random
from fvx.data import batching
from fvx_models import kandinsky5
from fvx_models.kandinsky5 import Kandinsky5Config

PROMPTS = ["red bars moving left", "a   cat"]  # the pipeline cleans whitespace: "a cat"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TEMPLATE_OF = Kandinsky5T2VPipeline(transformer=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                     tokenizer_2=None, scheduler=FlowMatchEulerDiscreteScheduler())
TEMPLATE, CROP = _TEMPLATE_OF.prompt_template, _TEMPLATE_OF.prompt_template_encode_start_idx


def qwen_tokenizer(vocab: dict, merges: list) -> transformers.Qwen2Tokenizer:
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
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


def tiny_qwen_tokenizer() -> transformers.Qwen2Tokenizer:
    """A byte-level BPE of the template's and prompts' words (Qwen's own pre-tokenizer splits them), one token each,
    ``Ġ``-words ranked first (no other word's merges then cut one); the longest words of the template's part before
    the prompt are cut in two until that part is CROP tokens long, as Qwen's vocabulary makes it."""
    texts, head = [TEMPLATE.format(p.replace("   ", " ")) for p in PROMPTS], TEMPLATE.split("{}")[0]
    letters = qwen_tokenizer({SPECIALS[0]: 0}, [])

    def words(text: str) -> list[str]:
        parts = [text]
        for special in SPECIALS[1:]:
            parts = [p for part in parts for p in part.split(special)]
        return [w for part in parts for w, _ in letters.backend_tokenizer.pre_tokenizer.pre_tokenize_str(part)]

    whole = sorted({w for t in texts for w in words(t)}, key=lambda w: (w[0] != "Ġ", w))
    vocab = {SPECIALS[0]: 0, **{c: i + 1 for i, c in enumerate(sorted({c for w in whole for c in w}))}}
    trial = dict(vocab)
    short = CROP - len(qwen_tokenizer(trial, spelling_merges(whole, trial))(head).input_ids)
    cut = sorted({w for w in words(head) if words(head).count(w) == 1}, key=lambda w: (-len(w), w))[:short]
    halves = [half for w in cut for half in (w[:len(w) // 2], w[len(w) // 2:])]
    return qwen_tokenizer(vocab, spelling_merges([w for w in whole if w not in cut] + halves, vocab))


def tiny_clip_tokenizer() -> transformers.CLIPTokenizer:
    """CLIP's BPE over single letters (a word's last one with ``</w>``)."""
    letters = sorted(set("".join(PROMPTS).replace(" ", "")))
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({t: len(vocab) + i for i, t in enumerate(letters + [c + "</w>" for c in letters])})
    return transformers.CLIPTokenizer(vocab=vocab, merges=[])


def tiny_qwen(vocab_size: int) -> transformers.Qwen2_5_VLForConditionalGeneration:
    return transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0])))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer, clip_tokenizer = tiny_qwen_tokenizer(), tiny_clip_tokenizer()
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    vae = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                    norm_num_groups=4)
    pipe = Kandinsky5T2VPipeline(transformer=None, vae=vae, text_encoder=tiny_qwen(len(tokenizer)),
                                 tokenizer=tokenizer, text_encoder_2=clip, tokenizer_2=clip_tokenizer,
                                 scheduler=FlowMatchEulerDiscreteScheduler())
    path = tmp_path_factory.mktemp("kandinsky5")
    pipe.save_pretrained(path)
    index = json.loads((path / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "Qwen2VLProcessor"]  # as the real folder names it
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def test_the_qwen_tokenizer_is_the_folders_and_the_template_takes_its_cropped_tokens(folder):
    tokenizer = kandinsky5.ENCODERS.open(folder, ["text"]).pipe.tokenizer
    assert type(tokenizer) is transformers.Qwen2Tokenizer and tokenizer.padding_side == "right"
    assert len(tokenizer(TEMPLATE.split("{}")[0]).input_ids) == CROP
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(TEMPLATE.format(PROMPTS[0])).input_ids)
    assert tokens[CROP:] == ["red", "Ġbars", "Ġmoving", "Ġleft", "<|im_end|>"]


def real_tokens(pipe, embeds: torch.Tensor) -> list[torch.Tensor]:
    """Each prompt's rows of ``embeds`` where its tokens (the pipeline's cleaned prompt in its template, tokenized as
    it tokenizes them) are, the template's cropped: the reference cut, independent of ``cu_seqlens``."""
    texts = [TEMPLATE.format(" ".join(p.split())) for p in PROMPTS]
    mask = pipe.tokenizer(texts, max_length=CROP + kandinsky5.TEXT_LEN, truncation=True, padding=True,
                          return_tensors="pt").attention_mask[:, CROP:]
    return [e[m.bool()] for e, m in zip(embeds, mask)]


@pytest.mark.parametrize("side", ["right", "left"])
def test_text_is_the_pooled_row_then_the_pipelines_tokens(folder, side):
    opened = kandinsky5.ENCODERS.open(folder, ["text"])
    opened.pipe.tokenizer.padding_side = side
    rows = opened.encode_text(PROMPTS)
    embeds, pooled, cu_seqlens = opened.pipe.encode_prompt(PROMPTS, max_sequence_length=512,
                                                           device=torch.device("cpu"))
    lengths = [5, 3] if side == "right" else [5, 5]  # left padding: the crop keeps 2 template tokens of "a cat"
    assert embeds.shape == (2, 5, 32) and pooled.shape == (2, 16) and cu_seqlens.diff().tolist() == lengths
    expected = real_tokens(opened.pipe, embeds)
    assert [len(t) for t in expected] == lengths
    for row, tokens, p in zip(rows, expected, pooled):
        assert row.shape == (1 + len(tokens), 32)
        assert torch.equal(row[0, :16], p) and not row[0, 16:].any()
        assert torch.equal(row[1:], tokens)


def test_training_reads_the_stored_rows_back_as_the_pipelines_conditioning(folder):
    opened = kandinsky5.ENCODERS.open(folder, ["text"])
    samples = [{"text": row.numpy(), "where": f"row {i}"} for i, row in enumerate(opened.encode_text(PROMPTS))]
    batch = batching.collate(samples, [0, 1], text_len=9, cfg_rate=0.0, dropout_key=random.key(0))
    cond = kandinsky5.cond_from_batch(Kandinsky5Config(preset="tiny"), batch)
    embeds, pooled, _ = opened.pipe.encode_prompt(PROMPTS, max_sequence_length=512, device=torch.device("cpu"))
    mask = torch.tensor([[1.0] * 5 + [0.0] * 3, [1.0] * 3 + [0.0] * 5])
    assert torch.equal(cond["pooled"], pooled) and torch.equal(cond["text_mask"], mask)
    assert torch.equal(cond["text"][:, :5], embeds * mask[:, :5, None]) and not cond["text"][:, 5:].any()


def test_video_latents_are_the_vaes_posterior_mean(folder):
    opened = kandinsky5.ENCODERS.open(folder, ["video"])
    video = torch.rand(3, 5, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = opened.encode_video(video)
    expected = opened.pipe.vae.encode(video[None]).latent_dist.mean[0]
    assert latents.shape == (4, 2, 4, 4) and torch.equal(latents, expected)


def test_a_folder_without_a_text_encoder_is_refused_in_one_line(folder, tmp_path):
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder"] = [None, None]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    for name in ("tokenizer", "tokenizer_2", "text_encoder_2"):
        shutil.copytree(folder / name, tmp_path / name)
    with pytest.raises(ValueError, match=r"has no 'text_encoder' component[^\n]*$"):
        kandinsky5.ENCODERS.open(tmp_path, ["text"])


def test_a_qwen2vl_processor_tokenizes_text_as_its_tokenizer(folder):
    pytest.importorskip("torchvision")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "tokenizer")
    processor = transformers.Qwen2VLProcessor(image_processor=transformers.Qwen2VLImageProcessor(),
                                              tokenizer=tokenizer, video_processor=transformers.Qwen2VLVideoProcessor())
    texts = [TEMPLATE.format(p) for p in PROMPTS]
    kwargs = dict(images=None, videos=None, max_length=CROP + 512, truncation=True, return_tensors="pt", padding=True)
    by_processor, by_tokenizer = processor(text=texts, **kwargs), tokenizer(text=texts, **kwargs)
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(by_processor[key], by_tokenizer[key])
