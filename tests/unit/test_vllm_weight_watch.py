"""WeightWatch (vllm_connector/weights.py): every way vLLM 0.31 updates a running worker's weights
gives them a new version, once per update, and the version names the weights where it can.

The runner here has vLLM's GPUModelRunner update methods with their call structure (reload_weights
calls the model's load_weights, or copies in kernel format, then reset_lora_state; a weight
transfer engine's chunks call load_weights and finish_weight_update calls reset_lora_state) over a
real torch module, and, with LoRA, a lora_manager with LRUCacheWorkerLoRAManager's add_adapter
(which reads an adapter's files where its id is not loaded or the request says load_inplace); the
served tests (test_vllm_weight_update.py) run the real engine's."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dynamo_flexkv.integrations.vllm_connector.settings import adapter_id, default_model_id, files_digest
from dynamo_flexkv.integrations.vllm_connector.weights import WeightWatch


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8).requires_grad_(False)  # as vLLM: inference only

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        params = dict(self.named_parameters())
        done = set()
        for name, w in weights:
            params[name].data.copy_(w)  # as vLLM's default_weight_loader: no autograd version bump
            done.add(name)
        return done


class Runner:
    """GPUModelRunner's update methods, their calls as in vLLM 0.31."""

    def __init__(self, model_dir: Path) -> None:
        self.model = Model()
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=str(model_dir), revision=None),
            load_config=SimpleNamespace(load_format="auto"),
            kv_transfer_config=SimpleNamespace(engine_id="eng"),
            instance_id="123",
        )
        self.lora_resets = 0

    def get_model(self) -> Model:
        return self.model

    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        if weights_iterator is None:
            if weights_path is not None:
                self.vllm_config.model_config.model = weights_path
            weights_iterator = torch.load(Path(self.vllm_config.model_config.model) / "w.pt").items()
        if is_checkpoint_format:
            self.get_model().load_weights(weights_iterator)
        else:
            for name, w in weights_iterator:
                self.get_model().get_parameter(name).copy_(w)
        self.reset_lora_state()

    def reset_lora_state(self) -> None:
        self.lora_resets += 1


