"""A LoRA hot-swap and weight updates against the tiers (from the adversarial review of issue 48):
the adapter key (settings.adapter_id), the worker's WeightWatch over the LoRA manager's
add_adapter, and saves of KV computed before a change (SaveSpec.first_step).

The runner and LoRA manager are test_vllm_weight_watch's (LRUCacheWorkerLoRAManager.add_adapter's
logic over real files); the connector's halves are the real SchedulerSide and WorkerSide over a
real embedded host tier, talking over their real lookup socket."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch
from test_vllm_weight_watch import LoRAManager, LoRARequest, LoRARunner, adapter_dir, overwrite, weights_dir

from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide
from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings, adapter_id
from dynamo_flexkv.integrations.vllm_connector.weights import WeightWatch
from dynamo_flexkv.integrations.vllm_connector.worker import WorkerSide

BS = 16
BLOCKS = 8


def request(rid: str, lora: LoRARequest | None, tokens: list[int]) -> Any:
    """The vllm.v1.request.Request fields the scheduler half reads."""
    return NS(
        request_id=rid,
        num_tokens=len(tokens),
        all_token_ids=list(tokens),
        lora_request=lora,
        cache_salt=None,
        prompt_embeds=None,
        mm_features=None,
        kv_transfer_params=None,
        block_hashes=[],
        num_computed_tokens=len(tokens),
        num_prompt_tokens=len(tokens),
    )


@pytest.fixture
def connector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LoRARunner, WorkerSide, SchedulerSide]]:
    """A LoRA worker's runner, the connector's worker half registered from the runner's frame (as
    vLLM's initialize_kv_cache calls register_kv_caches) and its scheduler half."""
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.01")
    settings = ConnectorSettings(
        block_size=BS, num_blocks=BLOCKS, engine_id="e", run_dir=str(tmp_path), lookup_wait_ms=5000, model_id="m"
    )
    runner = LoRARunner(weights_dir(tmp_path / "model", 0))
    worker = WorkerSide(settings, 0, 1)
    caches = {"model.layers.0.self_attn.attn": torch.zeros(BLOCKS, 2, BS, 64)}

    def initialize_kv_cache(self: Any) -> None:
        worker.register(caches)

    initialize_kv_cache(runner)
    assert worker.weights.attached
    side = SchedulerSide(settings)
    try:
        yield runner, worker, side
    finally:
        side.close()
        worker.shutdown()


def hit(side: SchedulerSide, rid: str, lora: LoRARequest | None, tokens: list[int]) -> int:
    external, _ = side.matched_tokens(request(rid, lora, tokens), 0)
    assert external is not None
    return external


def test_a_save_of_the_old_adapter_that_reaches_the_worker_after_the_hot_swap_is_not_served(connector, tmp_path):
    """Dynamo's load_lora runs between engine steps (utility calls: remove_lora, add_lora) while
    requests run. A request with adapter X that finished in the step before the hot-swap has its
    SaveSpec in the scheduler; the worker receives it with the next step's metadata, after
    add_adapter told the tiers of the new version. Its blocks hold KV computed with X, keyed by Y's
    files (the files were overwritten before the request finished, as for any same-path hot-swap):
    stored under the new version, the next request with adapter Y loads X's KV."""
    runner, worker, side = connector
    served = adapter_dir(tmp_path / "ad", 1)  # adapter X
    ad = LoRARequest("ad", 7, str(served))
    runner.add_lora(ad)
    prompt = list(range(2 * BS + 1))

    overwrite(adapter_dir(tmp_path / "y", 2), served)  # Y written over X; X still loaded and running
    # step N: a request with X finishes (its 2 blocks computed with X, key = Y's files)
    assert side.request_finished(request("old", ad, prompt), [0, 1])[0] is True
    # between step N and N+1: Dynamo's hot-swap (remove_lora, add_lora under the same name and id)
    runner.remove_lora(ad.lora_int_id)
    runner.add_lora(ad)
    assert [c.method for c in worker.weights.changes] == ["add_adapter"]
    # step N+1: the metadata with the save reaches the worker
    worker.start_load(side.build_meta())
    assert worker.drain(10)
    # A new request with adapter Y and the same prompt:
    assert hit(side, "new", ad, prompt) == 0, "X's KV stored after the hot-swap is served for adapter Y"


