"""Multimodal input: images in requests, the processors that turn them into model inputs, and what
the engine carries of them."""
