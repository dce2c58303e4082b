"""Live weight updates, pause and sleep over HTTP (routes that exist only with --enable-weight-updates).

    POST /update_weights_from_disk      {"model_path": PATH} (SGLang's body)
    POST /init_weight_transfer_engine   {"init_info": {master_address, master_port, rank_offset,
                                        world_size, backend}} (vLLM's; also /init_weight_transfer)
    POST /update_weights                {"update_info": {names, dtype_names, shapes}} (vLLM's), then the
                                        trainer broadcasts the tensors in that order
    POST /pause?mode=wait|abort, POST /resume, GET /is_paused
    POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping

An update answers 200 with the new weight version once the new weights serve; 400 naming the tensor
(or the file) when they cannot, the old weights serving on.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from kiln.errors import KilnError
from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.live_weights import (
    PAUSE_MODES,
    WeightSource,
    WeightUpdateError,
    WeightVersion,
)
from kiln.runtime.memory import return_freed_memory
from kiln.runtime.weight_transfer import Channel, TransferGroup
from kiln.server.errors import INVALID_REQUEST, APIError, bad_request
from kiln.server.protocol import InitWeightTransferRequest, UpdateWeightsFromDiskRequest, UpdateWeightsRequest


class ServingWeights:
    def __init__(self, engine: AsyncEngine, weights: WeightSource) -> None:
        self.engine = engine
        self.weights = weights
        self._channel: Channel | None = None
        self._transfer = asyncio.Lock()  # one join or transfer on the channel at a time

    async def update_from_disk(self, body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        path = body.model_path
        version = await self._replace(
            lambda: self.weights.from_path(path), "disk", f"disk:{path}", "model_path"
        )
        return _updated(version, f"the weights of {path} serve")

    async def init_transfer(self, body: InitWeightTransferRequest) -> dict[str, Any]:
        info = body.init_info
        try:
            group = TransferGroup(
                info.master_address,
                info.master_port,
                info.rank_offset,
                info.world_size,
                info.backend,
                info.timeout_s,
            )
        except ValueError as error:
            raise bad_request(str(error), "init_info") from None
        if group.backend == "nccl" and not _has_gpu():
            raise bad_request("backend nccl needs a GPU; this server has none: use gloo", "init_info.backend")
        async with self._transfer:
            try:
                self._channel = await asyncio.to_thread(group.join)
            except WeightUpdateError as error:
                raise bad_request(error.one_line(), "init_info") from None
        return {"success": True, "message": f"joined as rank {group.rank} of {group.world_size}"}

    async def update_from_trainer(self, body: UpdateWeightsRequest) -> dict[str, Any]:
        info = body.update_info
        if not len(info.names) == len(info.dtype_names) == len(info.shapes):
            raise bad_request(
                f"update_info has {len(info.names)} names, {len(info.dtype_names)} dtype_names and "
                f"{len(info.shapes)} shapes; give one of each a tensor",
                "update_info",
            )
        channel = self._channel
        if channel is None or channel.broken is not None:
            why = "no trainer has joined" if channel is None else channel.broken
            raise bad_request(f"{why}: POST /init_weight_transfer_engine first", "update_info")
        refused: list[str] = []

        def keep(index: int) -> bool:  # a refused tensor is still received: the trainer's broadcast ends
            try:
                self.weights.check_tensor(info.names[index], info.dtype_names[index], info.shapes[index])
            except WeightUpdateError as error:
                refused.append(error.one_line())
                return False
            return not refused

        async with self._transfer:
            try:
                tensors = await asyncio.to_thread(
                    channel.receive, info.names, info.dtype_names, info.shapes, keep
                )
            except WeightUpdateError as error:
                self.engine.count_weight_update("distributed", "failed")
                raise bad_request(error.one_line(), "update_info") from None
        count = len(tensors)
        try:
            if refused:
                self.engine.count_weight_update("distributed", "failed")
                raise bad_request(refused[0] + "; the served weights are unchanged", "update_info")
            version = await self._replace(
                lambda: self.weights.from_tensors(tensors), "distributed", "distributed", "update_info"
            )
        finally:
            tensors.clear()  # the trainer's floats: the model's size in float32, handed back now
            await asyncio.to_thread(return_freed_memory)
        return _updated(version, f"{count} tensors from the trainer serve")

    async def pause(self, mode: str) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise bad_request(
                f"mode {mode!r}: give one of {', '.join(PAUSE_MODES)} (keep is not supported: a kept request "
                "would hold tokens of two weight versions)",
                "mode",
            )
        await self.engine.pause(mode)  # type: ignore[arg-type]
        return {"success": True, "paused": True}

    async def resume(self) -> dict[str, Any]:
        if self.engine.asleep:
            raise APIError(
                HTTPStatus.CONFLICT, "the engine sleeps: POST /wake_up (it resumes too)", INVALID_REQUEST
            )
        await self.engine.resume()
        return {"success": True, "paused": False}

    async def sleep(self, level: int) -> dict[str, Any]:
        if level not in (1, 2):
            raise bad_request(f"level {level}: give 1 (drop the KV cache) or 2 (the weights too)", "level")
        try:
            await self.engine.sleep(level)
        except ValueError as error:
            raise APIError(HTTPStatus.CONFLICT, str(error), INVALID_REQUEST) from None
        return {"success": True, "sleeping": level}

    async def wake_up(self) -> dict[str, Any]:
        await self.engine.wake_up(self.weights.from_artifact)
        version = self.engine.weight_version
        return {"success": True, "sleeping": 0, "weight_version": version.number}

    async def _replace(self, make: Any, how: str, source: str, param: str) -> WeightVersion:
        try:
            return await self.engine.replace_weights(make, how, source)
        except KilnError as error:  # WeightUpdateError, or the pipeline's refusal of these weights
            raise bad_request(error.one_line(), param) from None


def _has_gpu() -> bool:
    import torch  # only here: a server without weight transfers never imports it

    return bool(torch.cuda.is_available())


def _updated(version: WeightVersion, message: str) -> dict[str, Any]:
    return {"success": True, "message": message, "weight_version": version.number}
