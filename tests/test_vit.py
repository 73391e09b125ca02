"""common/model/vit.py's ViT against timm's, and the node's built-backbone cache (``backbone-cache-disk``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.model.prompted import CodaPrompt, PromptedViT, backbone_cache_path, build_backbone, build_model
from promptfcl.common.model.runtime import backbone_of, model_spec
from promptfcl.common.model.vit import VisionTransformer, from_timm
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]

#: the project default's architecture (vit_tiny_patch16_224 at 32 px, 4 px patches, D=96, 4 blocks, 3 heads)
DEFAULT_ARCH = {"image-size": 32, "patch-size": 4, "embed-dim": 96, "depth": 4, "num-heads": 3}


def config(**overrides) -> ExperimentConfig:
    return tiny_config(**{**DEFAULT_ARCH, "prompt-layers": "0,1,2", **overrides})


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh PROMPTFCL_CACHE for this test (and the subprocesses it starts)."""
    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def images(n: int = 3, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def timm_reference(cfg: ExperimentConfig) -> torch.nn.Module:
    """The backbone ``cfg`` names, built by timm (no cache)."""
    backbone, _ = build_backbone(backbone_of(cfg.replace(backbone_cache_disk="off")))
    assert type(backbone).__module__.startswith("timm.")
    return backbone


def query(backbone: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return backbone.forward_head(backbone.forward_features(x), pre_logits=True)


# ---------------------------------------------------------------------------- the model
@pytest.mark.parametrize("mode", ["prefix", "prompt"])
def test_our_vit_computes_exactly_what_timms_does(mode):
    """Unprompted queries and prompted features/logits are bit-identical on both backbones."""
    cfg = config()
    theirs = timm_reference(cfg)
    ours, reason = from_timm(theirs)
    assert isinstance(ours, VisionTransformer), reason
    assert set(ours.state_dict()) == set(theirs.state_dict())

    models = []
    for backbone in (theirs, ours):
        torch.manual_seed(0)
        prompt = CodaPrompt(cfg.model.embed_dim, cfg.model.layers, 4, 4, 2)
        prompt.init_task_slice(0, torch.Generator().manual_seed(2))
        models.append(PromptedViT(backbone, prompt, 10, mode).eval())
    models[1].load_trainable_state(models[0].trainable_state())

    x = models[0].preprocess(torch.randint(0, 255, (3, 1, 28, 28), dtype=torch.uint8))
    q = [m.query(x) for m in models]
    assert torch.equal(q[0], q[1])
    with torch.no_grad():
        assert torch.equal(models[0].features(x, q[0]), models[1].features(x, q[1]))
        assert torch.equal(models[0](x), models[1](x))


@pytest.mark.parametrize("change, reason", [
    ({"reg_tokens": 4}, "register tokens"),
    ({"global_pool": "avg"}, "global_pool"),
    ({"qk_norm": True}, "q_norm"),
    ({"init_values": 1e-5}, "ls1"),  # layer scale
])
def test_from_timm_refuses_a_vit_outside_the_standard_one(change, reason):
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32, patch_size=4,
                              embed_dim=96, depth=2, num_heads=3, **change).eval()
    ours, why = from_timm(model)
    assert ours is None and reason in why


# ---------------------------------------------------------------------------- the disk cache
_FRESH_PROCESS = """
import json, sys, torch
from promptfcl.common.node import startup
from promptfcl.common.config.experiment import ExperimentConfig
from promptfcl.common.model.prompted import ModelSpec, build_model
from promptfcl.common.data.tasks import TaskLayout
from promptfcl.common.model.weights import BackboneSpec
cfg = ExperimentConfig.from_dict(json.loads(sys.argv[1]))
spec = ModelSpec.of(BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching),
                    TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, 10), cfg.run, cfg.model,
                    cfg.evaluation, cfg.method)
model, source = build_model(spec)
torch.save(model.query(torch.load(sys.argv[2])), sys.argv[3])
print(json.dumps({"timm": "timm" in sys.modules, "backbone": type(model.backbone).__module__,
                  "phases": sorted(startup.take()), "source": source}))
"""


def test_a_fresh_process_reads_the_cached_backbone_without_timm(cache, tmp_path):
    cfg = config(population="nodes")  # backbone-cache-disk = auto: on for deployed nodes
    model, source = build_model(model_spec(cfg, 10))
    path = backbone_cache_path(backbone_of(cfg))
    assert path is not None and path.is_file() and path.parent == cache / "backbones"
    x = images()
    torch.save(x, tmp_path / "x.pt")

    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, json.dumps(cfg.to_dict()),
                           str(tmp_path / "x.pt"), str(tmp_path / "q.pt")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"timm": False, "backbone": "promptfcl.common.model.vit", "phases": ["model_build", "weights"],
                      "source": source}
    assert torch.equal(torch.load(tmp_path / "q.pt"), model.query(x))
    assert torch.equal(model.query(x), query(timm_reference(cfg), x))


