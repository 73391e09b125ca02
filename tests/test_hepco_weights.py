"""HePCo's generator losses against a separate, per-latent computation (which classes the logits
span, the KL's direction, each client's weight on a latent of class y), its per-class teacher
weights from the clients' label counts, and the labels the generator draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord, RecordDict

from promptfcl.common.records import to_array_record
from promptfcl.strategies.hepco.distill import generator_losses, seen_span
from promptfcl.strategies.hepco.latents import LatentStudent, TaskTeachers, Teachers, draw_labels
from promptfcl.strategies.hepco.records import CLASS_COUNTS, class_counts
from promptfcl.strategies.hepco.strategy import HePCoStrategy
from tests.conftest import tiny_config
from tests.helpers import accepted_of

D, NUM_CLASSES, LAYERS = 8, 10, [0]


def model(seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"prompt.k0": g.normal(size=(4, D)).astype(np.float32),
            "prompt.p0": g.normal(size=(4, 2, D)).astype(np.float32),
            "head.weight": g.normal(size=(NUM_CLASSES, D)).astype(np.float32),
            "head.bias": g.normal(size=NUM_CLASSES).astype(np.float32)}


def reference_losses(z: torch.Tensor, labels: torch.Tensor, span: list[int], clients: list[dict[str, np.ndarray]],
                     student: dict[str, np.ndarray], weight) -> tuple[float, float]:
    """L_cls and L_KL written out latent by latent: client c's cross-entropy of label y over the
    classes ``span``, and KL(student || client) = sum_k s_k (log s_k - log t_k) over ``span``
    (eq. 4a: the provisional server's prediction first), each times ``weight(c, y)``, averaged
    over the latents and summed over the clients."""
    def softmax_over_span(state, x):
        logits = [float(np.dot(state["head.weight"][k], x) + state["head.bias"][k]) for k in span]
        top = max(logits)
        e = [math.exp(v - top) for v in logits]
        return [v / sum(e) for v in e]

    cls = kl = 0.0
    for c, client in enumerate(clients):
        for x, y in zip(z.numpy().astype(np.float64), labels.tolist()):
            t = softmax_over_span(client, x)
            s = softmax_over_span(student, x)
            w = weight(c, y) / len(labels)
            cls += w * -math.log(t[span.index(y)])
            kl += w * sum(sk * (math.log(sk) - math.log(tk)) for sk, tk in zip(s, t))
    return cls, kl


@pytest.mark.parametrize("over_seen", [True, False])
def test_generator_losses_equal_a_per_latent_computation(over_seen):
    clients, student_state = [model(1), model(2), model(3)], model(4)
    classes = torch.arange(5, 10)  # the current task: classes 5-9 of 10, 0-4 seen before
    span = seen_span(classes) if over_seen else classes
    g = torch.Generator().manual_seed(0)
    z, labels = torch.randn(12, D, generator=g), classes[torch.randint(5, (12,), generator=g)]
    counts = np.zeros((3, NUM_CLASSES), np.float32)
    counts[0, 5:8], counts[1, 7:10], counts[2, 9] = 2.0, 1.0, 4.0  # client 0 holds 5-7, 1 holds 7-9, 2 only 9
    teachers = Teachers.stack(clients, LAYERS, 4, torch.device("cpu"), counts)
    student = LatentStudent(student_state, LAYERS, slice(0, 4), torch.device("cpu"))
    with torch.no_grad():
        parts = generator_losses(z, labels, classes, teachers, student, span=span if over_seen else None)
    cls, kl = reference_losses(z, labels, span.tolist(), clients, student_state, lambda c, y: counts[c, y])
    assert float(parts["cls"]) == pytest.approx(cls, rel=1e-5)
    assert float(parts["kl"]) == pytest.approx(kl, rel=1e-5)
    # the direction: one unweighted teacher gives KL(student || teacher), not KL(teacher || student)
    one = Teachers.stack([clients[2]], LAYERS, 4, torch.device("cpu"))
    with torch.no_grad():
        single = float(generator_losses(z, labels, classes, one, student, use_mse=False, span=span)["kl"])
    _, forward = reference_losses(z, labels, span.tolist(), [clients[2]], student_state, lambda c, y: 1.0)
    _, backward = reference_losses(z, labels, span.tolist(), [student_state], clients[2], lambda c, y: 1.0)
    assert single == pytest.approx(forward, rel=1e-5) and abs(backward - forward) > 1e-2 * forward


def test_over_every_seen_class_a_latent_must_also_beat_the_old_classes():
    """A client head that puts a latent of class 5 first among the task's classes but below old
    class 2: no loss over the task's classes, a large one over every seen class."""
    client = model(0)
    client["head.weight"][:] = 0.0
    client["head.bias"][:] = 0.0
    client["head.bias"][5], client["head.bias"][2] = 5.0, 10.0
    teachers = Teachers.stack([client], LAYERS, 4, torch.device("cpu"))
    student = LatentStudent(model(1), LAYERS, slice(0, 4), torch.device("cpu"))
    z, y, classes = torch.zeros(4, D), torch.full((4,), 5), torch.arange(5, 10)
    task = generator_losses(z, y, classes, teachers, student, use_kl=False, use_mse=False)["cls"]
    seen = generator_losses(z, y, classes, teachers, student, use_kl=False, use_mse=False, span=seen_span(classes))["cls"]
    assert float(task) < 0.03 and float(seen) > 4.9


def counts_reply(state: dict[str, np.ndarray], labels: list[int]) -> RecordDict:
    return RecordDict({"arrays": to_array_record(state), CLASS_COUNTS: class_counts(np.array(labels)),
                       "metrics": MetricRecord({"num-examples": len(labels), "train-loss": 1.0, "train-seconds": 0.1})})


def strategy(**options) -> HePCoStrategy:
    cfg = tiny_config(strategy="hepco", **{f"hepco.{k}": v for k, v in options.items()})
    return HePCoStrategy.of(cfg, NUM_CLASSES, cfg.method_options("hepco"))


def test_class_count_weights_give_each_client_its_share_of_the_class():
    s = strategy(**{"client-weights": "class-counts"})
    replies = [counts_reply(model(0), [5] * 30 + [6] * 10), counts_reply(model(1), [6] * 30), counts_reply(model(2), [9])]
    w = s.client_weights(accepted_of(replies, tasks=1))
    assert w.shape == (3, NUM_CLASSES)
    np.testing.assert_allclose(w[:, 5], [3, 0, 0])  # class 5: client 0 alone, the whole weight C = 3
    np.testing.assert_allclose(w[:, 6], [3 * 10 / 40, 3 * 30 / 40, 0])
    np.testing.assert_allclose(w[:, 9], [0, 0, 3])  # one image: the only judge of class 9
    np.testing.assert_allclose(w[:, [7, 8]], 0)  # nobody holds 7 or 8: no teacher, never drawn
    teachers = Teachers.stack([model(i) for i in range(3)], LAYERS, 4, torch.device("cpu"), w)
    drawn = draw_labels([TaskTeachers(torch.arange(5, 10), teachers, 1)], 400, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {5, 6, 9}


def test_a_replys_counts_are_scaled_to_the_weight_the_platform_gave_it():
    """A defended or capped run gives a reply less than its claimed samples: its counts weigh as
    the platform's weight, not as the client says."""
    s = strategy(**{"client-weights": "class-counts"})
    replies = [counts_reply(model(0), [5] * 90), counts_reply(model(1), [5] * 10)]
    w = s.client_weights(accepted_of(replies, tasks=1, weights=[10.0, 10.0]))
    np.testing.assert_allclose(w[:, 5], [1.0, 1.0])


@pytest.mark.parametrize("bad, why", [
    ({"classes": np.array([5, 5]), "counts": np.array([1, 1])}, "each class once"),
    ({"classes": np.array([2]), "counts": np.array([2])}, "outside the task"),
    ({"classes": np.array([5, 6]), "counts": np.array([3, -1])}, "negative"),
    ({"classes": np.array([5]), "counts": np.array([7])}, "num-examples"),
    ({"classes": np.array([5.0]), "counts": np.array([2.0])}, "integers"),
])
def test_malformed_class_counts_are_refused(bad, why):
    s = strategy(**{"client-weights": "class-counts"})
    content = counts_reply(model(0), [5, 6])
    content[CLASS_COUNTS] = to_array_record(bad)
    accepted = accepted_of([content], tasks=1)[0]
    assert why in (s.check_records(accepted.reply, accepted.sent) or "")


def test_clients_upload_their_label_counts_only_when_the_weights_need_them(tmp_path):
    from tests.helpers import simulate_in_process

    quick = {"hepco.generator-epochs": 2, "hepco.distill-epochs": 2, "rounds-per-task": 1}
    counted = simulate_in_process(tmp_path / "a", "hepco", **{"hepco.client-weights": "class-counts"}, **quick)
    plain = simulate_in_process(tmp_path / "b", "hepco", **{"hepco.client-weights": "samples"}, **quick)
    assert all(not r["rejected"] for r in counted["rounds"])
    # the counts are a record on the wire: more client-to-server bytes than without them
    assert counted["communication"]["bytes_c2s_total"] > plain["communication"]["bytes_c2s_total"]
