"""The OpenAI-compatible HTTP server's module entry point, as FastDeploy and vLLM name it:

    python -m splitserve.entrypoints.openai.api_server --model M --port 8188

It is `splitserve serve` under another name (entrypoints/serve.py): one instance, a local PD
deployment with --pd, or the role a rank-table environment gives this process. One default differs,
as FastDeploy's document has it: a request without max_tokens generates at most 16 tokens
(--default-max-tokens; `splitserve serve` keeps vLLM's: the rest of the context for chat).
"""

from __future__ import annotations

from splitserve.entrypoints.serve import main
from splitserve.process_utils import main_and_exit

FASTDEPLOY_DEFAULT_MAX_TOKENS = 16

if __name__ == "__main__":
    main_and_exit(main, default_max_tokens=FASTDEPLOY_DEFAULT_MAX_TOKENS)
