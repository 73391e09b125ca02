"""The CODA-P prompt module and the prompted ViT: shapes, slices, freezing, orthogonality."""

import pytest
import torch

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.prompted import CodaPrompt, build_model, gram_schmidt_rows, masked_logits
from promptfcl.common.model.runtime import backbone_of, model_spec
from promptfcl.common.model.vit import block_forward as _block_forward
from tests.conftest import tiny_config


def make_prompt(tasks=4, pool=8, length=4, dim=16, layers=(0, 2)):
    p = CodaPrompt(dim, list(layers), pool, length, tasks)
    g = torch.Generator().manual_seed(0)
    for t in range(tasks):
        p.init_task_slice(t, g)
    return p


def test_prompt_shape_and_active_components():
    p = make_prompt()
    q = torch.randn(5, 16)
    for task in range(4):
        p.set_task(task)
        assert p.weights(q, 0).shape == (5, 2 * (task + 1))  # 2 components per task
        assert p(q, 2).shape == (5, 4, 16)


def test_weights_are_cosines_of_attended_query_and_keys():
    p = make_prompt()
    p.eval()
    p.set_task(3)
    q = torch.randn(3, 16)
    w = p.weights(q, 0)
    m = 1
    expected = torch.nn.functional.cosine_similarity(q * p.a0[m], p.k0[m].expand(3, -1), dim=-1)
    torch.testing.assert_close(w[:, m], expected)
    assert (w.abs() <= 1 + 1e-6).all()


def test_only_current_slice_gets_gradients():
    p = make_prompt()
    p.train()
    p.set_task(1)
    p(torch.randn(4, 16), 0).sum().backward()
    grad = p.p0.grad
    assert grad[2:4].abs().sum() > 0  # task 1's slice learns
    assert grad[0:2].abs().sum() == 0  # task 0's slice is frozen (detached)
    assert grad[4:].abs().sum() == 0  # future slices unused
    assert p.k0.grad[0:2].abs().sum() == 0 and p.a0.grad[0:2].abs().sum() == 0


def test_eval_uses_all_seen_slices_without_detaching():
    p = make_prompt()
    p.eval()
    p.set_task(2)
    assert p.weights(torch.randn(2, 16), 0).shape == (2, 6)


def test_new_slice_is_orthogonal_to_earlier_ones():
    p = CodaPrompt(32, [0], pool_size=8, length=2, num_tasks=4)
    g = torch.Generator().manual_seed(1)
    for t in range(4):
        p.init_task_slice(t, g)
    k = p.k0.detach()
    gram = k @ k.T
    torch.testing.assert_close(gram, torch.eye(8), atol=1e-5, rtol=0)
    flat = p.p0.detach().reshape(8, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(8), atol=1e-5, rtol=0)


def test_gram_schmidt_degrades_gracefully_when_rows_exceed_dims():
    out = gram_schmidt_rows(torch.randn(6, 4), torch.randn(3, 4))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.norm(dim=1), torch.ones(6))


def test_reinitialising_a_slice_leaves_others_untouched():
    p = make_prompt()
    before = p.p0.detach().clone()
    p.init_task_slice(2, torch.Generator().manual_seed(5))
    assert torch.equal(before[:4], p.p0[:4]) and torch.equal(before[6:], p.p0[6:])
    assert not torch.equal(before[4:6], p.p0[4:6])


@pytest.mark.parametrize("mode", ["prefix", "prompt"])
def test_backbone_never_gets_gradients_and_never_travels(mode):
    cfg = tiny_config(prompt_mode=mode)
    model, source = build_model(model_spec(cfg, 10))
    assert "RANDOMLY INITIALISED" in source
    x = model.preprocess(torch.randint(0, 255, (4, 1, 8, 8), dtype=torch.uint8))
    model.train()
    logits = model(x)
    assert logits.shape == (4, 10)
    logits.sum().backward()
    assert all(p.grad is None for p in model.backbone.parameters())
    assert all(not p.requires_grad for p in model.backbone.parameters())
    assert not model.backbone.training  # dropout stays off in the frozen backbone
    travelling = model.trainable_state()
    assert set(travelling) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(k.startswith(("prompt.", "head.")) for k in travelling)


