"""WeightWatch (vllm_connector/weights.py): every way vLLM 0.31 updates a running worker's weights
gives them a new version, once per update, and the version names the weights where it can.

The runner here has vLLM's GPUModelRunner update methods with their call structure (reload_weights
calls the model's load_weights, or copies in kernel format, then reset_lora_state; a weight
transfer engine's chunks call load_weights and finish_weight_update calls reset_lora_state) over a
real torch module; the served test (test_vllm_weight_update.py) runs the real engine's."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, List, Optional, Tuple

import pytest
import torch

from dynamo_flexkv.integrations.vllm_connector.settings import default_model_id
from dynamo_flexkv.integrations.vllm_connector.weights import WeightWatch


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8).requires_grad_(False)  # as vLLM: inference only

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set:
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
        weights_iterator: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
        weights_path: Optional[str] = None,
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


def watched(tmp_path: Path) -> Tuple[Runner, WeightWatch, List[str]]:
    runner = Runner(weights_dir(tmp_path / "A", 0))
    watch = WeightWatch(default_model_id)
    told: List[str] = []
    watch.on_change(told.append)

    def initialize_kv_cache(self: Any) -> None:  # noqa: ARG001 - the frame whose ``self`` is the runner
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

    def broken() -> Iterable[Tuple[str, torch.Tensor]]:
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
