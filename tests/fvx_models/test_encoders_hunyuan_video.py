"""HunyuanVideo's encoders (fvx_models.encoders, the record in fvx_models.hunyuan_video): a tiny random
HunyuanVideoPipeline folder (a LLaMA, CLIP's text model, the HunyuanVideo VAE) saved locally, opened as preprocessing
opens it, against diffusers' own calls.

The LLaMA's tokenizer is a byte-level BPE split as Llama 3 splits text, in a folder laid out as the real one
(``tokenizer.json``, named ``LlamaTokenizerFast``), built so that the pipeline's video template takes exactly its 95
cropped tokens: the rows kept are the prompt's own tokens and the closing <|eot_id|>."""
import json

import pytest
import tokenizers
import torch
import transformers
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

import encoder_checks
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


def tiny_llama_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The template's and prompts' words (Llama 3's pre-tokenizer splits them) one token each, the template's part
    before the prompt CROP tokens long, as Llama 3's vocabulary makes it."""
    return encoder_checks.template_cropping_tokenizer(
        llama3_tokenizer, {s: i for i, s in enumerate(SPECIALS)}, SPECIALS, [TEMPLATE.format(p) for p in PROMPTS],
        TEMPLATE.split("{}")[0], CROP)


def tiny_components() -> dict:
    """HunyuanVideo's pipeline components but the DiT: a tiny LLaMA and CLIP text model with their tokenizers, the
    tiny HunyuanVideo VAE, a scheduler (FramePack's pipeline takes the same)."""
    torch.manual_seed(0)
    tokenizer, clip_tokenizer = tiny_llama_tokenizer(), encoder_checks.tiny_clip_tokenizer(PROMPTS)
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id))
    clip = encoder_checks.tiny_clip_text(len(clip_tokenizer))
    torch.manual_seed(0)
    return dict(text_encoder=llama, tokenizer=tokenizer, transformer=None, vae=encoder_checks.tiny_hunyuan_vae(),
                scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=clip, tokenizer_2=clip_tokenizer)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pipe = HunyuanVideoPipeline(**tiny_components())
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
    encoder_checks.assert_pooled_row_then_tokens(rows, pooled, [e[:n] for e, n in zip(embeds, lengths)])


def test_training_reads_the_stored_rows_back_as_the_pipelines_conditioning(folder):
    opened = hunyuan_video.ENCODERS.open(folder, ["text"])
    batch = encoder_checks.collate_stored_rows(opened.encode_text(PROMPTS), text_len=12)
    cond = hunyuan_video.HUNYUAN_VIDEO.conditioning.from_batch(HunyuanVideoConfig(preset="tiny"), batch)
    embeds, pooled, mask = opened.pipe.encode_prompt(PROMPTS, device=torch.device("cpu"))
    assert torch.equal(cond["pooled"], pooled) and torch.equal(cond["text_mask"], mask[:, :11].float())
    assert torch.equal(cond["text"], embeds[:, :11] * mask[:, :11, None])


def test_video_latents_are_the_vaes_posterior_mean(folder):
    encoder_checks.assert_video_latents_are_the_posterior_mean(hunyuan_video.ENCODERS, folder, (3, 5, 32, 32),
                                                               (4, 2, 4, 4))


def test_a_folder_without_a_text_encoder_is_refused_in_one_line(folder, tmp_path):
    encoder_checks.assert_refused_without(hunyuan_video.ENCODERS, folder, tmp_path, "text_encoder_2",
                                          ("tokenizer", "text_encoder", "tokenizer_2"),
                                          r"has no 'text_encoder_2' component[^\n]*$")
