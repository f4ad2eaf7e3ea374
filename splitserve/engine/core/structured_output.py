"""Structured output (guided decoding) with xgrammar, the library vLLM, SGLang and TensorRT-LLM use.

- `GuideCompiler` turns a request's GuidedDecodingParams into an xgrammar CompiledGrammar, cached
  per guide (xgrammar caches compiled grammars by their source). The front-end compiles every
  guide once to refuse a bad one with a 400 naming the problem; the engine compiles its own copy.
- `StructuredOutputManager` is the engine's side: grammars are compiled on a worker thread, never
  on the engine loop, while the request waits outside the scheduler; then each request gets its
  own GrammarMatcher, which accepts every sampled token and gives the token bitmask of the next
  step (one int32 word per 32 tokens, a set bit allows the token). The bitmask travels with the
  step to the model runner, which masks the logits of the whole batch before sampling
  (executor/sampler.py's apply_token_bitmask).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from splitserve.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)


class GuideCompiler:
    """Compiles guides for one tokenizer and model vocabulary (the logits' width), or for a
    TokenizerInfo a front-end serialized (`info`)."""

    def __init__(self, tokenizer=None, vocab_size: int | None = None, info=None):
        import xgrammar as xgr

        self.info = info if info is not None else xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self._lock = threading.Lock()  # one compiler, used from the event loop's worker threads

    def compile(self, guide: GuidedDecodingParams):
        """The guide's CompiledGrammar; ValueError (naming the guide's kind) when it does not compile."""
        try:
            with self._lock:
                return self._compile(guide)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own errors
            raise ValueError(f"The {_describe(guide)} cannot be used for structured output: {exc}") from None

    def _compile(self, guide: GuidedDecodingParams):
        kind = guide.kind
        if kind == "json":
            json.loads(guide.json)  # a clearer message than xgrammar's for text that is not JSON
            return self.compiler.compile_json_schema(guide.json, any_whitespace=_any_whitespace(guide))
        if kind == "json_object":  # OpenAI's json_object: a JSON object (not any JSON value)
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=_any_whitespace(guide))
        if kind == "regex":
            return self.compiler.compile_regex(guide.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(guide.choice))
        return self.compiler.compile_grammar(guide.grammar)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are the choices (string literals, escaped as JSON escapes them)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _any_whitespace(guide: GuidedDecodingParams) -> bool:
    """Free whitespace in JSON, or one-line JSON: `disable_any_whitespace` when set (the front-end's
    Processor fills it from --structured-outputs-config), else vLLM's guided_whitespace_pattern as
    xgrammar can honour it (a pattern that admits no whitespace at all gives compact JSON; any
    other lets the model place whitespace freely), else xgrammar's own default (free)."""
    if guide.disable_any_whitespace is not None:
        return not guide.disable_any_whitespace
    pattern = guide.whitespace_pattern
    return pattern is None or re.fullmatch(pattern, " ") is not None or re.fullmatch(pattern, "\n") is not None


def _describe(guide: GuidedDecodingParams) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regular expression",
        "choice": "choice list",
        "grammar": "grammar",
    }[guide.kind]


