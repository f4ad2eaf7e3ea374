"""Speculative decoding: proposing draft tokens that the target model verifies in one step.

`config.py` holds `SpeculativeConfig` (vLLM's `speculative_config`); `ngram.py` and `suffix.py`
are the model-free proposers, which run in the engine on each request's token ids; the draft-model
proposer runs beside the target model in the model runner (executor/draft_model.py). The engine
verifies drafts by sampling the target at every draft position (executor/input_batch.py), so that
accepted tokens are exactly what the target alone would produce: see docs/speculative.md.
"""