def test_prefix_path_matches_timm_block_without_prompt():
    model, _ = build_model(model_spec(tiny_config(), 10))
    b = model.backbone
    x = model.preprocess(torch.randint(0, 255, (2, 1, 8, 8), dtype=torch.uint8))
    tokens = b.norm_pre(b._pos_embed(b.patch_embed(x)))
    torch.testing.assert_close(_block_forward(b.blocks[0], tokens, None), b.blocks[0](tokens))


def test_prompt_changes_the_features():
    model, _ = build_model(model_spec(tiny_config(), 10))
    model.prompt.init_task_slice(0, torch.Generator().manual_seed(0))
    model.eval()
    x = model.preprocess(torch.randint(0, 255, (2, 1, 8, 8), dtype=torch.uint8))
    q = model.query(x)
    with_prompt = model.features(x, q)
    with torch.no_grad():
        model.prompt.p0.zero_()
        model.prompt.p1.zero_()
    assert not torch.allclose(with_prompt, model.features(x, q))


def test_query_equals_plain_backbone_cls():
    model, _ = build_model(model_spec(tiny_config(), 10))
    x = model.preprocess(torch.randint(0, 255, (3, 1, 8, 8), dtype=torch.uint8))
    torch.testing.assert_close(model.query(x), model.backbone(x))  # num_classes=0: pooled CLS


def test_masked_logits_restrict_the_competition():
    logits = torch.tensor([[5.0, 1.0, 2.0, 9.0]])
    allowed = torch.tensor([False, True, True, False])
    assert masked_logits(logits, allowed).argmax(1).item() == 2


def test_bad_prompt_layers_rejected():
    with pytest.raises(ConfigError, match="do not exist"):
        build_model(model_spec(tiny_config(prompt_layers="0,7"), 10))


def test_same_seed_builds_identical_models():
    a, _ = build_model(model_spec(tiny_config(seed=3), 10))
    b, _ = build_model(model_spec(tiny_config(seed=3), 10))
    c, _ = build_model(model_spec(tiny_config(seed=4), 10))
    for (n, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.backbone.pos_embed, c.backbone.pos_embed)


# ---------------------------------------------------------------------------- timm's blocks, reproduced
def _backbones_in_use() -> list[str]:
    """Every backbone a configuration names (the paper configs and the offline default)."""
    import tomllib
    from pathlib import Path

    from promptfcl.common.config.experiment import ExperimentConfig

    names = {ExperimentConfig().model.backbone}
    for path in (Path(__file__).resolve().parents[1] / "configs").glob("*.toml"):
        names.add(tomllib.loads(path.read_text()).get("backbone", ExperimentConfig().model.backbone))
    return sorted(names)


