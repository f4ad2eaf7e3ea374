"""Image input on a tiny random LLaVA (CLIP tower, projector, Llama) against transformers' own
LlavaForConditionalGeneration on the same pixels: greedy tokens of prompts with one, two and no
images, batched, chunked through the images' tokens and hitting the prefix cache; the encoder cache
(an image encoded once however often it comes); the prefix cache keyed by the image (a different
image never shares its blocks); LLM.chat with image parts; and what bad input gets."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.engine.errors import InvalidRequestError
from splitserve.multimodal.media import encode_data_uri
from tests.helpers.multimodal import LLAVA_IMAGE_TOKENS, random_image

MAX_TOKENS = 10
# 24 tokens a step: every image's 64 tokens are computed over three or four steps, split inside them.
COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=24, use_tqdm_on_load=False)
PROMPTS = [
    ("USER: <image>\nWhat is in this picture?\nASSISTANT:", [1]),
    ("USER: Compare <image> with <image> please.\nASSISTANT:", [2, 3]),
    ("USER: no picture here, just words.\nASSISTANT:", []),
    ("USER: <image>\nWhat is in this picture?\nASSISTANT:", [4]),
]


@pytest.fixture(scope="module")
def llm(tiny_llava):
    return LLM(tiny_llava, **COMMON)


def hf_greedy(directory: str, prompts, device: str = "cpu") -> list[list[int]]:
    processor = transformers.AutoProcessor.from_pretrained(directory)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).to(device)
    out = []
    for text, seeds in prompts:
        images = [random_image(s) for s in seeds] or None
        inputs = processor(text=text, images=images, return_tensors="pt").to(device)
        ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def request(text: str, seeds: list[int]) -> dict:
    images = [random_image(s) for s in seeds]
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def encoder_cache(llm):
    return llm.llm_engine.engine_core.executor.runner.encoder_cache


def test_greedy_tokens_match_transformers_batched_and_chunked(llm, tiny_llava):
    expected = hf_greedy(tiny_llava, PROMPTS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([request(text, seeds) for text, seeds in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    image_tokens = [o.prompt_token_ids.count(llm.llm_engine.processor.multimodal.image_token_id) for o in outputs]
    assert image_tokens == [LLAVA_IMAGE_TOKENS, 2 * LLAVA_IMAGE_TOKENS, 0, LLAVA_IMAGE_TOKENS]


def test_an_image_is_encoded_once_and_its_blocks_are_keyed_by_it(llm, tiny_llava):
    cache = encoder_cache(llm)
    text = "USER: <image>\nDescribe it in detail, please, with every colour you see.\nASSISTANT:"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    before = cache.num_encoded
    first = llm.generate(request(text, [7]), params, use_tqdm=False)[0]
    again = llm.generate(request(text, [7]), params, use_tqdm=False)[0]
    other = llm.generate(request(text, [8]), params, use_tqdm=False)[0]
    assert cache.num_encoded - before == 2  # image 7 once (chunked over steps, then a prefix hit), image 8 once
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens >= LLAVA_IMAGE_TOKENS  # the whole image's blocks came from the cache
    offset = first.prompt_token_ids.index(llm.llm_engine.processor.multimodal.image_token_id)
    assert other.num_cached_tokens <= offset  # same tokens, other pixels: no block holding the image is shared
    assert other.outputs[0].token_ids == hf_greedy(tiny_llava, [(text, [8])])[0]


def test_chat_with_image_parts_is_the_rendered_prompt_with_its_image(llm):
    image = random_image(9)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": encode_data_uri(image)}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    prompt = "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
    direct = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, match",
    [
        (
            {"prompt": "USER: <image> and <image>", "multi_modal_data": {"image": [random_image(1)]}},
            "2 image placeholders",
        ),
        ({"prompt": "USER: hello", "multi_modal_data": {"image": random_image(1)}}, "0 image placeholders"),
        ({"prompt": "USER: <image>", "multi_modal_data": {"image": b"not an image"}}, "decode"),
        ({"prompt": "USER: <image>", "multi_modal_data": {"video": [1]}}, "only 'image'"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": random_image(1)}}, "token ids are not taken"),
        ({"prompt": "USER: <image>"}, "image tokens but no images"),
    ],
)
def test_bad_input_is_refused_and_the_engine_goes_on(llm, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate(request(*PROMPTS[0]), SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_limit_mm_per_prompt(tiny_llava):
    engine = LLM(tiny_llava, limit_mm_per_prompt={"image": 1}, **COMMON)
    with pytest.raises(InvalidRequestError, match="at most 1 per prompt"):
        engine.generate(request(*PROMPTS[1]), SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_text_model_refuses_images_and_enable_mm(tiny_models):
    with pytest.raises(ValueError, match="no vision encoder"):
        LLM(tiny_models["llama"], enable_mm=True, **COMMON)
    engine = LLM(tiny_models["llama"], **COMMON)
    with pytest.raises(InvalidRequestError, match="no vision encoder"):
        engine.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(1)}}, use_tqdm=False)


def test_lmdeploy_pipeline_takes_prompt_image_pairs(tiny_llava, llm, tmp_path):
    """LMDeploy's VLM forms: pipe((prompt, image)), pipe([(prompt, [images])]), load_image from
    splitserve.vl, and OpenAI-style image parts in a conversation, each the chat the pair stands for."""
    from splitserve import GenerationConfig, PytorchEngineConfig, pipeline
    from splitserve.vl import load_image

    random_image(21).save(tmp_path / "a.png")
    image, second = load_image(str(tmp_path / "a.png")), random_image(22)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def chat(text, images):
        parts = [{"type": "image_pil", "image_pil": i} for i in images] + [{"type": "text", "text": text}]
        return llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0].outputs[0].text

    gen = GenerationConfig(max_new_tokens=MAX_TOKENS, top_k=1, ignore_eos=True)
    with pipeline(tiny_llava, backend_config=PytorchEngineConfig(dtype="float32")) as pipe:
        single = pipe(("describe this image", image), gen_config=gen)
        batch = pipe([("compare them", [image, second]), ("describe this image", second)], gen_config=gen)
        uri = encode_data_uri(second)
        parts = [{"type": "text", "text": "describe this image"}, {"type": "image_url", "image_url": {"url": uri}}]
        conversation = pipe([{"role": "user", "content": parts}], gen_config=gen)
    assert single.text == chat("describe this image", [image])
    assert [r.text for r in batch] == [chat("compare them", [image, second]), chat("describe this image", [second])]
    offline = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0].outputs[0].text
    assert conversation.text == offline  # image after the text, where its part is
    with pytest.raises(ValueError, match="decoded"):
        load_image(b"\x89PNG broken")
