"""The bodies and answers of the server's own routes (admin, control and PD: /abort_requests, sleep
mode, /update_weights, /generate, the LoRA adapter routes, /kv_transfer/release, /pd_role), kept apart
from the code that serves them so that the OpenAPI document (api_docs.py) and the PD router describe
them without importing the engine."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from splitserve.entrypoints.openai.protocol import CompletionRequest
from splitserve.entrypoints.openai.request_model import TEXT_OR_TOKEN_IDS_SCHEMA


class AbortRequestsBody(BaseModel):
    """POST /abort_requests."""

    request_ids: list[str] = Field(min_length=1, max_length=4096)


class AbortRequestsResponse(BaseModel):
    object: str = "abort"
    request_ids: list[str]  # what was asked for: ids that match no running request are ignored


class SleepStatus(BaseModel):
    """What /sleep, /wake_up and /is_sleeping answer: whether the engine sleeps, and at which level."""

    is_sleeping: bool
    level: int = 0


class UpdateWeightsBody(BaseModel):
    """POST /update_weights (and SGLang's /update_weights_from_disk)."""

    model_path: str = Field(min_length=1)
    load_format: str = "auto"


class UpdateWeightsResponse(BaseModel):
    success: bool = True
    message: str
    model_path: str


class GenerateRequest(CompletionRequest):
    """The body of /generate: a completion request with one prompt."""

    prompt: Annotated[str | list[int], TEXT_OR_TOKEN_IDS_SCHEMA]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted, as vLLM does; the name says which adapter


class LeasedKV(BaseModel):
    remote_request_id: str


class KVReleaseRequest(BaseModel):
    """POST /kv_transfer/release: the kv_transfer_params a prefill answer gave, handed back."""

    kv_transfer_params: LeasedKV


class KVReleaseResponse(BaseModel):
    released: str


class PDRoleSwitch(BaseModel):
    """POST /pd_role: the role this instance takes from now on."""

    pd_role: Literal["prefill", "decode", "mixed"]


class PDRoleSwitched(BaseModel):
    pd_role: str
    previous_pd_role: str
    epoch: int
