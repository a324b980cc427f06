"""Which weights the worker's KV was computed with: ``WeightWatch`` notices, inside vLLM's worker
process, every weight update that vLLM runs there, so the connector's tiers stop serving KV of the
old weights without anyone telling them (Dynamo 1.6.1's RL routes call ``reset_prefix_cache()``
without ``reset_connector=True``).

Where the weights of a running vLLM 0.31 worker can change (read in vllm/v1/worker/gpu_worker.py,
gpu_model_runner.py, distributed/weight_transfer/*): every path goes through one of three methods
of the worker's model runner or model, and the watch wraps those three on the instances:

* ``runner.reload_weights(...)``: ``collective_rpc("reload_weights")`` (Dynamo's
  ``/engine/update_weights_from_disk``, vLLM's own ``/reload_weights``), from a path, from the
  model's own directory or from an iterator, in checkpoint or in kernel format (the kernel format
  path copies into the parameters directly, without ``load_weights``).
* ``runner.reset_lora_state()``: vLLM calls it after every update it finishes, the last line of
  ``reload_weights`` and of ``Worker.finish_weight_update`` (the weight transfer engines, NCCL /
  IPC / m2n, including the m2n path that receives straight into the parameters' storage).
* ``model.load_weights(...)``: the weight transfer engines' chunks and RL frameworks' worker
  extensions (``--worker-extension-cls``, e.g. an ``update_weights_from_path`` of their own), which
  call the model's ``load_weights``.

A LoRA adapter's weights change where vLLM loads one: ``runner.lora_manager.add_adapter`` (the
``LRUCacheWorkerLoRAManager`` of a worker with ``--enable-lora``), which every load goes through
(``add_lora``, as Dynamo's ``load_lora`` hot-swap calls it after ``remove_lora``, and the lazy
load of a request's adapter); it reads the files only where the adapter's id is not loaded or the
request says ``load_inplace``. The tiers key an adapter by name, path and files
(``settings.adapter_id``, taken when the scheduler makes a key), so a hot-swap to other files
misses by itself; but KV stored while new files already lay at the path and the old adapter was
still loaded carries the new files' key. So a load whose ``adapter_id`` differs from the last one
loaded under that name is a weight change too (every tier drops its blocks, base model's
included: hot-swaps are rare). The first load of a name is not: nothing of it ran here before.
Warm-up's dummy adapters go through the manager's own ``_adapter_manager`` and are not seen.

A wrapped call that ends, normally or by an exception (the weights may be half written), gives
the weights a new version at once, in the worker's thread, before the next step can look up or
load anything; nested calls (``reload_weights`` calls the other two) count once. Not seen: code
that writes the parameters by other means (a pickled function sent through ``collective_rpc``
that copies into them): give such an update its own ``model_id`` or reset the tiers
(``reset_prefix_cache(reset_connector=True)``). Sleep and wake-up keep the weights (level 2 drops
them and a reload follows, which the watch sees); on the CPU platform both do nothing.

The version names the weights, so that ranks and engines agree where they can: after a reload
from a directory it is that directory's ``default_model_id`` (its weight files' names, sizes and
modification times: the same checkpoint gives the same version everywhere); after any other
update it is ``update:<engine>:<launch>:<n>``, the same on every tensor-parallel rank (collective
calls run on all of them, in the same order) and never reused by another engine or launch. Before
any update it is "" (the weights the worker started with, which ``model_id`` names)."""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from dynamo_flexkv.integrations.vllm_connector.settings import adapter_files_digest, adapter_id

log = logging.getLogger(__name__)

# The runner's and model's methods through which vLLM 0.31 changes a running worker's weights.
RUNNER_METHODS = ("reload_weights", "reset_lora_state")
MODEL_METHODS = ("load_weights",)
ADAPTER_METHODS = ("add_adapter", "list_adapters")  # of the runner's lora_manager, with --enable-lora
MAX_CALLER_FRAMES = 12  # register_kv_caches is called a few frames below the runner's initialize_kv_cache

OnChange = Callable[[str], object]  # its result is ignored


@dataclass(frozen=True)
class WeightChange:
    """One update the watch saw: which call, and the version it gave the weights."""

    method: str
    version: str
    failed: bool  # the call raised: the weights may be half written, still a new version