class StructuredOutputManager:
    """The engine's grammars: compiled on a worker thread, one matcher per request."""

    def __init__(self, model_config, tokenizer=None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: GuideCompiler | None = None  # made on first use: the engine needs no tokenizer otherwise
        self._tokenizer_info = None  # what a front-end sent (GrammarVocabulary), if it did
        self.compiling: dict[str, tuple[object, Future]] = {}  # request id -> (Request, its grammar's future)

    # --- requests waiting for their grammar, outside the scheduler ------------------------------
    def admit(self, request) -> None:
        """A guided request: its grammar compiles off the engine loop; take_compiled() hands it back."""
        self.compiling[request.request_id] = (request, self.submit(request.sampling_params.guided_decoding))

    def discard(self, request_id: str) -> bool:
        """Forget a request still compiling (aborted); whether it was."""
        return self.compiling.pop(request_id, None) is not None

    def take_compiled(self) -> tuple[list, list[str]]:
        """The requests whose grammar is ready, each with a matcher of its own, and the ids of those
        whose grammar failed to compile (the front-end compiled it too: not the client's error)."""
        ready, failed = [], []
        for rid, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            try:
                compiled = future.result()
            except Exception as exc:
                logger.error("Request %s: its grammar did not compile in the engine: %s", rid, exc)
                failed.append(rid)
                continue
            request.grammar = self.matcher(compiled, sorted(request.stop_token_set))
            ready.append(request)
        return ready, failed

    def wait_for_any(self, timeout: float) -> None:
        """Until one grammar compiles, or timeout seconds."""
        futures.wait([f for _, f in self.compiling.values()], timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def advance(self, updated: list) -> list[str]:
        """Each guided request's matcher takes its new tokens. Returns the ids of the requests to
        stop: a grammar that has ended (its stop token accepted) ends its request, even one that
        ignores end-of-sequence tokens, and so does a token outside the grammar."""
        ended = []
        for request in updated:
            for token in request.new_token_ids if request.grammar is not None else ():
                if request.grammar.is_terminated():
                    break
                if not request.grammar.accept_token(token):
                    logger.error(
                        "Request %s: token %d is outside its grammar; the request is stopped", request.request_id, token
                    )
                    ended.append(request.request_id)
                    break
                if request.grammar.is_terminated() and not request.is_finished():
                    ended.append(request.request_id)
        return ended

    # --- compiling -------------------------------------------------------------------------------
    def submit(self, guide: GuidedDecodingParams) -> Future:
        """Compile off the engine loop; the future's result is the CompiledGrammar."""
        return self._pool.submit(self._compile, guide)

    def _compile(self, guide: GuidedDecodingParams):
        if self._compiler is None and self._tokenizer_info is not None:
            self._compiler = GuideCompiler(info=self._tokenizer_info)
        if self._compiler is None:
            from splitserve.tokenizer import get_tokenizer

            mc = self.model_config
            tokenizer = self.tokenizer or get_tokenizer(mc.tokenizer, mc.trust_remote_code)
            self._compiler = GuideCompiler(tokenizer, mc.vocab_size)
            logger.info("Structured output: xgrammar ready for a vocabulary of %d tokens", mc.vocab_size)
        return self._compiler.compile(guide)

    def set_tokenizer_info(self, serialized: str) -> None:
        """A front-end's TokenizerInfo, to compile with unless a compiler exists already."""
        if self._tokenizer_info is None and self._compiler is None:
            import xgrammar as xgr

            self._tokenizer_info = xgr.TokenizerInfo.deserialize_json(serialized)

    @staticmethod
    def matcher(compiled, stop_token_ids: list[int]):
        """A request's matcher; it ends the output only with the request's own stop tokens."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def fill_bitmasks(self, requests: list, drafts: dict[str, list[int]]) -> dict[str, bytes]:
        """The next-token bitmask of each request (that has a matcher), as bytes for the step. A
        request verifying draft tokens gets one mask per verified position, concatenated: the
        matcher takes each draft in turn and is rolled back after. Past a draft the grammar refuses,
        or one that ends it, the masks repeat (verification stops at a refused draft, since the
        target cannot sample it; a draft that ends the grammar ends the request)."""
        if not requests:
            return {}
        import xgrammar as xgr

        rows = [1 + len(drafts.get(r.request_id, ())) for r in requests]
        bitmask = xgr.allocate_token_bitmask(sum(rows), self.model_config.vocab_size)
        out, row = {}, 0
        for request, count in zip(requests, rows):
            matcher, accepted = request.grammar, 0
            matcher.fill_next_token_bitmask(bitmask, row)
            for i, token in enumerate(drafts.get(request.request_id, ())):
                if accepted == i and not matcher.is_terminated() and matcher.accept_token(token):
                    accepted += 1
                if accepted == i + 1 and not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(bitmask, row + i + 1)
                else:  # refused, or the draft ended the grammar: the request stops before this row counts
                    bitmask[row + i + 1] = bitmask[row + i]
            if accepted:
                matcher.rollback(accepted)
            out[request.request_id] = bitmask[row : row + count].numpy().tobytes()
            row += count
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
