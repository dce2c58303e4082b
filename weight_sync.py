"""The trainer's side of live weight updates: push a torch model's weights into a running `kiln serve
--enable-weight-updates` (docs/weight-updates.md).

    sync = kiln.WeightSync("http://127.0.0.1:8000")
    sync.join()                                   # once: the trainer hosts the group, the server joins
    version = sync.push(model.named_parameters()) # after each optimizer step: the new weight version
    sync.from_disk("/path/to/checkpoint")         # or from storage

`push` posts the tensors' names, dtypes and shapes (POST /update_weights) and broadcasts the tensors
over torch.distributed (gloo) while the server receives them; it returns once the new weights serve, or
raises WeightSyncError with the server's reason (the old weights then serve on).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from typing import Any

import httpx
import torch

from kiln.errors import KilnError
from kiln.runtime.weight_transfer import DEFAULT_TIMEOUT_S, Channel, TransferGroup

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class WeightSyncError(KilnError):
    """The server refused or failed an update (its message), or could not be reached."""


class WeightSync:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.master_address = master_address
        self.master_port = master_port or _free_port(master_address)
        self.timeout_s = timeout_s
        self._channel: Channel | None = None

    def join(self) -> None:
        """Host the transfer group (rank 0 of 2) and have the server join it."""
        body = {
            "init_info": {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": 1,
                "world_size": 2,
                "backend": "gloo",
                "timeout_s": self.timeout_s,
            }
        }
        group = TransferGroup(self.master_address, self.master_port, 0, 2, "gloo", self.timeout_s)
        with _Posting(self, "/init_weight_transfer_engine", body) as posted:
            self._channel = group.join()
        posted.result()

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send every weight (HF names); the weight version that serves them."""
        if self._channel is None:
            raise WeightSyncError("join() first: the server has not joined the transfer group")
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        info = {
            "names": [name for name, _ in tensors],
            "dtype_names": [DTYPE_NAMES.get(t.dtype, str(t.dtype)) for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
        }
        broken: RuntimeError | None = None
        with _Posting(self, "/update_weights", {"update_info": info}) as posted:
            try:
                self._channel.send(tensor for _, tensor in tensors)
            except RuntimeError as error:  # the server left the group: its answer says why
                broken = error
        version = int(posted.result()["weight_version"])
        if broken is not None:
            raise WeightSyncError(f"the broadcast failed: {broken}")
        return version

    def from_disk(self, model_path: str) -> int:
        """Have the server load the weights of an HF folder or a GGUF; the weight version serving them."""
        return int(self._post("/update_weights_from_disk", {"model_path": model_path})["weight_version"])

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = httpx.post(
                self.base_url + path, json=body, headers=self.headers, timeout=self.timeout_s + 60
            )
        except httpx.HTTPError as error:
            raise WeightSyncError(f"POST {path}: {error}") from None
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise WeightSyncError(f"POST {path}: {response.status_code}: {message}")
        result: dict[str, Any] = response.json()
        return result


class _Posting:
    """A POST in a thread while this one broadcasts (the server answers once it has received)."""

    def __init__(self, sync: WeightSync, path: str, body: dict[str, Any]) -> None:
        self._outcome: dict[str, Any] | BaseException | None = None

        def post() -> None:
            try:
                self._outcome = sync._post(path, body)
            except BaseException as error:
                self._outcome = error

        self._thread = threading.Thread(target=post, daemon=True)

    def __enter__(self) -> _Posting:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()

    def result(self) -> dict[str, Any]:
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
