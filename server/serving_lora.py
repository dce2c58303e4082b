"""LoRA adapters over HTTP, in vLLM's shapes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"} (routes that exist only with --allow-runtime-lora-updating);
the adapters served are listed by /v1/models with the base model as their `parent`."""

from __future__ import annotations

from http import HTTPStatus
from itertools import count

from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.lora import LoRAError, LoRARequest
from kiln.server.errors import INVALID_REQUEST, NOT_FOUND, APIError, bad_request
from kiln.server.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest


class OpenAIServingLoRA:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._ids = count(1 + max((a.lora_int_id for a in engine.lora_adapters()), default=0))

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        self._check_serving()
        if body.lora_name == self.model_name:
            raise bad_request(f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
        if self.engine.find_lora(body.lora_name) is not None:
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        request = LoRARequest(body.lora_name, next(self._ids), body.lora_path)
        try:
            await self.engine.add_lora(request)
        except LoRAError as error:
            raise bad_request(error.one_line(), "lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        self._check_serving()
        if self.engine.find_lora(body.lora_name) is None:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"The lora adapter '{body.lora_name}' cannot be found.",
                NOT_FOUND,
                "lora_name",
            )
        try:
            await self.engine.remove_lora(body.lora_name)
        except LoRAError as error:  # requests use it: refused, not waited for
            raise APIError(
                HTTPStatus.CONFLICT, error.one_line(), INVALID_REQUEST, "lora_name", "adapter_in_use"
            ) from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def cards(self, max_model_len: int) -> list[ModelCard]:
        """One card an adapter, its parent the base model."""
        return [
            ModelCard(id=a.lora_name, root=a.lora_path, parent=self.model_name, max_model_len=max_model_len)
            for a in self.engine.lora_adapters()
        ]

    def _check_serving(self) -> None:
        if not self.engine.serves_lora:
            raise bad_request("this server serves no LoRA adapters: start it with --enable-lora")
