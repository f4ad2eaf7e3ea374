"""splitserve: an LLM serving engine (offline batch API, OpenAI-compatible server, PD disaggregation)."""

from splitserve.lora.request import LoRARequest
from splitserve.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput, ScoringRequestOutput
from splitserve.pooling_params import PoolingParams
from splitserve.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from splitserve.version import __version__

# The LMDeploy-style API (entrypoints/lmdeploy_api.py), imported when first asked for.
_LMDEPLOY_NAMES = (
    "pipeline",
    "GenerationConfig",
    "TurbomindEngineConfig",
    "PytorchEngineConfig",
    "ChatTemplateConfig",
    "Response",
)

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "PoolingParams",
    "LoRARequest",
    "EmbeddingRequestOutput",
    "ScoringRequestOutput",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    *_LMDEPLOY_NAMES,
]


def __getattr__(name: str):
    # The engine pulls in torch and transformers: import it only when it is asked for.
    if name == "LLM":
        from splitserve.entrypoints.llm import LLM

        return LLM
    if name in _LMDEPLOY_NAMES:
        from splitserve.entrypoints import lmdeploy_api

        return getattr(lmdeploy_api, name)
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
