"""The engine core: what runs in the engine process (or in-process under the offline LLM) around the
model executor: the EngineCore loop, the scheduler and its policies, the KV cache manager, the requests,
each step's input, speculative decoding, structured output, the PD engine side, sleep and weight
updates, KV events. The front-ends (engine/: AsyncLLM, LLMEngine, DP, processor, output processor,
detokenizer, supervisor, args) talk to it through engine/messages.py; nothing here imports them."""
