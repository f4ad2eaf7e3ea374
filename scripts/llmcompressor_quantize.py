"""The llm-compressor peer of `splitserve quantize` for the side-by-side 4-bit quality benchmark
(scripts/quant_peers.sh, docs/quantization.md): GPTQ or AWQ W4A16 of a Hugging Face directory with
llm-compressor's own defaults, calibrated on the same token sequences as splitserve's run, written as
a compressed-tensors ("pack-quantized") checkpoint that `splitserve perplexity` loads.

Runs in llm-compressor's own environment, not splitserve's:

    python3 -m venv /tmp/lc-venv && /tmp/lc-venv/bin/pip install torch==2.13.0 llmcompressor
    /tmp/lc-venv/bin/python scripts/llmcompressor_quantize.py BASE_DIR OUT_DIR --method gptq \
        --group-size 64 --calib-ids calib_ids.txt [--sym]

`--calib-ids` is a file of token ids, one sequence per line (what `splitserve quantize
--tokenids-path` reads), so that both tools see exactly the same calibration tokens.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("out")
    parser.add_argument("--method", choices=("gptq", "awq"), required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--sym", action="store_true", help="symmetric (default: asymmetric, a zero point per group)")
    parser.add_argument("--calib-ids", required=True, help="token ids, one calibration sequence per line")
    args = parser.parse_args()

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        # llm-compressor's AWQ pins its cached activations, which torch refuses without an accelerator;
        # pinning only speeds up copies to a GPU, so on a CPU-only host it is skipped.
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    with open(args.calib_ids, encoding="utf-8") as f:
        sequences = [[int(t) for t in line.replace(",", " ").split()] for line in f if line.strip()]
    dataset = Dataset.from_dict({"input_ids": sequences, "attention_mask": [[1] * len(s) for s in sequences]})

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=args.sym, strategy="group", group_size=args.group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    if args.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = [GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]
    else:
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        recipe = [AWQModifier(), QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]

    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    start = time.perf_counter()
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(sequences),
        max_seq_length=max(len(s) for s in sequences),
        shuffle_calibration_samples=False,
    )
    levels = "sym" if args.sym else "asym"
    print(f"llm-compressor {args.method} g{args.group_size} {levels}: {time.perf_counter() - start:.1f} s")
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
