"""--lora-root (services/lora/paths.py): a LoRA adapter path a caller sends is read
only beneath the root, symlinks resolved (the directory's and each file's), and whatever
the server cannot read for the caller (absent, a file, no adapter, outside the root by
`..`, by an absolute path or by a link) gets one message and one status, whether the
router or a worker refuses it, so a caller learns nothing of the file system. The
operator's --lora-modules may lie anywhere; /v1/models shows no server path."""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import pytest
import torch

from baton.router.clients import WorkerError
from baton.router.config import RouterConfig
from baton.router.lora.registry import RouterLoras
from baton.services.engine.model_config import ModelConfig
from baton.services.lora.adapter import LoRARequest
from baton.services.lora.paths import UNREADABLE, Unreadable
from baton.services.lora.registry import EngineLoras
from baton.services.lora.slots import LoraSlots
from tests.unit.test_router_loras import FakeClient, _registry

MODEL = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                    max_position_embeddings=64, tie_word_embeddings=False, eos_token_ids=(0,))
KEY = "base_model.model.model.layers.0.self_attn.q_proj"


def adapter(folder):
    """A rank-4 q_proj adapter of MODEL, written by hand."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    save_file({f"{KEY}.lora_A.weight": torch.randn(4, 16),
               f"{KEY}.lora_B.weight": torch.randn(16, 4)},
              str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture
def tree(tmp_path):
    """root/ with a good adapter and every way a caller's path may not be readable, and an
    adapter outside it."""
    root, outside = tmp_path / "root", adapter(tmp_path / "outside" / "secret")
    adapter(root / "good")
    (root / "link_in").symlink_to(root / "good")
    (root / "link_out").symlink_to(outside)
    (root / "a_file").write_text("x")
    (root / "empty").mkdir()
    (root / "no_weights").mkdir()
    (root / "no_weights" / "adapter_config.json").write_text('{"r": 4}')
    (root / "config_dir" / "adapter_config.json").mkdir(parents=True)
    stolen = root / "stolen_weights"  # its own config, another's weights through a link
    stolen.mkdir()
    (stolen / "adapter_config.json").write_text((outside / "adapter_config.json").read_text())
    (stolen / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    refused = ["nowhere", "a_file", "empty", "no_weights", "config_dir", "link_out",
               "stolen_weights", "../outside/secret", str(outside), f"{root}/../outside/secret",
               "bad\0byte"]
    return root, outside, refused


def engine_loras(root=None, modules=()) -> EngineLoras:
    slots = LoraSlots(MODEL, max_loras=2, max_rank=8, max_cpu_loras=8, dtype=torch.float32,
                      device=torch.device("cpu"))
    return EngineLoras(slots, MODEL, set, modules, None if root is None else str(root))


def test_the_engine_reads_a_sent_path_only_beneath_its_root(tree):
    root, outside, refused = tree
    own = adapter(root.parent / "operator")  # outside the root too, but the operator's
    loras = engine_loras(root, modules=(f"own={own}",))
    for path in refused:
        with pytest.raises(Unreadable) as e:
            loras.read("x", path)
        assert str(e.value) == UNREADABLE, path
    assert loras.names() == ["own"]
    for path in ("good", str(root / "good"), "link_in"):
        loras.keep(loras.read("x", path))
    assert loras.paths["x"] == os.path.realpath(root / "good")
    loras.keep(loras.read("own", str(own)))  # the operator's path, sent by the router
    loras.load("operator", str(outside))  # the offline API's, anywhere
    with pytest.raises(Unreadable):  # a worker's request that brings its path: a caller's
        loras.resolve(LoRARequest("y", lora_path=str(outside), sent=True))
    assert loras.resolve(LoRARequest("y", lora_path=str(outside))) == "y"  # offline
    with pytest.raises(ValueError, match="is not a directory"):  # with its real reason
        loras.load("operator", str(root / "nowhere"))


def test_without_a_root_a_sent_path_still_gets_the_one_refusal(tree):
    root, outside, _ = tree
    loras = engine_loras()
    for path in (str(root / "nowhere"), str(root / "a_file"), str(root / "no_weights")):
        with pytest.raises(Unreadable, match="^lora_path: "):
            loras.read("x", path)
    loras.keep(loras.read("x", str(outside)))  # where the router allowed it


def test_an_adapter_dropped_for_room_is_read_again_beneath_the_root(tree):
    root, outside, _ = tree
    loras = engine_loras(root)
    loras.keep(loras.read("x", "good"), version=3)
    assert loras.resolve(LoRARequest("x")) == "x"
    loras.slots.drop("x")  # dropped for room; meanwhile its directory became a link out
    os.rename(root / "good", root / "gone")
    (root / "good").symlink_to(outside)
    with pytest.raises(Unreadable):
        loras.resolve(LoRARequest("x"))
    (root / "good").unlink()
    os.rename(root / "gone", root / "good")
    assert loras.resolve(LoRARequest("x")) == "x" and loras.versions["x"] == 3


def test_the_router_refuses_outside_paths_before_any_worker_as_a_worker_would(tree):
    root, _, _ = tree
    worker = FakeClient()
    loras = RouterLoras(enabled=True, runtime_updates=True, root=str(root))
    for path in ("../outside/secret", str(root.parent / "outside" / "secret"), "link_out"):
        with pytest.raises(Unreadable) as e:
            asyncio.run(loras.load(_registry(worker), "x", path))
        assert str(e.value) == UNREADABLE and worker.held == set()
    asyncio.run(loras.load(_registry(worker), "x", "link_in"))
    assert worker.paths["x"][0] == os.path.realpath(root / "good")

    class Blind(FakeClient):  # a worker that cannot read it: its refusal passes unchanged
        async def load_lora(self, name, path, version, timeout):
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, UNREADABLE)

    with pytest.raises(Unreadable) as e:
        asyncio.run(loras.load(_registry(worker, Blind()), "y", "good"))
    assert str(e.value) == UNREADABLE and worker.held == {"x"}
    with pytest.raises(ValueError, match="lora_root"):
        RouterConfig(enable_lora=True, allow_runtime_lora_updating=True)