class WeightWatch:
    """A version of the worker's weights that changes with every update vLLM runs (module doc).

    ``on_change(version)`` is called in the thread that ran the update, after it, once per
    outermost update; the watch is thread-safe to read (``version()``) from the lookup thread."""

    def __init__(self, model_id_of: Callable[[Any], str] | None = None) -> None:
        self.nonce = ""  # engine and launch (nonce_of): keeps the "update:..." versions of two engines apart
        self._model_id_of = model_id_of  # the runner's vllm_config -> the id of the weights now loaded
        self._version = ""
        self._updates = 0
        self._depth = 0
        self._listeners: list[OnChange] = []
        self._adapters: dict[str, str] = {}  # LoRA name -> adapter_id of the adapter last loaded under it
        self._lock = threading.Lock()
        self.attached = False
        self.changes: list[WeightChange] = []

    def version(self) -> str:
        with self._lock:
            return self._version

    def on_change(self, listener: OnChange) -> None:
        self._listeners.append(listener)

    # ---- attaching ---------------------------------------------------------------------------------
    def attach(self, runner: Any) -> None:
        """Wraps the runner's and its model's update methods (module doc) on these instances."""
        self.nonce = nonce_of(getattr(runner, "vllm_config", None))
        for name in RUNNER_METHODS:
            self._wrap(runner, name, runner)
        self._wrap(runner.get_model(), "load_weights", runner)
        manager = getattr(runner, "lora_manager", None)  # set only with --enable-lora
        if manager is not None:
            if all(callable(getattr(manager, m, None)) for m in ADAPTER_METHODS):
                self._wrap_adapters(manager, runner)
            else:
                log.warning(
                    "FlexKVConnector: this vLLM's LoRA manager (%s) has no %s: an adapter hot-swapped "
                    "under the same name from the same path is not noticed; after one, reset the tiers "
                    "(reset_prefix_cache(reset_connector=True))",
                    type(manager).__name__,
                    " / ".join(ADAPTER_METHODS),
                )
        self.attached = True

    def attach_from_caller(self) -> bool:
        """Finds the model runner among the callers of this frame (vLLM calls register_kv_caches from
        the runner's initialize_kv_cache) and attaches to it. False, with a warning, where none is
        found: then no update is noticed."""
        frame: FrameType | None = sys._getframe(1)
        for _ in range(MAX_CALLER_FRAMES):
            if frame is None:
                break
            runner = frame.f_locals.get("self")
            if runner is not None and all(callable(getattr(runner, m, None)) for m in (*RUNNER_METHODS, "get_model")):
                self.attach(runner)
                return True
            frame = frame.f_back
        log.warning(
            "FlexKVConnector: no vLLM model runner among register_kv_caches' callers: weight updates in this "
            "worker are not noticed; after one, reset the tiers (reset_prefix_cache(reset_connector=True))"
        )
        return False

    def _wrap(self, owner: Any, name: str, runner: Any) -> None:
        inner = getattr(owner, name)
        if getattr(inner, "__flexkv_weight_watch__", None) is self:
            return  # attached twice (MultiConnector, a second registration): count each update once

        @functools.wraps(inner)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._depth += 1
            failed = True
            try:
                out = inner(*args, **kwargs)
                failed = False
                return out
            finally:
                with self._lock:
                    self._depth -= 1
                    outermost = self._depth == 0
                if outermost:
                    self._changed(name, runner, failed, args, kwargs)

        watched.__flexkv_weight_watch__ = self  # type: ignore[attr-defined]
        setattr(owner, name, watched)

    def _wrap_adapters(self, manager: Any, runner: Any) -> None:
        inner = manager.add_adapter
        if getattr(inner, "__flexkv_weight_watch__", None) is self:
            return

        @functools.wraps(inner)
        def watched(lora_request: Any, *args: Any, **kwargs: Any) -> Any:
            # vLLM's own condition for reading the files (LRUCacheWorkerLoRAManager.add_adapter)
            absent = lora_request.lora_int_id not in manager.list_adapters()
            loads = absent or lora_request.load_inplace
            try:
                out = inner(lora_request, *args, **kwargs)
            except BaseException:
                # vLLM reads before it evicts: a read that raised left the old adapter (or none); a
                # raise after it (activating it) left the new one registered, to run next step.
                # (An in-place reload that raised is taken as the read's: the old one stays.)
                if absent and lora_request.lora_int_id in manager.list_adapters():
                    self._adapter_loaded(lora_request, runner)
                raise
            if loads:
                self._adapter_loaded(lora_request, runner)
            return out

        watched.__flexkv_weight_watch__ = self  # type: ignore[attr-defined]
        manager.add_adapter = watched

    def _adapter_loaded(self, lora_request: Any, runner: Any) -> None:
        name = lora_request.lora_name
        loaded = adapter_id(name, lora_request.lora_path)
        before = self._adapters.get(name)
        self._adapters[name] = loaded
        # A hub id has no files to compare (vLLM downloads the repo's latest revision at each
        # load): every load of one after the first may be other weights.
        hub = adapter_files_digest(lora_request.lora_path) is None
        if before is not None and (before != loaded or hub):
            log.info("FlexKVConnector: LoRA adapter %r replaced (%s -> %s)", name, before, loaded)
            self._changed("add_adapter", runner, False, (), {})

    # ---- a change ----------------------------------------------------------------------------------
    def _changed(self, method: str, runner: Any, failed: bool, args: tuple, kwargs: dict) -> None:
        version = self._next_version(method, runner, failed, args, kwargs)
        with self._lock:
            self._version = version
            self.changes.append(WeightChange(method, version, failed))
        log.info("FlexKVConnector: weights changed (%s%s): version %r", method, ", failed" if failed else "", version)
        for listener in self._listeners:
            try:
                listener(version)
            except Exception:  # never fail the user's update; readers compare version()
                log.exception("FlexKVConnector: acting on the weight change failed; retried at the next lookup")

    def _next_version(self, method: str, runner: Any, failed: bool, args: tuple, kwargs: dict) -> str:
        with self._lock:
            self._updates += 1
            n = self._updates
        # A whole reload from a directory (reload_weights sets model_config.model to weights_path):
        # the directory's files name the weights, wherever and however often they are loaded.
        from_dir = method == "reload_weights" and not args and kwargs.get("weights_iterator") is None and not failed
        if from_dir and self._model_id_of is not None:
            try:
                return "model:" + self._model_id_of(runner.vllm_config)
            except Exception:  # no id of the directory: a version of this engine's own
                log.exception("FlexKVConnector: naming the reloaded weights failed")
        return f"update:{self.nonce}:{n}"


def nonce_of(vllm_config: Any) -> str:
    """This engine and launch: the KV transfer engine id (per engine) and vLLM's instance id (set
    once in the engine process, the same in every worker it starts)."""
    kt = getattr(vllm_config, "kv_transfer_config", None)
    return f"{getattr(kt, 'engine_id', '')}:{getattr(vllm_config, 'instance_id', '')}"
