"""LoRA adapters on the OpenAI-compatible API, as vLLM serves them:

    a request's `model`               the base model's name, or an adapter's (else 404)
    GET  /v1/models                   the base model, then each adapter (parent: the base;
                                      root: its name, where vLLM shows its server path)
    POST /v1/load_lora_adapter        {"lora_name", "lora_path"}: every worker reads it
    POST /v1/unload_lora_adapter      {"lora_name"}: new requests get 404; running finish

Both POSTs are /v1/ routes, behind the API key like the completions, and served only with
--allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): else any key's
caller could swap another's adapter. A load reads only beneath --lora-root (registry.py).
"""

from __future__ import annotations

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ..openai.body import Body, read_body
from ..openai.render import error_body


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: a name served already is read again (always so)


class UnloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, ignored: adapters are known by name


def lora_of_model(router, model: str) -> str | None:
    """The adapter a request's `model` names: "" for the base model, None for neither."""
    info = router.model_info()
    if model in (info.served_model_name, info.model):
        return ""
    return model if model in router.loras.paths else None


def not_found(model: str) -> tuple[int, dict]:
    cut = model if len(model) <= 80 else model[:77] + "..."  # never echo a huge name
    return error_body(grpc.StatusCode.NOT_FOUND, f"The model `{cut}` does not exist.",
                      "model", "model_not_found")


def model_cards(router, info) -> list[dict]:
    """/v1/models' entries: the base model, then every adapter over it. No server path:
    an adapter's `root` is its name."""
    base = {"id": info.served_model_name, "object": "model", "created": 0,
            "owned_by": "baton", "root": info.model, "parent": None,
            "max_model_len": info.max_model_len}
    return [base] + [dict(base, id=name, root=name,
                          parent=info.served_model_name) for name in router.loras.names()]


def install(app: FastAPI, router, api_error) -> None:
    """The two routes; `api_error(e)` gives an exception the app's error shape."""

    async def body_of(request: Request, kind: type[Body]) -> Body:
        return await read_body(router.intake, request, kind)

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        try:
            body = await body_of(request, LoadBody)
            info = router.model_info()
            await router.loras.load(router.registry, body.lora_name, body.lora_path,
                                    (info.served_model_name, info.model))
        except Exception as e:  # noqa: BLE001 - ServiceError, ValueError: the error shape
            raise api_error(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        try:
            body = await body_of(request, UnloadBody)
            await router.loras.unload(router.registry, body.lora_name)
        except Exception as e:  # noqa: BLE001
            raise api_error(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")