def test_a_base_weight_update_between_a_save_and_its_step_serves_no_old_kv(connector, tmp_path):
    """The same order with a weight update (Dynamo's update_weights_from_disk, a collective_rpc
    between steps; pause_generation's default mode aborts the running requests first, and the
    aborted requests' saves reach the worker with the first step after the update)."""
    runner, worker, side = connector
    prompt = list(range(2 * BS + 1))
    assert side.request_finished(request("old", None, prompt), [0, 1])[0] is True  # aborted by the pause
    runner.reload_weights(weights_path=str(weights_dir(tmp_path / "B", 1)))  # update_weights_from_disk
    assert [c.method for c in worker.weights.changes] == ["reload_weights"]
    worker.start_load(side.build_meta())  # the first step after resume_generation
    assert worker.drain(10)
    assert hit(side, "new", None, prompt) == 0, "KV of the old weights stored after the update is served"


def test_a_request_that_ran_across_the_hot_swap_stores_no_old_adapter_kv(connector, tmp_path):
    """Dynamo's hot-swap does not pause generation: a request with adapter X whose prompt was
    computed before remove_lora / add_lora decodes on after it (vLLM loads the adapter id again
    for its next step) and finishes later. Its prompt blocks hold X's KV; the key and the version
    at its finish are Y's."""
    runner, worker, side = connector
    served = adapter_dir(tmp_path / "ad", 1)
    ad = LoRARequest("ad", 7, str(served))
    runner.add_lora(ad)
    prompt = list(range(2 * BS + 1))
    runner.step(ad)  # the request's prefill: its 2 prompt blocks computed with X

    overwrite(adapter_dir(tmp_path / "y", 2), served)
    runner.remove_lora(ad.lora_int_id)
    runner.add_lora(ad)  # the hot-swap, while the request decodes
    runner.step(ad)  # its decode steps run with Y
    assert side.request_finished(request("across", ad, prompt), [0, 1])[0] is True
    worker.start_load(side.build_meta())
    assert worker.drain(10)
    assert hit(side, "new", ad, prompt) == 0, "the prompt's X-computed blocks are served for adapter Y"


def test_control_the_same_save_before_the_hot_swap_is_dropped_by_it(connector, tmp_path):
    """Control for the two tests above: the same save reaching the worker before the hot-swap is
    dropped by it, and without a hot-swap it is a hit (the fixture stores and looks up for real)."""
    runner, worker, side = connector
    served = adapter_dir(tmp_path / "ad", 1)
    ad = LoRARequest("ad", 7, str(served))
    runner.add_lora(ad)
    prompt = list(range(2 * BS + 1))
    side.request_finished(request("a", ad, prompt), [0, 1])
    worker.start_load(side.build_meta())
    assert worker.drain(10)
    assert hit(side, "b", ad, prompt) == 2 * BS
    overwrite(adapter_dir(tmp_path / "y", 2), served)
    side.request_finished(request("c", ad, prompt), [0, 1])  # stored under Y's key, X's KV
    worker.start_load(side.build_meta())
    assert worker.drain(10)
    runner.remove_lora(ad.lora_int_id)
    runner.add_lora(ad)
    assert hit(side, "d", ad, prompt) == 0


# ---- the adapter's key: what it reads ---------------------------------------------------------------


def trainer_output(path: Path, checkpoints: int) -> Path:
    """A PEFT trainer's output_dir served as the adapter: the final adapter at the top (what vLLM
    reads: adapter_model.* and adapter_config.json there, nothing below), checkpoint-N/ below
    with the trainer's own .pt / .pth / .bin files."""
    adapter_dir(path, 1)
    for k in range(checkpoints):
        c = path / f"checkpoint-{(k + 1) * 100}"
        c.mkdir()
        for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
            (c / name).write_bytes(b"w" * 64)
        for name in ("adapter_config.json", "trainer_state.json", "README.md", "tokenizer.json", "vocab.json"):
            (c / name).write_text("{}")
    return path


def test_files_vllm_never_reads_do_not_change_the_adapters_key(tmp_path):
    """vLLM 0.31 reads an adapter's adapter_model.{safetensors,bin,pt} and adapter_config.json at
    the top of its directory (LoRAModel.from_local_checkpoint, PEFTHelper.from_local_dir).
    files_digest walks every subdirectory and takes every .pt/.pth/.bin/.safetensors: a
    trainer's new checkpoint below the served adapter changes the key (every block misses) and
    makes the next reload a 'weight change' that drops every tier, the base model's included."""
    served = trainer_output(tmp_path / "out", 3)
    before = adapter_id("ad", str(served))
    c = served / "checkpoint-400"  # training goes on: a new checkpoint below, the served adapter untouched
    c.mkdir()
    (c / "optimizer.pt").write_bytes(b"w" * 64)
    (c / "adapter_model.safetensors").write_bytes(b"w" * 64)
    assert adapter_id("ad", str(served)) == before


