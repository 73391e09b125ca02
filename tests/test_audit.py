"""The privacy audit (server/audit.py): end to end on a run directory, and that it detects a leak."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from promptfcl.common.config.experiment import ConfigError
from promptfcl.server.audit import AuditSettings, Target, audit_run, audit_targets


@pytest.mark.e2e
def test_audit_run_end_to_end(tmp_path):
    """A tiny HGP run keeps its checkpoint; the audit inverts every class's uploaded mean and a
    Gaussian draw, writes audit.json and audit.png, every score finite."""
    from tests.helpers import simulate_in_process

    run = tmp_path / "hgp"
    simulate_in_process(run, "hgp", **{"keep-checkpoint": True})
    doc = audit_run(run, AuditSettings(steps=40), out=tmp_path / "audit")
    written = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert written["method"] == "hgp" and (tmp_path / "audit" / "audit.png").stat().st_size > 0
    assert written["settings"]["steps"] == 40 and written["classes"] == doc["classes"]
    classes = {r["class"] for r in written["classes"]}
    assert classes == set(range(10))  # digits, 2 tasks of 5 classes: every class was uploaded
    assert {r["target"] for r in written["classes"]} == {"mean", "gaussian-sample"}
    for r in written["classes"]:
        assert r["client"] >= 0 and r["n_real"] == r["count"]  # scored against exactly that client's images
        assert all(math.isfinite(r[k]) for k in ("ssim", "psnr", "chance_ssim", "chance_psnr")), r
    # a limited audit, and clear refusals
    small = audit_run(run, AuditSettings(steps=2), classes=[3], out=tmp_path / "one")
    assert {r["class"] for r in small["classes"]} == {3}
    with pytest.raises(ConfigError, match="no target"):
        audit_run(run, AuditSettings(steps=2), classes=[99], out=tmp_path / "none")
    with pytest.raises(ConfigError, match="keep-checkpoint"):
        audit_run(tmp_path / "audit", AuditSettings(steps=2))


def test_audit_detects_a_leak():
    """Features that are an invertible linear map of the pixels (an orthogonal matrix, D = pixels):
    a class's mean feature is the feature of the class's mean image, and its inversion must look
    like the class's images far more than the inversion of a random vector of the same norm."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # as common.data loads them
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))

    def features(x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) @ q

    targets = []
    for c in range(4):
        real = images[bunch.target == c][:64]
        mean = features(torch.from_numpy(real).float() / 255.0).mean(0)
        targets.append(Target(c, "mean", mean.numpy(), "cosine", real))
    records, pictures = audit_targets(features, targets, (1, 8, 8), AuditSettings(steps=300))
    assert pictures["recon"].shape == (4, 1, 8, 8)
    for r in records:
        assert r["ssim"] > r["chance_ssim"] + 0.3, r
        assert r["psnr"] > r["chance_psnr"] + 5.0, r
    again, _ = audit_targets(features, targets, (1, 8, 8), AuditSettings(steps=300))
    assert again == records  # deterministic with a seed