@pytest.mark.parametrize("backbone", _backbones_in_use())
def test_the_unprompted_path_equals_timms_own_forward(backbone):
    """With no prompt, the prefix path of every block (and the whole prompted forward with the
    prompts zeroed) gives timm's own output: nothing timm's forward does is dropped."""
    from promptfcl.common.config.experiment import ExperimentConfig
    from promptfcl.common.model.prompted import build_backbone
    from promptfcl.common.model.vit import block_forward as _block_forward

    small = backbone == ExperimentConfig().model.backbone
    cfg = tiny_config(backbone=backbone, **({} if small else {"image-size": 224, "patch-size": 0, "embed-dim": 0,
                                                             "depth": 0, "num-heads": 0}))
    model, _ = build_backbone(backbone_of(cfg))
    x = torch.randn(2, 3, cfg.model.image_size, cfg.model.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        for block in model.blocks:
            torch.testing.assert_close(_block_forward(block, tokens, None), block(tokens), atol=1e-5, rtol=1e-5)
            tokens = block(tokens)


def test_a_block_the_prompted_path_cannot_reproduce_is_refused():
    from timm.models.vision_transformer import Block

    from promptfcl.common.config.experiment import ConfigError
    from promptfcl.common.model.prompted import CodaPrompt, PromptedViT, build_backbone

    class OtherBlock(Block):  # a subclass may change the forward: refused, not silently run
        pass

    cfg = tiny_config()
    backbone, _ = build_backbone(backbone_of(cfg))
    old = backbone.blocks[1]
    backbone.blocks[1] = OtherBlock(old.attn.qkv.in_features, old.attn.num_heads)
    with pytest.raises(ConfigError, match="block 1 of this backbone"):
        PromptedViT(backbone, CodaPrompt(cfg.model.embed_dim, [0, 1], 4, 4, 2), 10)
    PromptedViT(backbone, CodaPrompt(cfg.model.embed_dim, [0], 4, 4, 2), 10)  # block 1 unprompted: fine


@pytest.mark.parametrize("tokens", ["truncate", "accumulate"])
def test_prompt_tuning_truncates_or_accumulates_the_prompt_tokens(tokens):
    """prompt-tokens: "truncate" removes a block's prompt tokens after it (FPPL's code);
    "accumulate" keeps them through every later block, each prompted block adding its own
    (Powder's code), and drops them only before the final norm."""
    cfg = tiny_config(prompt_mode="prompt", prompt_layers="0,1", prompt_tokens=tokens)
    model, _ = build_model(model_spec(cfg, 10))
    assert model.tokens == tokens
    model.prompt.init_task_slice(0, torch.Generator().manual_seed(0))
    model.eval()
    b = model.backbone
    x = model.preprocess(torch.randint(0, 255, (2, 1, 8, 8), dtype=torch.uint8))
    q = model.query(x)
    with torch.no_grad():
        seq = b.norm_pre(b._pos_embed(b.patch_embed(x)))
        p0, p1 = model.prompt(q, 0), model.prompt(q, 1)
        seq = _block_forward(b.blocks[0], torch.cat([seq[:, :1], p0, seq[:, 1:]], 1))
        n = p0.shape[1]
        if tokens == "truncate":
            seq = torch.cat([seq[:, :1], seq[:, 1 + n:]], 1)
            seq = _block_forward(b.blocks[1], torch.cat([seq[:, :1], p1, seq[:, 1:]], 1))
            seq = torch.cat([seq[:, :1], seq[:, 1 + n:]], 1)
        else:  # block 1 sees both prompts; both leave before the norm
            seq = _block_forward(b.blocks[1], torch.cat([seq[:, :1], p1, seq[:, 1:]], 1))
            seq = torch.cat([seq[:, :1], seq[:, 1 + 2 * n:]], 1)
        for block in b.blocks[2:]:
            seq = block(seq)
        expected = b.forward_head(b.norm(seq), pre_logits=True)
        torch.testing.assert_close(model.features(x, q), expected)


def test_prompt_tokens_default_to_the_methods_own_choice():
    """auto: the prompt module's ``prompt_tokens`` (Powder's accumulate, CODA-P's truncate); a set
    value overrides it; accumulate needs prompt-tuning."""
    from promptfcl.strategies.powder.prompt import PowderPrompt

    cfg = tiny_config(prompt_mode="prompt")
    assert build_model(model_spec(cfg, 10))[0].tokens == "truncate"
    assert build_model(model_spec(cfg, 10), PowderPrompt)[0].tokens == "accumulate"
    assert build_model(model_spec(cfg.replace(prompt_tokens="truncate"), 10), PowderPrompt)[0].tokens == "truncate"
    with pytest.raises(ConfigError, match="prompt-tokens"):
        tiny_config(prompt_tokens="accumulate")  # prefix-tuning adds no tokens
    with pytest.raises(ConfigError, match="prompt-tokens"):
        tiny_config(prompt_mode="prompt", prompt_tokens="keep")