def weights_dir(path: Path, seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    torch.save({"proj.weight": torch.randn(8, 8, generator=g), "proj.bias": torch.randn(8, generator=g)}, path / "w.pt")
    return path


def watched(tmp_path: Path) -> tuple[Runner, WeightWatch, list[str]]:
    runner = Runner(weights_dir(tmp_path / "A", 0))
    watch = WeightWatch(default_model_id)
    told: list[str] = []
    watch.on_change(told.append)

    def initialize_kv_cache(self: Any) -> None:
        assert watch.attach_from_caller()

    initialize_kv_cache(runner)
    return runner, watch, told


def test_reload_from_a_directory_is_one_change_named_by_its_files(tmp_path: Path) -> None:
    runner, watch, told = watched(tmp_path)
    assert watch.version() == ""
    b = weights_dir(tmp_path / "B", 1)
    runner.reload_weights(weights_path=str(b))
    assert torch.equal(runner.model.proj.bias, torch.load(b / "w.pt")["proj.bias"])
    assert len(told) == 1, "reload_weights calls load_weights and reset_lora_state: still one change"
    assert told[0] == watch.version() and told[0].startswith("model:") and str(b) in told[0]
    # The same files give the same version (two engines, or two ranks, agree); other files another.
    runner.reload_weights(weights_path=str(b))
    assert told[1] == told[0]
    runner.reload_weights(weights_path=str(weights_dir(tmp_path / "C", 2)))
    assert told[2] != told[0]


def test_every_other_update_path_is_a_new_version(tmp_path: Path) -> None:
    runner, watch, told = watched(tmp_path)
    new = {"proj.weight": torch.zeros(8, 8), "proj.bias": torch.ones(8)}
    runner.reload_weights(weights_iterator=iter(new.items()))  # checkpoint format, from an iterator
    runner.reload_weights(weights_iterator=iter(new.items()), is_checkpoint_format=False)  # kernel format
    runner.model.load_weights(iter(new.items()))  # a worker extension's own update
    runner.model.load_weights(iter(new.items()))  # a weight transfer engine: a chunk...
    runner.reset_lora_state()  # ...and finish_weight_update
    assert told == [f"update:eng:123:{n}" for n in range(1, 6)]
    assert len(set(told)) == 5 and watch.version() == told[-1]


def test_an_update_that_fails_still_changes_the_version(tmp_path: Path) -> None:
    runner, watch, told = watched(tmp_path)

    def broken() -> Iterable[tuple[str, torch.Tensor]]:
        yield "proj.bias", torch.ones(8)  # written before the failure: the weights are half new
        raise OSError("checkpoint truncated")

    with pytest.raises(OSError):
        runner.reload_weights(weights_iterator=broken())
    assert torch.equal(runner.model.proj.bias, torch.ones(8))
    assert told == [watch.version()] and watch.changes[-1].failed


def test_a_listener_that_fails_does_not_fail_the_update(tmp_path: Path) -> None:
    runner, watch, told = watched(tmp_path)

    def refuse(version: str) -> None:
        raise RuntimeError("tier writes still running")

    watch.on_change(refuse)
    runner.reload_weights(weights_path=str(weights_dir(tmp_path / "B", 1)))
    assert len(told) == 1 and watch.version() == told[0]


def test_attached_twice_counts_each_update_once(tmp_path: Path) -> None:
    runner, watch, told = watched(tmp_path)
    watch.attach(runner)
    runner.model.load_weights(iter({"proj.bias": torch.ones(8)}.items()))
    assert len(told) == 1


def test_no_runner_among_the_callers_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    watch = WeightWatch(default_model_id)
    assert not watch.attach_from_caller()
    assert "weight updates in this worker are not noticed" in caplog.text


def test_reading_the_version_costs_no_tensor_work(tmp_path: Path) -> None:
    """What a lookup pays (a string read under a lock), against a sampled fingerprint of the
    parameters (option (a) of issue 48, 64 values of each of 8 tensors), printed for the record."""
    runner, watch, _ = watched(tmp_path)
    big = [torch.randn(4096, 4096) for _ in range(8)]
    idx = torch.randint(0, 4096 * 4096, (64,))
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        watch.version()
    per_version = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n // 10):
        torch.cat([t.view(-1)[idx] for t in big]).sum().item()
    per_fingerprint = (time.perf_counter() - t0) / (n // 10)
    print(
        f"\nversion(): {per_version * 1e6:.2f} us; sampled fingerprint (8 x 64 values): {per_fingerprint * 1e6:.1f} us"
    )
    assert per_version < per_fingerprint


# ---- LoRA adapters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoRARequest:
    """vllm.lora.request.LoRARequest's fields the watch reads (vLLM itself is not imported here)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    load_inplace: bool = False


class LoRAManager:
    """LRUCacheWorkerLoRAManager's add_adapter as in vLLM 0.31: reads the adapter's files where its
    id is not loaded or the request says load_inplace (a missing directory raises before anything
    is evicted), else only touches it; at most ``slots`` adapters, the oldest evicted."""

    def __init__(self, slots: int = 1) -> None:
        self.slots = slots
        self.loaded: dict[int, bytes] = {}  # id -> the adapter's weights as read
        self.reads = 0

    def list_adapters(self) -> set:
        return set(self.loaded)

    def add_adapter(self, lora_request: LoRARequest) -> bool:
        if lora_request.lora_int_id not in self.list_adapters() or lora_request.load_inplace:
            weights = (Path(lora_request.lora_path) / "adapter_model.safetensors").read_bytes()
            self.reads += 1
            self.loaded.pop(lora_request.lora_int_id, None)
            if len(self.loaded) + 1 > self.slots:
                del self.loaded[next(iter(self.loaded))]
            self.loaded[lora_request.lora_int_id] = weights
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        return self.loaded.pop(adapter_id, None) is not None


class LoRARunner(Runner):
    """A runner of a worker with --enable-lora: its lora_manager, and add_lora / remove_lora as
    vLLM's LoRAModelRunnerMixin (what collective_rpc runs for the engine's add_lora / remove_lora)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.lora_manager = LoRAManager()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.lora_manager.add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_manager.remove_adapter(lora_id)

    def step(self, *requests: LoRARequest) -> None:
        """A step's set_active_adapters: each request's adapter, loaded lazily where it is not."""
        for r in requests:
            self.lora_manager.add_adapter(r)


def adapter_dir(path: Path, seed: int, rank: int = 8) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    (path / "adapter_model.safetensors").write_bytes(torch.randn(64, generator=g).numpy().tobytes())
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    return path


def overwrite(src: Path, dst: Path) -> None:
    """``src``'s files written over ``dst``'s, as a user updating an adapter in place does."""
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)


def watched_lora(tmp_path: Path) -> tuple[LoRARunner, WeightWatch, list[str]]:
    runner = LoRARunner(weights_dir(tmp_path / "A", 0))
    watch = WeightWatch(default_model_id)
    told: list[str] = []
    watch.on_change(told.append)
    watch.attach(runner)
    return runner, watch, told


