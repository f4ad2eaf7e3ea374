"""Qwen2-VL and Qwen2.5-VL on tiny random models against transformers' own Qwen2VLForConditionalGeneration on the
same pixels: images of different sizes (their own grids and token counts), two in one prompt, text
alone, batched and chunked through the images' tokens, then decoding past them with M-RoPE's offset
(through the CPU decode stack); a prefix-cache hit on a repeated image; chat image parts."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from tests.helpers.multimodal import make_tiny_qwen2_vl, random_image

MAX_TOKENS = 10
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=40, use_tqdm_on_load=False)
# (text, [(seed, (width, height))])
PROMPTS = [
    (f"USER: {IMAGE}What is in this picture?\nASSISTANT:", [(1, (64, 48))]),
    (f"USER: Compare {IMAGE} with {IMAGE} please.\nASSISTANT:", [(2, (40, 72)), (3, (64, 64))]),
    ("USER: no picture here, just words.\nASSISTANT:", []),
    (f"USER: {IMAGE}\nWhat is in this picture?\nASSISTANT:", [(4, (96, 32))]),
]


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, **COMMON)


def images(spec) -> list:
    return [random_image(seed, size) for seed, size in spec]


def hf_greedy(directory: str, prompts, device: str = "cpu") -> list[list[int]]:
    """transformers' generate, each placeholder expanded to its image's grid / 4 tokens."""
    image_processor = transformers.AutoImageProcessor.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).to(device)
    out = []
    for text, spec in prompts:
        kwargs = {}
        if spec:
            kwargs = dict(image_processor(images=images(spec), return_tensors="pt"))
            for grid in kwargs["image_grid_thw"]:
                text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
        ids = tokenizer(text, return_tensors="pt").input_ids
        if spec:  # which tokens are the image's: without it transformers gives them 1D positions
            kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        kwargs = {name: value.to(device) for name, value in kwargs.items()}
        generated = model.generate(input_ids=ids.to(device), **kwargs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(generated[0, ids.shape[1] :].tolist())
    return out


def request(text: str, spec) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images(spec)}} if spec else {"prompt": text}


def test_greedy_tokens_match_transformers_batched_and_chunked(llm, tiny_qwen2_vl):
    expected = hf_greedy(tiny_qwen2_vl, PROMPTS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([request(text, spec) for text, spec in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    image_token = llm.llm_engine.processor.multimodal.image_token_id
    assert [o.prompt_token_ids.count(image_token) for o in outputs] == [
        48,
        45 + 64,
        0,
        48,
    ]  # (w / 4) * (h / 4) / 4 each


def test_a_repeated_image_hits_the_prefix_cache_with_its_positions(llm, tiny_qwen2_vl):
    text, spec = PROMPTS[0][0].replace("picture", "image, in detail"), [(5, (64, 48))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(request(text, spec), params, use_tqdm=False)[0]
    again = llm.generate(request(text, spec), params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(tiny_qwen2_vl, [(text, spec)])[0]


def test_chat_image_parts(llm):
    image = random_image(6, (48, 48))
    parts = [{"type": "text", "text": "Look:"}, {"type": "image_pil", "image_pil": image}]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0]
    prompt = f"<|im_start|>user\nLook:{IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    direct = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel(tiny_qwen2_vl, tp, pp):
    """tp: each rank runs the whole tower on the images and its share of the language model; pp: the
    first stage embeds the images, every stage rotates by the same M-RoPE positions."""
    expected = hf_greedy(tiny_qwen2_vl, PROMPTS[:2])
    engine = LLM(tiny_qwen2_vl, tensor_parallel_size=tp, pipeline_parallel_size=pp, **COMMON)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([request(text, spec) for text, spec in PROMPTS[:2]], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory, smollm_tokenizer) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")), smollm_tokenizer, version="2.5")


def test_qwen2_5_vl_windowed_tower_matches_transformers(qwen2_5_vl):
    """Qwen2.5-VL: grids that windows divide (64 x 48: 3 x 4 windows) and do not (40 x 72, 64 x 64's
    4 x 4 units in 2 x 2 windows, 96 x 32), batched and chunked."""
    expected = hf_greedy(qwen2_5_vl, PROMPTS)
    engine = LLM(qwen2_5_vl, **COMMON)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([request(text, spec) for text, spec in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