def _garbage(path: Path, cfg: ExperimentConfig) -> None:
    path.write_bytes(b"not a torch file" * 100)


def _edit(**arch) -> Callable[[Path, ExperimentConfig], None]:
    def write(path: Path, cfg: ExperimentConfig) -> None:
        doc = torch.load(path, weights_only=True)
        doc["arch"].update(arch)
        torch.save(doc, path)
    return write


def _other_format(path: Path, cfg: ExperimentConfig) -> None:
    torch.save({**torch.load(path, weights_only=True), "format": 99}, path)


def _other_identity(path: Path, cfg: ExperimentConfig) -> None:  # what a digest collision would look like
    torch.save({**torch.load(path, weights_only=True), "identity": "another backbone"}, path)


@pytest.mark.parametrize("damage", [_garbage, _edit(depth=2), _edit(mlp_hidden=100), _other_format, _other_identity],
                         ids=["garbage", "arch-against-config", "arch-against-state", "format", "identity"])
def test_an_unusable_cache_file_is_rebuilt_with_timm_and_rewritten(cache, caplog, damage):
    cfg = config(backbone_cache_disk="on")
    build_backbone(backbone_of(cfg))
    path = backbone_cache_path(backbone_of(cfg))
    damage(path, cfg)

    with caplog.at_level(logging.WARNING, logger="promptfcl"):
        backbone, _ = build_backbone(backbone_of(cfg))
    assert any(str(path) in r.getMessage() and "unusable" in r.getMessage() for r in caplog.records)
    x = images()
    assert torch.equal(query(backbone, x), query(timm_reference(cfg), x))
    doc = torch.load(path, weights_only=True)  # rewritten: the next process reads it again
    assert doc["format"] == 1 and doc["arch"]["depth"] == 4 and doc["arch"]["mlp_hidden"] == 384


def test_a_vit_outside_the_standard_one_stays_on_timm_and_is_not_cached(cache, caplog):
    cfg = config(backbone="vit_betwixt_patch16_reg4_gap_256", backbone_cache_disk="on")
    with caplog.at_level(logging.WARNING, logger="promptfcl"):
        first, _ = build_backbone(backbone_of(cfg))
        second, _ = build_backbone(backbone_of(cfg))
    assert type(first).__module__.startswith("timm.") and type(second).__module__.startswith("timm.")
    assert [r.getMessage() for r in caplog.records if "register tokens" in r.getMessage()]  # logged ...
    assert len([r for r in caplog.records if "not cached on disk" in r.getMessage()]) == 1  # ... once
    assert not (cache / "backbones").exists()


def test_an_unwritable_cache_dir_only_warns(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path / "file"))  # mkdir under a file fails
    with caplog.at_level(logging.WARNING, logger="promptfcl"):
        backbone, _ = build_backbone(backbone_of(config(backbone_cache_disk="on")))
    assert isinstance(backbone, VisionTransformer)
    assert any("cannot write built backbone cache" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("overrides", [{"backbone-cache-disk": "off", "population": "nodes"},
                                       {"backbone-cache-disk": "auto", "population": "virtual"}])
def test_with_the_cache_off_nothing_is_written(cache, overrides):
    cfg = config(**overrides)
    assert backbone_cache_path(backbone_of(cfg)) is None
    backbone, _ = build_backbone(backbone_of(cfg))
    assert type(backbone).__module__.startswith("timm.")
    assert not cache.exists()


def test_the_config_key_is_validated_and_result_neutral():
    with pytest.raises(ConfigError, match="backbone-cache-disk must be 'auto', 'on' or 'off'"):
        ExperimentConfig.from_dict({"backbone-cache-disk": "yes"})
    assert config(backbone_cache_disk="on").digest() == config(backbone_cache_disk="off").digest()