def test_an_adapters_id_names_its_files_and_a_hub_id_its_name_and_path(tmp_path: Path) -> None:
    x = adapter_dir(tmp_path / "x", 1)
    first = adapter_id("ad", str(x))
    assert first.startswith(f"ad|{x}|files=") and adapter_id("ad", str(x)) == first  # the same files: the same id
    assert adapter_id("other", str(x)) != first
    overwrite(adapter_dir(tmp_path / "y", 2), x)  # other weights at the same path
    second = adapter_id("ad", str(x))
    assert second != first
    (x / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 16}))
    assert adapter_id("ad", str(x)) != second  # rank and alpha change the adapter's effect
    (x / "README.md").write_text("notes")
    assert adapter_id("ad", str(x)) == adapter_id("ad", str(x))  # other files do not count
    assert adapter_id("ad", "org/some-adapter") == "ad|org/some-adapter"  # a hub id: nothing to read here


def test_the_model_id_still_names_a_model_directory_by_its_weight_files(tmp_path: Path) -> None:
    """default_model_id and adapter_id take one digest (settings.files_digest)."""
    model = weights_dir(tmp_path / "A", 0)
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None), load_config=None)
    assert default_model_id(config) == f"{model}|weights={files_digest(str(model))}"
    (model / "config.json").write_text("{}")
    assert default_model_id(config) == f"{model}|weights={files_digest(str(model))}"  # not a weight file
    before = default_model_id(config)
    weights_dir(model, 1)
    assert default_model_id(config) != before


def test_a_hot_swap_to_other_files_under_the_same_name_is_a_weight_change(tmp_path: Path) -> None:
    runner, watch, told = watched_lora(tmp_path)
    served = adapter_dir(tmp_path / "ad", 1)  # adapter X
    ad = LoRARequest("ad", 7, str(served))
    runner.add_lora(ad)  # the first load of a name: nothing of it ran here before
    runner.step(ad, ad)
    assert told == [] and runner.lora_manager.reads == 1

    # Y written over X's files: requests still run with X loaded (and their KV is stored under Y's key)
    overwrite(adapter_dir(tmp_path / "y", 2), served)
    runner.step(ad)
    assert told == [] and runner.lora_manager.reads == 1
    # Dynamo's load_lora hot-swap: remove_lora, then add_lora under the same name, id and path
    runner.remove_lora(ad.lora_int_id)
    runner.add_lora(ad)
    assert len(told) == 1 and told[0] == watch.version() and watch.changes[-1].method == "add_adapter"

    # The same files again (evicted by another adapter, loaded lazily): not a change
    other = LoRARequest("other", 8, str(adapter_dir(tmp_path / "z", 3)))
    runner.step(other)
    runner.step(ad)
    assert len(told) == 1 and runner.lora_manager.reads == 4
    # load_inplace reads the files even while loaded: from another directory, a change
    runner.add_lora(LoRARequest("ad", 7, str(adapter_dir(tmp_path / "x2", 1)), load_inplace=True))
    assert len(told) == 2 and len(set(told)) == 2


def test_a_hot_swap_that_fails_to_read_the_new_adapter_is_no_change(tmp_path: Path) -> None:
    runner, watch, told = watched_lora(tmp_path)
    ad = LoRARequest("ad", 7, str(adapter_dir(tmp_path / "ad", 1)))
    runner.add_lora(ad)
    with pytest.raises(FileNotFoundError):
        runner.add_lora(LoRARequest("ad", 7, str(tmp_path / "missing"), load_inplace=True))
    assert told == [] and runner.lora_manager.loaded.keys() == {7}  # X still loaded, its KV still good


def test_a_worker_without_lora_has_no_adapter_to_watch(tmp_path: Path) -> None:
    runner, watch, told = watched(tmp_path)
    assert not hasattr(runner, "lora_manager") and watch.attached


def test_an_adapters_id_costs_microseconds_per_request(tmp_path: Path) -> None:
    """What the scheduler pays per key of a LoRA request (it makes a few per request), printed for
    the record, against the same loop's base: a request's block hashes (the lookup's own work)."""
    from dynamo_flexkv.core.hashing import block_hashes

    x = str(adapter_dir(tmp_path / "x", 1))
    tokens = list(range(1500))
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        adapter_id("ad", x)
    per_id = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        block_hashes(tokens, 64, lora_name="ad")
    per_hashes = (time.perf_counter() - t0) / n
    print(f"\nadapter_id (2 files): {per_id * 1e6:.1f} us; block_hashes of 1,500 tokens: {per_hashes * 1e6:.1f} us")
    assert per_id < 0.005  # far below a step; a loaded machine's stat calls included
