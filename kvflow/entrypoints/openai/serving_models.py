"""The served models: the base model's name, the LoRA adapters served beside it, and their cards in GET /v1/models.

A request's `model` picks what it runs with: the served name (or no `model`) is the base model; an adapter's name
is the base model with that adapter (`resolve` gives its `LoRARequest`, which goes to the engine with the request);
any other name is a 404 naming it. Adapters come from `--lora-modules` (registered and loaded into the engine as the
server starts) and, with `--enable-runtime-lora-updating`, from POST /v1/load_lora_adapter; POST
/v1/unload_lora_adapter removes one.

Unload semantics: the name is removed at once (requests naming it afterwards get 404), while requests that already
resolved it (running, queued, or between their checks and the engine) finish with the adapter and lose nothing:
they hold its `LoRARequest`, and the engine runs an adapter for every request that carries it. Once the last of
them has ended, the server frees the adapter in the engine (`AsyncLLM.remove_lora`). Loading a name again gives it
a new `lora_int_id`, so the requests of the old one and of the new one never share weights or prefix-cache blocks.
`load_inplace` (vLLM's field) swaps an existing name to a new folder the same way: requests running on the old
weights finish on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol import ModelCard, ModelList
from kvflow.lora.request import LoRARequest

if TYPE_CHECKING:
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.entrypoints.openai.server_config import LoRAModulePath

logger = logging.getLogger(__name__)

# The served name of the built-in default model (`kvflow serve` without MODEL).
DEFAULT_MODEL_NAME = "default"


class OpenAIServingModels:
    """One engine serves one base model under one name, and the LoRA adapters registered on it.

    Invariants: `served_model_name` is the base model's name (a request's `model` may also be omitted for it);
    `root` is the checkpoint folder (or the model's own name for the built-in and hash models); `max_model_len` is
    the engine's. `lora_requests` maps each registered adapter's name to its `LoRARequest`, in registration order;
    no adapter is named like the base model; `lora_int_id`s are handed out from 1 upwards and never reused, so an
    id always means one folder. `_in_use[id]` counts the requests of this server that hold adapter `id` (only ids
    with a count > 0 are keys); an id neither registered nor in use has been (or is being) freed in the engine.
    Used from the event loop only.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        lora_modules: Iterable[LoRAModulePath] = (),
    ) -> None:
        """`lora_modules` (`--lora-modules`) are registered now, with ids 1, 2, ... in their order (the same in
        every API server process), and loaded into the engine by `load_static_loras`. ValueError: adapters given
        while the engine has no LoRA (`--enable-lora`), two adapters with one name, or one named like the base
        model."""
        self.engine = engine
        self.served_model_name = served_model_name
        model_info = engine.model_info
        self.root = str(model_info.path) if model_info.path is not None else model_info.name
        self.max_model_len = engine.engine_config.scheduler_config.max_model_len
        self.lora_enabled = engine.engine_config.lora_config is not None
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_lora_id = 1
        self._in_use: dict[int, int] = {}
        self._update_lock = asyncio.Lock()
        self._free_tasks: set[asyncio.Task[None]] = set()
        modules = list(lora_modules)
        if modules and not self.lora_enabled:
            raise ValueError(
                "--lora-modules needs --enable-lora (the engine serves no adapters without it)"
            )
        for module in modules:
            if module.name in self.lora_requests:
                raise ValueError(f"--lora-modules names the adapter {module.name!r} twice")
            if module.name == served_model_name:
                raise ValueError(
                    f"--lora-modules: the adapter name {module.name!r} is the served model's name; "
                    "choose another (--served-model-name renames the base model)"
                )
            self.lora_requests[module.name] = self._new_lora_request(
                module.name, module.path, module.base_model_name
            )

    def _new_lora_request(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        lora_request = LoRARequest(
            lora_name=name,
            lora_int_id=self._next_lora_id,
            lora_path=path,
            base_model_name=base_model_name,
        )
        self._next_lora_id += 1
        return lora_request

    # ------------------------------------------------------------------------------------------------ requests
    def resolve(self, model: str | None) -> LoRARequest | None:
        """What a request's `model` runs with: None for the base model (its served name, or no `model`), the
        adapter's `LoRARequest` for an adapter's name; 404 (param "model") for any other name."""
        if model is None or model == self.served_model_name:
            return None
        lora_request = self.lora_requests.get(model)
        if lora_request is not None:
            return lora_request
        served = [self.served_model_name, *self.lora_requests]
        raise OpenAIServingError(
            f"The model `{model}` does not exist (this server serves "
            f"{', '.join(f'`{name}`' for name in served)}).",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        )

    def check_model(self, model: str | None) -> None:
        """404 (param "model") unless `model` is the served name, an adapter's name, or missing."""
        self.resolve(model)

    def model_name(self, lora_request: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's name, or the served name for the base model."""
        return lora_request.lora_name if lora_request is not None else self.served_model_name

    @contextlib.contextmanager
    def hold(self, lora_request: LoRARequest | None) -> Iterator[None]:
        """Mark a request as running with `lora_request` while inside (nothing for the base model). An adapter
        unloaded meanwhile is freed in the engine only once no request holds it any more."""
        if lora_request is None:
            yield
            return
        lora_id = lora_request.lora_int_id
        self._in_use[lora_id] = self._in_use.get(lora_id, 0) + 1
        try:
            yield
        finally:
            self._in_use[lora_id] -= 1
            if not self._in_use[lora_id]:
                del self._in_use[lora_id]
                if not self._is_registered(lora_id):
                    self._free_later(lora_request)

    def _is_registered(self, lora_id: int) -> bool:
        return any(each.lora_int_id == lora_id for each in self.lora_requests.values())

    def _free_later(self, lora_request: LoRARequest) -> None:
        task = asyncio.get_running_loop().create_task(self._free(lora_request))
        self._free_tasks.add(task)
        task.add_done_callback(self._free_tasks.discard)

    async def _free(self, lora_request: LoRARequest) -> None:
        """Free an adapter that is no longer registered and that no request of this server holds."""
        try:
            await self.engine.remove_lora(lora_request.lora_int_id)
        except Exception:  # the engine died, or is shutting down: nothing left to free
            logger.warning(
                "could not free LoRA adapter %r (id %d) in the engine",
                lora_request.lora_name,
                lora_request.lora_int_id,
                exc_info=True,
            )
            return
        logger.info(
            "LoRA adapter %r (id %d) freed", lora_request.lora_name, lora_request.lora_int_id
        )

    # ------------------------------------------------------------------------------------------------ loading
    async def load_static_loras(self) -> None:
        """Load every `--lora-modules` adapter into the engine (as the server starts), so that a bad one stops
        the server with its error instead of failing its first request. ValueError naming the adapter."""
        for lora_request in list(self.lora_requests.values()):
            await self._add_to_engine(lora_request, f"--lora-modules {lora_request.lora_name}")

    async def _add_to_engine(self, lora_request: LoRARequest, what: str) -> None:
        """`AsyncLLM.add_lora`; ValueError("<what>: <why>") if the engine refuses the adapter."""
        try:
            loaded = await self.engine.add_lora(lora_request)
        except (ValueError, OSError) as error:
            raise ValueError(f"{what}: cannot load {lora_request.lora_path!r}: {error}") from error
        if not loaded:
            raise ValueError(
                f"{what}: the engine did not load the adapter at {lora_request.lora_path!r}"
            )

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False
    ) -> LoRARequest:
        """Register adapter `lora_name` from the PEFT folder `lora_path` once the engine has loaded it (so a bad
        folder, a rank over --max-lora-rank or a module kvflow cannot apply is refused here). 400: an empty name or
        path, the base model's name, a name already registered (unless `load_inplace`: then the name moves to the
        new adapter, and requests running on the old one finish on it), or an adapter the engine refuses (the
        message says why). Loads and unloads run one at a time."""
        self._check_lora_enabled()
        if not lora_name or not lora_path:
            raise OpenAIServingError(
                "Both 'lora_name' and 'lora_path' must be provided.",
                param="lora_name" if not lora_name else "lora_path",
            )
        if lora_name == self.served_model_name:
            raise OpenAIServingError(
                f"The lora adapter name '{lora_name}' conflicts with the served base model.",
                param="lora_name",
            )
        async with self._update_lock:
            previous = self.lora_requests.get(lora_name)
            if previous is not None and not load_inplace:
                raise OpenAIServingError(
                    f"The lora adapter '{lora_name}' has already been loaded. If you want to load the "
                    "adapter in place, set 'load_inplace' to true.",
                    param="lora_name",
                )
            lora_request = self._new_lora_request(lora_name, lora_path, None)
            try:
                await self._add_to_engine(lora_request, f"LoRA adapter '{lora_name}'")
            except ValueError as error:
                raise OpenAIServingError(str(error), param="lora_path") from error
            self.lora_requests[lora_name] = lora_request
            if previous is not None:
                self._retire(previous)
        logger.info(
            "LoRA adapter %r loaded from %s (id %d)",
            lora_name,
            lora_path,
            lora_request.lora_int_id,
        )
        return lora_request

    async def unload_lora_adapter(
        self, lora_name: str | None, lora_int_id: int | None = None
    ) -> LoRARequest:
        """Unregister the adapter named `lora_name` (or with id `lora_int_id`; both given, they must be the same
        adapter): new requests naming it get 404 at once, requests that hold it finish with it, and it is freed in
        the engine once the last of them ends (see the module docstring). 404: no such adapter; 400: neither
        field given."""
        self._check_lora_enabled()
        if not lora_name and lora_int_id is None:
            raise OpenAIServingError(
                "Either 'lora_name' or 'lora_int_id' must be provided.", param="lora_name"
            )
        async with self._update_lock:
            found = self._find(lora_name, lora_int_id)
            del self.lora_requests[found.lora_name]
            self._retire(found)
        logger.info(
            "LoRA adapter %r (id %d) unloaded%s",
            found.lora_name,
            found.lora_int_id,
            " (freed once its requests end)" if found.lora_int_id in self._in_use else "",
        )
        return found

    def _find(self, lora_name: str | None, lora_int_id: int | None) -> LoRARequest:
        if lora_name:
            found = self.lora_requests.get(lora_name)
            if found is not None and lora_int_id is not None and found.lora_int_id != lora_int_id:
                raise OpenAIServingError(
                    f"The lora adapter '{lora_name}' has id {found.lora_int_id}, not {lora_int_id}.",
                    param="lora_int_id",
                )
            what, param = f"'{lora_name}'", "lora_name"
        else:
            found = next(
                (each for each in self.lora_requests.values() if each.lora_int_id == lora_int_id),
                None,
            )
            what, param = f"with id {lora_int_id}", "lora_int_id"
        if found is None:
            raise OpenAIServingError(
                f"The lora adapter {what} cannot be found.",
                status_code=HTTPStatus.NOT_FOUND,
                param=param,
            )
        return found

    def _retire(self, lora_request: LoRARequest) -> None:
        """An adapter no longer registered: freed now if no request holds it, else by the last one (`hold`)."""
        if lora_request.lora_int_id not in self._in_use:
            self._free_later(lora_request)

    def _check_lora_enabled(self) -> None:
        if not self.lora_enabled:
            raise OpenAIServingError(
                "this server does not serve LoRA adapters: start it with --enable-lora"
            )

    # ------------------------------------------------------------------------------------------------ cards
    def model_list(self) -> ModelList:
        """The base model's card (no parent), then one card per adapter: `id` its name, `root` its folder,
        `parent` the model it was trained on if given (`base_model_name`), else the served base model."""
        cards = [
            ModelCard(id=self.served_model_name, root=self.root, max_model_len=self.max_model_len)
        ]
        cards.extend(
            ModelCard(
                id=lora_request.lora_name,
                root=lora_request.lora_path,
                parent=lora_request.base_model_name or self.served_model_name,
                max_model_len=self.max_model_len,
            )
            for lora_request in self.lora_requests.values()
        )
        return ModelList(data=cards)
