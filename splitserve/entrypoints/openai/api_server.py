"""The OpenAI-compatible HTTP server's module entry point, as FastDeploy and vLLM name it:

    python -m splitserve.entrypoints.openai.api_server --model M --port 8188

It is `splitserve serve` under another name (entrypoints/serve.py): one instance, a local PD
deployment with --pd, or the role a rank-table environment gives this process.
"""

from __future__ import annotations

from splitserve.entrypoints.serve import main

if __name__ == "__main__":
    main()
