"""HunyuanVideo's encoders (fvx_models.encoders, the record in fvx_models.hunyuan_video): a tiny random
HunyuanVideoPipeline folder (a LLaMA, CLIP's text model, the HunyuanVideo VAE) saved locally, opened as preprocessing
opens it, against diffusers' own calls.

The LLaMA's tokenizer is a byte-level BPE split as Llama 3 splits text, in a folder laid out as the real one
(``tokenizer.json``, named ``LlamaTokenizerFast``), built so that the pipeline's video template takes exactly its 95
cropped tokens: the rows kept are the prompt's own tokens and the closing <|eot_id|>."""
import json
import shutil

import pytest
import tokenizers
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
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_tokenizer(vocab: dict, merges: list) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE with Llama 3's pre-tokenizer and its <|begin_of_text|> first, padding on the right."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    backend.add_special_tokens(SPECIALS)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), "isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.post_processor = tokenizers.processors.TemplateProcessing(single=f"{SPECIALS[0]} $A",
                                                                      special_tokens=[(SPECIALS[0], 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIALS[0],
                                                eos_token=SPECIALS[1], pad_token=SPECIALS[1])


def spelling_merges(words: list[str], vocab: dict) -> list[tuple[str, str]]:
    """BPE merges that spell each of ``words`` as one token, letter by letter (added to ``vocab``), in their order."""
    merges = []
    for word in words:
        for k in range(2, len(word) + 1):
            if (word[:k - 1], word[k - 1]) not in merges:
                merges.append((word[:k - 1], word[k - 1]))
                vocab[word[:k]] = len(vocab)
    return merges


def tiny_llama_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The template's and prompts' words (Llama 3's pre-tokenizer splits them) one token each, ``Ġ``-words ranked
    first (no other word's merges then cut one); the longest words of the template's part before the prompt are cut
    in two until that part is CROP tokens long, as Llama 3's vocabulary makes it."""
    texts, head = [TEMPLATE.format(p) for p in PROMPTS], TEMPLATE.split("{}")[0]
    letters = llama3_tokenizer({s: i for i, s in enumerate(SPECIALS)}, [])

    def words(text: str) -> list[str]:
        parts = [text]
        for special in SPECIALS:
            parts = [p for part in parts for p in part.split(special)]
        return [w for part in parts for w, _ in letters.backend_tokenizer.pre_tokenizer.pre_tokenize_str(part)]

    whole = sorted({w for t in texts for w in words(t)}, key=lambda w: (w[0] != "Ġ", w))
    vocab = {s: i for i, s in enumerate(SPECIALS + sorted({c for w in whole for c in w}))}
    trial = dict(vocab)
    short = CROP - len(llama3_tokenizer(trial, spelling_merges(whole, trial))(head).input_ids)
    cut = sorted({w for w in words(head) if words(head).count(w) == 1}, key=lambda w: (-len(w), w))[:short]
    halves = [half for w in cut for half in (w[:len(w) // 2], w[len(w) // 2:])]
    return llama3_tokenizer(vocab, spelling_merges([w for w in whole if w not in cut] + halves, vocab))


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
    for file, key, value in ((path / "model_index.json", "tokenizer", ["transformers", "LlamaTokenizerFast"]),
                             (path / "tokenizer" / "tokenizer_config.json", "tokenizer_class", "LlamaTokenizerFast")):
        file.write_text(json.dumps({**json.loads(file.read_text()), key: value}))  # as the real folder names it
    return path


def test_the_llama_tokenizer_is_read_as_its_tokenizer_json_and_the_template_takes_its_cropped_tokens(folder):
    tokenizer = hunyuan_video.ENCODERS.open(folder, ["text"]).pipe.tokenizer
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer" / "tokenizer.json"))
    texts = [TEMPLATE.split("{}")[0]] + [TEMPLATE.format(p) for p in PROMPTS]
    assert [tokenizer(t).input_ids for t in texts] == [reference.encode(t).ids for t in texts]
    assert len(tokenizer(texts[0]).input_ids) == CROP and tokenizer.padding_side == "right"
    assert tokenizer.convert_ids_to_tokens(tokenizer(texts[1]).input_ids)[CROP:] == [
        "red", "Ġbars", "Ġmoving", "Ġleft", "<|eot_id|>"]


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
