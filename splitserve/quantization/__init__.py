"""Quantization: the offline `splitserve quantize` tool, quantized linear layers at run time, and the
quantized KV cache."""