def test_a_trainer_checkpoint_below_the_adapter_is_no_weight_change(tmp_path):
    runner = LoRARunner(weights_dir(tmp_path / "model", 0))
    watch = WeightWatch()
    watch.attach(runner)
    served = trainer_output(tmp_path / "out", 3)
    ad = LoRARequest("ad", 7, str(served))
    runner.step(ad)
    runner.step(LoRARequest("other", 8, str(adapter_dir(tmp_path / "o", 3))))  # LRU: ad evicted
    (served / "checkpoint-300" / "optimizer.pt").write_bytes(b"v" * 64)  # the trainer saves again
    runner.step(ad)  # ad loaded again: the same files vLLM reads
    assert runner.lora_manager.reads == 3
    assert watch.changes == [], "every tier dropped for files vLLM never read"


def test_the_adapters_key_costs_well_under_a_millisecond_for_a_trainers_output_dir(tmp_path):
    """The scheduler makes the key at least twice per LoRA request (lookup, store) and again at
    each step a request waits for its lookup; on the scheduler's thread."""
    served = str(trainer_output(tmp_path / "out", 40))
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        adapter_id("ad", served)
    per_call = (time.perf_counter() - t0) / n
    print(f"\nadapter_id of a trainer output dir with 40 checkpoints: {per_call * 1e6:.0f} us")
    assert per_call < 0.001


# ---- the watch ----------------------------------------------------------------------------------


class ActivationFails(LoRARunner):
    """LRUCacheWorkerLoRAManager.add_adapter registers the read adapter
    (_adapter_manager.add_adapter) and then activates it (activate_adapter: copies it into a
    slot on the device); an activation that raises (device memory) leaves the new adapter
    registered, so the next add_adapter of its id only touches it and never reads files again."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        manager = self.lora_manager
        read = manager.add_adapter
        self.fail_next = False

        def add_adapter(lora_request: LoRARequest) -> bool:
            out = read(lora_request)  # read and registered
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("CUDA out of memory (activate_adapter)")
            return out

        manager.add_adapter = add_adapter  # type: ignore[method-assign]


def test_a_hot_swap_whose_activation_fails_after_the_new_adapter_is_registered_is_still_a_change(tmp_path):
    runner = ActivationFails(weights_dir(tmp_path / "model", 0))
    watch = WeightWatch()
    watch.attach(runner)
    served = adapter_dir(tmp_path / "ad", 1)
    ad = LoRARequest("ad", 7, str(served))
    runner.add_lora(ad)
    overwrite(adapter_dir(tmp_path / "y", 2), served)  # X's KV stored under Y's key from here on
    runner.remove_lora(7)
    runner.fail_next = True
    with pytest.raises(RuntimeError):
        runner.add_lora(ad)  # Y read and registered, its activation failed
    runner.step(ad)  # the next request's step activates Y (no read: its id is registered)
    assert runner.lora_manager.loaded[7] == (served / "adapter_model.safetensors").read_bytes()  # Y runs
    assert [c.method for c in watch.changes] == ["add_adapter"], "Y runs; X's KV under Y's key still served"


def test_a_hub_id_reloaded_at_a_new_revision_is_a_weight_change(tmp_path):
    """vLLM resolves a lora_path that is not a local directory as a hub repo (get_adapter_absolute_path:
    snapshot_download of its default revision) at every load: an adapter evicted from the LRU and
    loaded again after the repo got a new commit runs the new revision under the same name, path
    and key ("ad|org/ad")."""
    snapshot = {"org/ad": adapter_dir(tmp_path / "snapshots" / "rev1", 1)}

    class HubManager(LoRAManager):
        def add_adapter(self, lora_request: LoRARequest) -> bool:  # _load_adapter reads where the id resolves now
            local = snapshot.get(lora_request.lora_path, Path(lora_request.lora_path))
            return super().add_adapter(replace(lora_request, lora_path=str(local)))

    runner = LoRARunner(weights_dir(tmp_path / "model", 0))
    runner.lora_manager = HubManager()
    watch = WeightWatch()
    watch.attach(runner)
    ad = LoRARequest("ad", 7, "org/ad")
    runner.step(ad)
    runner.step(LoRARequest("other", 8, str(adapter_dir(tmp_path / "o", 3))))  # LRU: ad evicted
    snapshot["org/ad"] = adapter_dir(tmp_path / "snapshots" / "rev2", 2)  # a new commit on the hub
    runner.step(ad)
    assert runner.lora_manager.loaded[7] != (tmp_path / "snapshots" / "rev1" / "adapter_model.safetensors").read_bytes()
    assert watch.changes != [], "rev2 runs under rev1's key: rev1's KV is served"
