"""Random-weight PEFT LoRA adapters of a model, for benchmarking LoRA serving (docs/lora.md):

    python scripts/make_lora_adapters.py [MODEL] OUT_DIR --count 4 --rank 16

MODEL: a Hugging Face directory or a .gguf file (default: the embedded SmolLM2-135M-Instruct). Each
adapter targets every attention and MLP projection, with A and B drawn from N(0, 0.02^2) (PEFT starts
B at zero, which would make the adapter cost nothing to apply in some engines and change nothing).
Needs peft (a test dependency of splitserve)."""

from __future__ import annotations

import argparse
import os

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("out_dir")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    ns = parser.parse_args()

    import peft
    import torch
    import transformers

    from splitserve.loader.resolve import default_model_path

    model = ns.model or default_model_path()
    if model.endswith(".gguf"):
        kwargs = {"gguf_file": os.path.basename(model)}
        model = os.path.dirname(model)
    else:
        kwargs = {}
    for i in range(ns.count):
        base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **kwargs)
        config = peft.LoraConfig(r=ns.rank, lora_alpha=ns.alpha, target_modules=PROJECTIONS, lora_dropout=0.0)
        adapted = peft.get_peft_model(base, config)
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        path = os.path.join(ns.out_dir, f"lora{i}")
        adapted.save_pretrained(path)
        print(f"lora{i}={path}")


if __name__ == "__main__":
    main()
