"""Prefix-tuning with a non-empty prefix against CODA-Prompt's own formula.

CODA-Prompt (models/vit.py, ``Attention.forward``; models/zoo.py splits the prompt into
``Ek = P[:, :L/2]`` and ``Ev = P[:, L/2:]``): per head h,

    Attn_h(x) = softmax(q_h [Ek_h ; K_h]^T / sqrt(d_h)) [Ev_h ; V_h]

with q, K, V from the block's qkv projection of LN1(x), the prompt halves reshaped into the
heads as they are (no projection, no norm, no bias), prepended to the keys and values; the
queries and the sequence length are unchanged. The reference below is written from the block's
weights with an explicit softmax, independently of ``common/model/vit.py`` (which uses
``scaled_dot_product_attention``).
"""

import math

import pytest
import torch

from promptfcl.common.model.prompted import build_model
from promptfcl.common.model.runtime import model_spec
from promptfcl.common.model.vit import block_forward
from tests.conftest import tiny_config


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def coda_prefix_block(block, x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """A pre-norm ViT block with CODA-Prompt's prefix attention, from the block's weights."""
    B, N, D = x.shape
    heads = int(block.attn.num_heads)
    d = D // heads
    h = layer_norm(x, block.norm1)
    qkv = (h @ block.attn.qkv.weight.T + block.attn.qkv.bias).reshape(B, N, 3, heads, d)
    q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))  # (B, heads, N, d)
    half = prompt.shape[1] // 2
    ek = prompt[:, :half].reshape(B, half, heads, d).permute(0, 2, 1, 3)
    ev = prompt[:, half:].reshape(B, half, heads, d).permute(0, 2, 1, 3)
    k, v = torch.cat([ek, k], dim=2), torch.cat([ev, v], dim=2)  # prefix before the sequence
    attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1)  # (B, heads, N, half + N)
    out = (attn @ v).permute(0, 2, 1, 3).reshape(B, N, D)
    x = x + out @ block.attn.proj.weight.T + block.attn.proj.bias
    h = layer_norm(x, block.norm2)
    hidden = torch.nn.functional.gelu(h @ block.mlp.fc1.weight.T + block.mlp.fc1.bias)
    return x + hidden @ block.mlp.fc2.weight.T + block.mlp.fc2.bias


@pytest.mark.parametrize("length", [2, 8])
def test_a_prefixed_block_computes_coda_prompts_attention(length):
    model, _ = build_model(model_spec(tiny_config(), 10))
    block = model.backbone.blocks[0]
    assert block.attn.num_heads > 1 and block.mlp.act.approximate == "none"  # what the reference assumes
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 48, generator=g)
    prompt = 2 * torch.randn(3, length, 48, generator=g)
    with torch.no_grad():
        ours = block_forward(block, x, prompt)
        expected = coda_prefix_block(block, x, prompt)
        assert ours.shape == x.shape  # queries unchanged: no token added
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
        # the prefix matters, and which half is keys and which values matters
        assert not torch.allclose(ours, block_forward(block, x, None), atol=1e-3)
        swapped = torch.cat([prompt[:, length // 2 :], prompt[:, : length // 2]], dim=1)
        assert not torch.allclose(ours, block_forward(block, x, swapped), atol=1e-3)


def test_prefixed_features_chain_coda_prompts_blocks():
    """The whole prefix-mode forward: each prompted block gets its own composed prompt
    (CodaPrompt's weighted sum, first half keys), the others run unprompted."""
    model, _ = build_model(model_spec(tiny_config(prompt_layers="0", prompt_length=6), 10))
    assert model.mode == "prefix"
    model.prompt.init_task_slice(0, torch.Generator().manual_seed(1))
    model.eval()
    b = model.backbone
    x = model.preprocess(torch.randint(0, 255, (2, 1, 16, 16), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(2)))
    q = model.query(x)
    with torch.no_grad():
        p0 = model.prompt(q, 0)
        assert p0.shape == (2, 6, 48) and p0.abs().sum() > 0
        seq = b.norm_pre(b._pos_embed(b.patch_embed(x)))
        seq = coda_prefix_block(b.blocks[0], seq, p0)
        seq = b.blocks[1](seq)
        expected = b.forward_head(b.norm(seq), pre_logits=True)
        torch.testing.assert_close(model.features(x, q), expected, atol=1e-5, rtol=1e-5)
