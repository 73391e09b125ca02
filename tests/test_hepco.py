"""HePCo: latent generator, latent distillation, ablation switches, server state, end to end."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.runtime import get_runtime, model_spec
from promptfcl.common.records import from_array_record, to_array_record
from promptfcl.strategies.hepco.diagnostics import RealDataProbe, teacher_accuracy
from promptfcl.strategies.hepco.distill import distill, generator_losses, train_generator
from promptfcl.strategies.hepco.latents import LatentGenerator, LatentStudent, PromptGrams, Teachers
from promptfcl.strategies.hepco.options import HePCoOptions
from promptfcl.strategies.hepco.prompt import HePCoPrompt
from promptfcl.strategies.hepco.strategy import HePCoStrategy
from promptfcl.strategies.platform.run_checks import check_run
from promptfcl.strategies.registry import methods, strategy_class
from tests.conftest import PLAIN_MEAN, tiny_config
from tests.helpers import accepted_of

D, NUM_CLASSES = 48, 10  # tiny_config: embed-dim 48, digits, 2 tasks of 5 classes, pool 4, layers 0,1


@pytest.fixture(autouse=True)
def one_thread():
    """The machine is shared: one torch thread keeps these tests fast and deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- helpers
SLICES = {"pool-training": "task-slices"}  # CODA-P's task slices (the Scenario below moves slices)


def make_strategy(**options) -> HePCoStrategy:
    cfg = tiny_config(strategy="hepco", **{f"hepco.{k}": v for k, v in options.items()})
    return HePCoStrategy.of(cfg, NUM_CLASSES, cfg.method_options("hepco"))


def reply(state: dict[str, np.ndarray], n: int = 20) -> RecordDict:
    return RecordDict({"arrays": to_array_record(state),
                       "metrics": MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1})})


class Scenario:
    """Task 1 (classes 5-9) of the tiny stream, with a previous-task server model for 0-4.

    Class y has a latent mean ``mu[y]``; every teacher's head maps ``mu[y]`` to ``y``
    (clients for the current classes, the previous server for the old ones); clients'
    current prompt slices differ from each other.
    """

    def __init__(self, strategy: HePCoStrategy, seed: int = 0, clients: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        model, data = strategy.model, strategy.data
        self.mu = F.normalize(torch.randn(NUM_CLASSES, D, generator=g), dim=-1) * 4
        torch.manual_seed(seed)
        prompt = HePCoPrompt(D, model.layers, model.pool_size, model.prompt_length, data.num_tasks)
        for t in range(2):
            prompt.init_task_slice(t, g)
        base = {f"prompt.{k}": v.detach().numpy().copy() for k, v in prompt.state_dict().items()}
        head_w = torch.zeros(NUM_CLASSES, D)
        head_w[:5] = self.mu[:5]
        base |= {"head.weight": head_w.numpy().copy(), "head.bias": np.zeros(NUM_CLASSES, np.float32)}
        strategy.on_task_end(0, to_array_record(base))  # previous task's final model
        strategy.task, strategy.round = 1, 0
        per = model.pool_size // data.num_tasks
        cur = slice(per, 2 * per)
        self.clients = []
        for _ in range(clients):
            s = {k: v.copy() for k, v in base.items()}
            for name in s:
                if name.startswith("prompt."):
                    s[name][cur] += 0.5 * torch.randn(s[name][cur].shape, generator=g).numpy()
            s["head.weight"][5:] = (self.mu[5:] + 0.3 * torch.randn(5, D, generator=g)).numpy()
            self.clients.append(s)
        # A poor provisional model: perturbed current prompt slice, uninformative head.
        prov = {k: np.mean([c[k] for c in self.clients], axis=0).astype(np.float32) for k in base}
        for name in prov:
            if name.startswith("prompt."):
                prov[name][cur] += 1.0 * torch.randn(prov[name][cur].shape, generator=g).numpy()
        prov["head.weight"] = 0.1 * torch.randn(NUM_CLASSES, D, generator=g).numpy()
        self.provisional = prov
        self.replies = [reply(c) for c in self.clients]
        self.strategy = strategy

    def latents(self, classes, n_per_class: int = 40, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        y = torch.as_tensor(classes).repeat_interleave(n_per_class)
        return self.mu[y] + 0.5 * torch.randn(len(y), D, generator=g), y

    def consolidate(self, provisional: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        arrays = to_array_record(provisional or self.provisional)
        return from_array_record(self.strategy.consolidate(2, arrays, accepted_of(self.replies, tasks=1)))


def prompt_mse(state: dict[str, np.ndarray], teachers: list[dict[str, np.ndarray]], z: torch.Tensor,
               layers: list[int], stop: int) -> float:
    """Sum over teachers and layers of the MSE between ``state``'s final prompts and theirs."""
    student = LatentStudent(state, layers, slice(stop, stop), torch.device("cpu"))
    stack = Teachers.stack(teachers, layers, stop, torch.device("cpu"))
    with torch.no_grad():
        return float(sum((student.final_prompts(z, l)[None] - stack.final_prompts(z, l)).pow(2).mean(dim=(1, 2, 3)).sum()
                         for l in layers))


def head_accuracy(state: dict[str, np.ndarray], z: torch.Tensor, y: torch.Tensor, seen: int) -> float:
    logits = z @ torch.from_numpy(state["head.weight"][:seen]).T + torch.from_numpy(state["head.bias"][:seen])
    return float((logits.argmax(1) == y).float().mean() * 100)


# ---------------------------------------------------------------------------- options and registry
def test_registered_with_paper_defaults_and_own_prompt():
    from promptfcl.strategies.hepco.learner import HePCoLearner
    from promptfcl.strategies.registry import learner_class

    assert methods()["hepco"].strategy == ".strategy:HePCoStrategy" and learner_class("hepco") is HePCoLearner
    assert strategy_class("hepco").prompt_class is HePCoPrompt
    o = HePCoOptions()
    assert (o.noise_dim, o.label_embed_dim, o.hidden) == (64, 64, [256, 1024])
    assert (o.generator_epochs, o.generator_batch_size, o.generator_lr) == (100, 64, 1e-4)
    assert (o.distill_epochs, o.distill_lr, o.lambda_kl, o.lambda_mse, o.replay_ratio) == (200, 1e-4, 1.0, 0.1, 0.5)
    assert o.use_previous and o.use_kl and o.use_mse and o.distill_prompts and o.distill_head
    # eq. 6's zeta over the composite batch; BatchNorm as the authors' code samples; no real-data probe
    assert (o.old_prompt_mean, o.distill_generator_mode, o.head_loss, o.diagnostics) == (
        "composite", "eval", "ce", False)
    assert o.client_weights == "samples"  # sec. 5.2's "weighted sum" over clients


@pytest.mark.parametrize("options, message", [
    ({"lambda-kl": -1}, "lambda-kl"),
    ({"replay-ratio": "lots"}, "replay-ratio"),
    ({"ablate": "kl,nonsense"}, "nonsense"),
    ({"generator-hidden": "256,x"}, "generator-hidden"),
    ({"averaging": "median"}, "averaging"),
    ({"old-prompt-mean": "sum"}, "old-prompt-mean"),
    ({"distill-generator-mode": "frozen"}, "distill-generator-mode"),
    ({"diagnostics-per-class": 0}, "diagnostics-per-class"),
    ({"head-loss": "focal"}, "head-loss"),
    ({"client-weights": "counts"}, "client-weights"),
    ({"distill-epoch": 3}, "unknown option hepco.distill-epoch"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        make_strategy(**options)


def test_options_reach_the_strategy_from_the_run_config():
    s = make_strategy(**{"lambda-kl": 0.5, "ablate": "kl,mse", "generator-epochs": 7})
    assert s.opts.lambda_kl == 0.5 and s.opts.generator_epochs == 7
    assert not s.opts.use_kl and not s.opts.use_mse and s.opts.distill_prompts


# ---------------------------------------------------------------------------- prompt variant
def test_prompt_is_cosine_weighted_without_attention_vectors():
    torch.manual_seed(0)
    prompt = HePCoPrompt(16, [0, 2], 8, 4, 4)
    assert not any(name.startswith("a") for name in prompt.state_dict())
    prompt.init_task_slice(1, torch.Generator().manual_seed(0))
    prompt.set_task(1)
    prompt.eval()
    q = torch.randn(5, 16)
    keys = prompt.k0[:4]
    expected = torch.stack([F.cosine_similarity(q, k[None], dim=-1) for k in keys], dim=1)
    torch.testing.assert_close(prompt.weights(q, 0), expected)
    # The server's batched teacher pass gives each client's own prompt module output.
    state = {f"prompt.{k}": v.detach().numpy() for k, v in prompt.state_dict().items()}
    state |= {"head.weight": np.zeros((3, 16), np.float32), "head.bias": np.zeros(3, np.float32)}
    stack = Teachers.stack([state, state], [0, 2], 4, torch.device("cpu"))
    student = LatentStudent(state, [0, 2], slice(2, 4), torch.device("cpu"))
    for layer in (0, 2):
        torch.testing.assert_close(stack.final_prompts(q, layer)[1], prompt(q, layer))
        torch.testing.assert_close(student.final_prompts(q, layer), prompt(q, layer))


@pytest.mark.parametrize("teacher_stop", [4, 2])  # clients (same slices) / previous model (fewer)
def test_gram_prompt_mse_equals_the_direct_computation(teacher_stop):
    s = make_strategy()
    sc = Scenario(s)
    states = sc.clients if teacher_stop == 4 else [s.previous]
    teachers = Teachers.stack(states, s.model.layers, teacher_stop, torch.device("cpu"))
    student = LatentStudent(sc.provisional, s.model.layers, slice(2, 4), torch.device("cpu"))
    z_direct, y = sc.latents(range(5, 10), 6)
    z_direct.requires_grad_(True)
    z_gram = z_direct.detach().clone().requires_grad_(True)
    classes = torch.arange(5, 10)
    direct = generator_losses(z_direct, y, classes, teachers, student)["mse"]
    gram = generator_losses(z_gram, y, classes, teachers, student, grams=PromptGrams(student, teachers))["mse"]
    assert float(direct.detach()) > 0
    torch.testing.assert_close(gram, direct, rtol=1e-4, atol=1e-7)
    direct.backward()
    gram.backward()
    torch.testing.assert_close(z_gram.grad, z_direct.grad, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("teachers", ["clients-and-previous", "previous"])
def test_gram_distillation_matches_the_direct_one(teachers):
    """Same steps with the cheap Gram loss and with every teacher prompt formed explicitly."""
    s = make_strategy(**{"distill-epochs": 5, "distill-lr": 1e-2, "old-latent-teachers": teachers})
    sc = Scenario(s)
    cpu = torch.device("cpu")
    clients = Teachers.stack(sc.clients, s.model.layers, 4, cpu)
    prev = Teachers.stack([s.previous], s.model.layers, 2, cpu)
    torch.manual_seed(0)
    gen, old_gen = LatentGenerator(NUM_CLASSES, D), LatentGenerator(NUM_CLASSES, D)
    results = []
    for use_grams in (True, False):
        student = LatentStudent(sc.provisional, s.model.layers, slice(2, 4), cpu)
        report = distill(student, s.opts, (gen, torch.arange(5, 10), clients), (old_gen, torch.arange(5), prev),
                         torch.arange(10), torch.Generator().manual_seed(0), use_grams=use_grams)
        results.append((report, [p.detach().clone() for p in student.prompt_parameters()]))
    (gram_report, gram_params), (direct_report, direct_params) = results
    assert gram_report["prompt-loss"] == pytest.approx(direct_report["prompt-loss"], rel=1e-3)
    for a, b in zip(gram_params, direct_params):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------- client weights
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_sums_over_clients_are_weighted_by_their_sample_counts(weighting):
    """client-weights = samples (sec. 5.2's "weighted sum"): client c weighs C n_c / sum n in L_cls,
    L_KL, L_MSE (eqs. 2-4) and eq. 6's client term; uniform: 1 each (eq. 2 as printed)."""
    from promptfcl.strategies.hepco.distill import generator_losses

    s = make_strategy(**{"client-weights": weighting})
    sc = Scenario(s, clients=3)
    counts = [10, 30, 60]
    accepted = accepted_of([reply(c, n) for c, n in zip(sc.clients, counts)], tasks=1)
    (group,) = s.task_teachers(accepted)
    expected = np.array([3 * n / 100 for n in counts]) if weighting == "samples" else np.ones(3)
    got = np.ones(3) if group.teachers.weights is None else group.teachers.weights.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert group.share == pytest.approx(3.0)
    cpu, layers = torch.device("cpu"), s.model.layers
    student = LatentStudent(sc.provisional, layers, slice(2, 4), cpu)
    z, y = sc.latents(range(5, 10), 6)
    classes = torch.arange(5, 10)
    both = generator_losses(z, y, classes, group.teachers, student)
    alone = [generator_losses(z, y, classes, Teachers.stack([c], layers, 4, cpu), student) for c in sc.clients]
    grams = generator_losses(z, y, classes, group.teachers, student, grams=PromptGrams(student, group.teachers))
    for name in ("cls", "kl", "mse"):
        weighted = sum(float(w) * float(part[name].detach()) for w, part in zip(expected, alone))
        assert float(both[name].detach()) == pytest.approx(weighted, rel=1e-5)
    assert float(grams["mse"].detach()) == pytest.approx(float(both["mse"].detach()), rel=1e-4)
    assert not np.allclose(expected, 1.0) or weighting == "uniform"


def test_with_sample_weights_a_task_s_share_of_the_latents_is_its_clients_samples():
    """Clients on two tasks: the tasks' latents in proportion to their clients' samples (samples)
    or their replies (uniform)."""
    from promptfcl.strategies.hepco.latents import draw_labels

    sc = Scenario(make_strategy(), clients=4)
    contents = [reply(c, n) for c, n in zip(sc.clients, [90, 10, 10, 10])]
    for weighting, behind_share in (("samples", 0.75), ("uniform", 0.25)):
        s = make_strategy(**{"client-weights": weighting})
        groups = s.task_teachers(accepted_of(contents, tasks=[0, 1, 1, 1]))
        labels = draw_labels(groups, 20_000, torch.Generator().manual_seed(0))
        assert abs(float((labels < 5).double().mean()) - behind_share) < 0.02


# ---------------------------------------------------------------------------- generator
def test_generator_shapes_and_label_conditioning():
    torch.manual_seed(0)
    gen = LatentGenerator(NUM_CLASSES, D)
    assert [m.in_features for m in gen.net if isinstance(m, torch.nn.Linear)] == [128, 256, 1024]
    noise = torch.randn(6, 64)
    gen.eval()
    a = gen(noise, torch.full((6,), 2))
    b = gen(noise, torch.full((6,), 7))
    assert a.shape == (6, D)
    assert not torch.allclose(a, b)  # the label changes the latent
    # Trained against fixed heads (classification only), latents carry their label.
    s = make_strategy(ablate="kl,mse", **{"generator-lr": 1e-3})
    sc = Scenario(s)
    classes = torch.arange(5, 10)
    clients = Teachers.stack(sc.clients, s.model.layers, 4, torch.device("cpu"))
    student = LatentStudent(sc.provisional, s.model.layers, slice(2, 4), torch.device("cpu"))
    gen = LatentGenerator(NUM_CLASSES, D)
    train_generator(gen, classes, clients, student, s.opts, 150, torch.Generator().manual_seed(0))
    y = classes.repeat(40)
    with torch.no_grad():
        z = gen.sample(y, torch.Generator().manual_seed(1))
        pred = clients.logits(z, classes).argmax(-1) + 5  # (clients, B)
    assert (pred == y).float().mean() > 0.9


def _one_step(opts: HePCoOptions, student: LatentStudent, clients: Teachers, seed: int = 0):
    """Losses on one batch before and after one generator step on exactly that batch."""
    torch.manual_seed(seed)
    gen = LatentGenerator(NUM_CLASSES, D)
    classes = torch.arange(5, 10)
    rng_state = torch.Generator().manual_seed(3).get_state()

    def losses() -> dict[str, float]:
        rng = torch.Generator()
        rng.set_state(rng_state)
        labels = classes[torch.randint(len(classes), (opts.generator_batch_size,), generator=rng)]
        with torch.no_grad():
            parts = generator_losses(gen.sample(labels, rng), labels, classes, clients, student)
        return {k: float(v) for k, v in parts.items()}

    before = losses()
    rng = torch.Generator()
    rng.set_state(rng_state)
    train_generator(gen, classes, clients, student, opts, 1, rng)
    return before, losses(), gen


@pytest.mark.parametrize("term, options", [
    ("kl", {"lambda-kl": 1000.0, "ablate": "mse", "generator-lr": 1e-3}),
    ("mse", {"lambda-mse": 1000.0, "ablate": "kl", "generator-lr": 1e-3}),
])
def test_one_generator_step_increases_the_disagreement_it_maximises(term, options):
    s = make_strategy(**options)
    sc = Scenario(s)
    clients = Teachers.stack(sc.clients, s.model.layers, 4, torch.device("cpu"))
    student = LatentStudent(sc.provisional, s.model.layers, slice(2, 4), torch.device("cpu"))
    before, after, _ = _one_step(s.opts, student, clients)
    assert after[term] > before[term]


@pytest.mark.parametrize("ablate, perturb", [("kl", "head"), ("mse", "prompts"), ("kl,mse", "both")])
def test_ablated_disagreement_term_no_longer_steers_the_generator(ablate, perturb):
    """Without L_KL the student's head has no say in generation; without L_MSE its prompts have none."""
    def gen_after_step(options: dict, change: bool) -> list[torch.Tensor]:
        s = make_strategy(**options)
        sc = Scenario(s)
        prov = copy.deepcopy(sc.provisional)
        if change:
            for name in prov:
                is_head = name.startswith("head.")
                if (perturb in ("head", "both") and is_head) or (perturb in ("prompts", "both") and not is_head):
                    prov[name] = prov[name] + 0.7
        clients = Teachers.stack(sc.clients, s.model.layers, 4, torch.device("cpu"))
        student = LatentStudent(prov, s.model.layers, slice(2, 4), torch.device("cpu"))
        *_, gen = _one_step(s.opts, student, clients)
        return [p.detach().clone() for p in gen.parameters()]

    off = {"ablate": ablate, "generator-lr": 1e-3}
    same = all(torch.equal(a, b) for a, b in zip(gen_after_step(off, False), gen_after_step(off, True)))
    assert same
    on = {"generator-lr": 1e-3}
    differs = any(not torch.equal(a, b) for a, b in zip(gen_after_step(on, False), gen_after_step(on, True)))
    assert differs
    s = make_strategy(ablate=ablate)
    sc = Scenario(s)
    z, y = sc.latents(range(5, 10), 4)
    parts = generator_losses(z, y, torch.arange(5, 10), Teachers.stack(sc.clients, s.model.layers, 4, torch.device("cpu")),
                             LatentStudent(sc.provisional, s.model.layers, slice(2, 4), torch.device("cpu")),
                             s.opts.use_kl, s.opts.use_mse)
    for term in ablate.split(","):
        assert float(parts[term]) == 0.0


# ---------------------------------------------------------------------------- distillation
# Paper generator lr; a larger distillation step so 150 steps show the effect clearly.
FAST = {"generator-epochs": 60, "distill-epochs": 150, "distill-lr": 1e-2, "averaging": "samples"}


@pytest.fixture(scope="module")
def distilled():
    torch.set_num_threads(1)
    s = make_strategy(**FAST, **SLICES)  # the Scenario moves task slices
    sc = Scenario(s)
    return sc, sc.consolidate()


def test_distillation_moves_prompts_towards_the_teachers(distilled):
    sc, out = distilled
    layers = sc.strategy.model.layers
    z_new, _ = sc.latents(range(5, 10))
    z_old, _ = sc.latents(range(0, 5))
    before = prompt_mse(sc.provisional, sc.clients, z_new, layers, 4)
    after = prompt_mse(out, sc.clients, z_new, layers, 4)
    assert after < 0.7 * before
    # Earlier prompt slices are never touched by the server (they are frozen as on clients).
    for name in out:
        if name.startswith("prompt."):
            np.testing.assert_array_equal(out[name][:2], sc.provisional[name][:2])
    assert prompt_mse(out, [sc.strategy.previous], z_old, layers, 2) >= 0.0


def test_distillation_raises_head_accuracy_on_known_classes(distilled):
    sc, out = distilled
    z, y = sc.latents(range(10))
    before = head_accuracy(sc.provisional, z, y, 10)
    after = head_accuracy(out, z, y, 10)
    z_old, y_old = sc.latents(range(5))
    assert after > before + 40 and after > 70
    assert head_accuracy(out, z_old, y_old, 10) > 50  # old classes are replayed, not forgotten
    assert sc.strategy.last_report["consolidation-seconds"] > 0
    assert "past-gen-cls" in sc.strategy.last_report


def _recording(gen: LatentGenerator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Make ``gen.sample`` record every batch it returns; returns the record."""
    record: list[tuple[torch.Tensor, torch.Tensor]] = []
    sample = gen.sample

    def recorded(labels, generator=None):
        z = sample(labels, generator)
        record.append((z.detach().clone(), labels.clone()))
        return z

    gen.sample = recorded  # type: ignore[method-assign]
    return record


def _one_distillation(**options):
    """One distillation step of a strategy with ``options`` on the test scenario, recording the
    latent batches both generators drew; returns what the checks below need."""
    s = make_strategy(**{"distill-epochs": 1, **options})
    sc = Scenario(s)
    cpu, layers = torch.device("cpu"), s.model.layers
    clients = Teachers.stack(sc.clients, layers, 4, cpu)
    prev = Teachers.stack([s.previous], layers, 2, cpu)
    torch.manual_seed(0)
    gen, old_gen = LatentGenerator(NUM_CLASSES, D), LatentGenerator(NUM_CLASSES, D)
    new_batches, old_batches = _recording(gen), _recording(old_gen)
    student = LatentStudent(sc.provisional, layers, slice(2, 4), cpu)
    report = distill(student, s.opts, (gen, torch.arange(5, 10), clients), (old_gen, torch.arange(5), prev),
                     torch.arange(10), torch.Generator().manual_seed(0))
    return s, sc, clients, prev, student, new_batches, old_batches, report


@pytest.mark.parametrize("mode, teachers", [("composite", "clients-and-previous"), ("old", "clients-and-previous"),
                                           ("composite", "previous")])
def test_old_task_prompt_term_is_weighted_as_eq6_over_the_composite_batch(mode, teachers):
    """Eq. 6 per sample: clients on every latent, the previous server (zeta) on old-class ones,
    averaged over the composite batch; ``old`` averages the old term over old latents alone.
    ``previous`` (the authors' code): the clients teach the current-task latents only."""
    s, sc, clients, prev, student, new_batches, old_batches, report = _one_distillation(
        **{"old-prompt-mean": mode, "ablate": "classifier-distillation", "old-latent-teachers": teachers})
    cpu, layers = torch.device("cpu"), s.model.layers
    (z_new, _), (z_old, _) = new_batches[0], old_batches[0]
    z = torch.cat([z_new, z_old])
    assert len(z_new) == 64 and len(z_old) == 32  # replay ratio 0.5
    # Independently: per-sample squared errors, zeta = 1 on old latents, mean over the batch.
    with torch.no_grad():
        fresh = LatentStudent(sc.provisional, layers, slice(2, 4), cpu)
        per_client = sum((fresh.final_prompts(z, l)[None] - clients.final_prompts(z, l)).pow(2).mean(dim=(2, 3))
                         for l in layers)  # (C, B)
        per_old = sum((fresh.final_prompts(z_old, l) - prev.final_prompts(z_old, l)[0]).pow(2).mean(dim=(1, 2))
                      for l in layers)  # (B_old,)
    if teachers == "previous":  # the authors' code: per latent, K = 5 classes x the 3 clients together
        zeta_term = 5 * 3 * len(z_old) / len(z_new) * per_old.mean()
    else:
        zeta_term = per_old.sum() / len(z) if mode == "composite" else per_old.mean()
    clients_term = per_client.mean(1).sum() if teachers == "clients-and-previous" else \
        per_client[:, : len(z_new)].mean(1).sum()
    expected = float(clients_term + zeta_term)
    assert report["prompt-loss"] == pytest.approx(expected, rel=1e-4)
    assert float(per_old.mean()) > 0.1 * expected  # the old term matters in this check


def test_previous_teachers_weight_relative_to_the_clients_is_the_authors_codes():
    """old-latent-teachers = previous (the authors' code, knowledge_distillation: squared errors
    summed over the batch, weight 1 per old latent for the previous server, n_{j,y} / N per current
    latent for client j): per latent, the previous server weighs K (the current classes) times the
    clients together. At CIFAR-100's setting (10 classes per task, 5 clients, replay ratio 0.5)
    the composite weight of eq. 6 is 75 times lighter relative to the clients."""
    from promptfcl.strategies.hepco.distill import old_teacher_weight

    n_new, n_old, k, clients = 64, 32, 10, 5
    # the authors' weights, per latent: previous server 1; clients together sum_j n_{j,y} / N = 1 / K
    # (5 clients holding equal shares of 10 equally represented classes)
    counts = np.full((clients, k), 7)
    authors = 1.0 / float((counts / counts.sum()).sum(0).mean())
    assert authors == pytest.approx(k)

    def per_latent_ratio(**options):  # previous server per old latent / clients together per new latent
        w = old_teacher_weight(HePCoOptions(**options), n_new, n_old, k, float(clients))
        return (w / n_old) / (clients / n_new)

    assert per_latent_ratio(old_latent_teachers="previous") == pytest.approx(authors)
    composite = per_latent_ratio()
    assert composite == pytest.approx(n_new / (n_new + n_old) / clients)
    assert authors / composite == pytest.approx(75.0)
    assert per_latent_ratio(old_prompt_mean="old") == pytest.approx(3 * composite)
    assert old_teacher_weight(HePCoOptions(old_latent_teachers="previous"), n_new, 0, k, clients) == 0.0
    with pytest.raises(ConfigError, match="old-prompt-mean applies"):
        make_strategy(**{"old-latent-teachers": "previous", "old-prompt-mean": "old"})


@pytest.mark.parametrize("head_loss", ["ce", "balanced"])
def test_head_distillation_loss_weighs_samples_or_classes(head_loss):
    """``ce``: the paper's mean over the composite batch; ``balanced``: the mean over seen classes of
    each class's mean cross-entropy, however often the class was drawn."""
    s, sc, clients, prev, student, new_batches, old_batches, report = _one_distillation(
        **{"head-loss": head_loss, "ablate": "prompt-distillation"})
    z = torch.cat([new_batches[0][0], old_batches[0][0]])
    y = torch.cat([new_batches[0][1], old_batches[0][1]])
    w, b = torch.from_numpy(sc.provisional["head.weight"]), torch.from_numpy(sc.provisional["head.bias"])
    per_sample = F.cross_entropy(z @ w.T + b, y, reduction="none")
    if head_loss == "ce":
        expected = per_sample.mean()
    else:
        expected = torch.stack([per_sample[y == c].mean() for c in y.unique()]).mean()
    assert report["head-loss"] == pytest.approx(float(expected), rel=1e-5)
    # replay ratio 0.5: twice as many current-class latents as old ones in the composite batch
    assert (y >= 5).sum() == 2 * (y < 5).sum()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_distillation_samples_the_generators_in_the_chosen_batchnorm_mode(mode):
    s = make_strategy(**{"distill-epochs": 2, "distill-generator-mode": mode})
    sc = Scenario(s)
    cpu = torch.device("cpu")
    clients = Teachers.stack(sc.clients, s.model.layers, 4, cpu)
    torch.manual_seed(0)
    gen = LatentGenerator(NUM_CLASSES, D)
    gen.train()
    bn = next(m for m in gen.net if isinstance(m, torch.nn.BatchNorm1d))
    bn.running_mean.fill_(3.0)  # as if fitted: running statistics far from this batch's
    record = _recording(gen)
    student = LatentStudent(sc.provisional, s.model.layers, slice(2, 4), cpu)
    distill(student, s.opts, (gen, torch.arange(5, 10), clients), None, torch.arange(10), torch.Generator().manual_seed(0))
    z, labels = record[0]
    # eval: a latent depends on its own noise and label only (running statistics), not on its batch
    assert gen.training is (mode == "train")
    with torch.no_grad():
        gen.eval()
        alone = gen(torch.zeros(1, 64), labels[:1])
        gen.train(mode == "train")
    stats_unchanged = bool(torch.all(bn.running_mean == 3.0))
    assert stats_unchanged is (mode == "eval")
    if mode == "eval":
        noise = torch.randn(len(labels), 64)
        with torch.no_grad():
            whole, first = gen(noise, labels), gen(noise[:5], labels[:5])
        torch.testing.assert_close(whole[:5], first)
    assert torch.isfinite(alone).all()


# ---------------------------------------------------------------------------- diagnostics
def test_teacher_accuracy_tells_recognisable_latents_from_noise():
    s = make_strategy()
    sc = Scenario(s)
    clients = Teachers.stack(sc.clients, s.model.layers, 4, torch.device("cpu"))
    classes = torch.arange(5, 10)
    z, y = sc.latents(classes.tolist(), 20)
    acc = teacher_accuracy(clients, z, y, classes)
    assert acc.shape == (3,) and bool((acc > 90).all())  # at the class means: every client recognises them
    noise = torch.randn_like(z) * 4
    assert float(teacher_accuracy(clients, noise, y, classes).mean()) < 50


def test_round_reports_what_its_pseudo_latents_are(distilled):
    sc, _ = distilled
    report = sc.strategy.last_report
    for key in ("gen-teacher-acc", "past-gen-teacher-acc", "gen-provisional-acc", "gen-student-acc",
                "past-gen-provisional-acc", "past-gen-student-acc"):
        assert 0.0 <= report[key] <= 100.0, key
    # the generators were fitted to be classified by their teachers, so they mostly are
    assert report["gen-teacher-acc"] > 60 and report["past-gen-teacher-acc"] > 60
    assert not any(k.startswith(("real-", "latent-")) for k in report)  # no real data without diagnostics


def test_diagnostics_need_the_servers_central_data():
    cfg = tiny_config(strategy="hepco", population="nodes", evaluation="federated", num_classes=10,
                      **{"hepco.diagnostics": True})
    with pytest.raises(ConfigError, match="diagnostics"):
        check_run(cfg)


def test_real_data_probe_measures_distance_and_accuracy():
    cfg = tiny_config(strategy="hepco")
    probe = RealDataProbe(get_runtime(cfg, HePCoPrompt), cfg.run.seed, per_class=6)
    model = probe.rt.model
    state = {k: v.detach().numpy().copy() for k, v in model.trainable_state().items()}
    seen, old = np.arange(10), np.arange(5)
    index = probe.images(seen)
    labels = probe.rt.data.train.labels[index]
    assert all((labels == c).sum() == 6 for c in seen) and np.array_equal(index, probe.images(seen))
    q, f = probe.features(state, index, 1)
    # Latents placed at the real classes' mean prompted features, and the nearest-mean head.
    mu = torch.stack([f[torch.as_tensor(labels == c)].mean(0) for c in seen])
    head = dict(state, **{"head.weight": mu.numpy(), "head.bias": (-(mu * mu).sum(1) / 2).numpy()})
    y = torch.arange(10).repeat_interleave(3)
    latents = {"old": (mu[y[:15]], y[:15]), "new": (mu[y[15:]], y[15:])}
    out = probe.measure(state, head, 1, seen, old, latents)
    assert out["latent-feature-cos-old"] == pytest.approx(1.0, abs=1e-5)
    assert out["latent-feature-ncm-new"] == 100.0
    assert -1.0 <= out["real-query-feature-cos"] <= 1.0 and out["latent-query-cos-new"] <= 1.0 + 1e-6
    expected_shift = (f - q).norm(dim=-1).mean() / (q - q.mean(0)).norm(dim=-1).mean()
    assert out["real-prompt-shift"] == pytest.approx(float(expected_shift), rel=1e-5) and expected_shift > 0
    # Same prompts in both models: distilling only the prompts changes nothing; the head does.
    assert out["real-old-acc-distilled-prompts"] == out["real-old-acc-provisional"]
    assert out["real-new-acc-distilled"] == out["real-new-acc-distilled-head"]
    for part in ("old", "new"):  # the nearest-mean head reads real features far above chance (10 %)
        assert out[f"real-{part}-acc-distilled"] > max(25.0, out[f"real-{part}-acc-provisional"])


# ---------------------------------------------------------------------------- ablations at the server
SMALL = {"generator-epochs": 3, "distill-epochs": 4, "distill-lr": 1e-2, "averaging": "samples"}


def test_whole_pool_training_trains_every_component_on_every_task():
    """``pool-training = whole`` (default: the paper's one shared pool, the authors' code): the pool
    is one slice on every task, nothing frozen, initialised once; the choice travels in the
    prompt's buffer to clients and evaluators. ``task-slices``: CODA-P's slices."""
    s = make_strategy()
    assert s.opts.pool_training == "whole"
    from promptfcl.common.model.prompted import initial_trainable_state

    initial = initial_trainable_state(model_spec(tiny_config(strategy="hepco"), NUM_CLASSES), HePCoPrompt)
    arrays = s.on_task_start(0, to_array_record({k: v.numpy() for k, v in initial.items()}))
    state = from_array_record(arrays)
    assert state["prompt.whole_pool"].tolist() == [1.0]
    again = from_array_record(s.on_task_start(1, to_array_record(state)))
    for name in state:  # task 1 starts from the pool as it is: nothing re-initialised
        np.testing.assert_array_equal(again[name], state[name])
    prompt = s.prompt_from(again)
    prompt.set_task(1)
    prompt.train()
    q = torch.randn(4, D)
    prompt(q, s.model.layers[0]).pow(2).sum().backward()
    grad = getattr(prompt, f"p{s.model.layers[0]}").grad
    assert (grad.abs().sum(dim=(1, 2)) > 0).all()  # every component, task 0's included
    assert s.components(0) == s.components(3) == s.model.pool_size
    sliced = make_strategy(**SLICES)
    assert sliced.components(0) == sliced.model.pool_size // sliced.data.num_tasks
    sliced_state = from_array_record(sliced.on_task_start(0, to_array_record(
        {k: v.numpy() for k, v in initial.items()})))
    assert sliced_state["prompt.whole_pool"].tolist() == [0.0]


def test_whole_pool_with_clients_on_two_tasks_averages_the_pool_over_everyone(flower_identity):
    """Asynchronous arrival with the whole pool: every client trained every component, so the
    prompt arrays average over all replies; a task's head rows over the replies that trained it."""
    cfg = tiny_config(strategy="hepco", switch_fraction=0.5, switch_every=1, rounds_per_task=2,
                      **{"hepco.averaging": "samples"})
    s = HePCoStrategy.of(cfg, NUM_CLASSES, cfg.method_options("hepco"))
    shapes = {"prompt.p0": (cfg.model.pool_size, 2, D), "prompt.k0": (cfg.model.pool_size, D), "prompt.whole_pool": (1,),
              "head.weight": (NUM_CLASSES, D), "head.bias": (NUM_CLASSES,)}
    s.round_arrays = to_array_record({k: np.zeros(v, np.float32) for k, v in shapes.items()})
    contents = [reply({k: np.full(v, float(i + 1), np.float32) for k, v in shapes.items()}, n)
                for i, n in enumerate([10, 30])]
    accepted = accepted_of(contents, tasks=[0, 1])
    for a, weight in zip(accepted, (10.0, 30.0)):
        a.weight = weight
    out = from_array_record(s.aggregate(accepted))  # the platform's average, with HePCo's averaged_over_all
    np.testing.assert_allclose(out["prompt.p0"], (10 * 1 + 30 * 2) / 40)  # over everyone
    np.testing.assert_allclose(out["head.weight"][:5], 1.0)  # task 0's rows: its client alone
    np.testing.assert_allclose(out["head.weight"][5:], 2.0)


def test_paper_baseline_is_a_named_variant():
    from promptfcl.server.bench import parse_method

    assert parse_method("hepco/baseline") == (
        "hepco", {"hepco.ablate": "prompt-distillation,classifier-distillation"})
    assert parse_method("hepco/baseline/replay-ratio=1") == (
        "hepco", {"hepco.ablate": "prompt-distillation,classifier-distillation", "hepco.replay-ratio": 1})
    with pytest.raises(ConfigError, match="hepco has no variant 'nope'"):
        parse_method("hepco/nope")


def test_prompt_distillation_switch():
    sc = Scenario(make_strategy(ablate="prompt-distillation", **SMALL))
    out = sc.consolidate()
    for name in out:
        if name.startswith("prompt."):
            np.testing.assert_array_equal(out[name], sc.provisional[name])
    assert not np.allclose(out["head.weight"], sc.provisional["head.weight"])
    assert "prompt-loss" not in sc.strategy.last_report


def test_classifier_distillation_switch():
    sc = Scenario(make_strategy(ablate="classifier-distillation", **SMALL))
    out = sc.consolidate()
    np.testing.assert_array_equal(out["head.weight"], sc.provisional["head.weight"])
    np.testing.assert_array_equal(out["head.bias"], sc.provisional["head.bias"])
    assert not np.allclose(out["prompt.p0"], sc.provisional["prompt.p0"])


def test_both_distillations_off_is_the_plain_average():
    s = make_strategy(ablate="prompt-distillation,classifier-distillation", averaging="uniform")
    sc = Scenario(s)
    replies = [reply(c, n) for c, n in zip(sc.clients, (1, 50, 200))]  # uniform: counts do not matter
    accepted = accepted_of(replies, tasks=1)
    out = from_array_record(s.consolidate(2, s.aggregate(accepted), accepted))  # as the platform calls them
    for name in out:
        np.testing.assert_allclose(out[name], np.mean([c[name] for c in sc.clients], axis=0), rtol=1e-6, atol=1e-7)


def test_previous_model_switch():
    def run(options: dict, shift: float) -> tuple[dict, dict]:
        sc = Scenario(make_strategy(**options))
        prev = sc.strategy.previous
        if prev is not None:  # a class-dependent change (a common shift would cancel in the softmax)
            prev["head.weight"] = prev["head.weight"] + shift * np.random.default_rng(0).standard_normal(
                prev["head.weight"].shape).astype(np.float32)
        return sc.consolidate(), sc.strategy.last_report

    # With the previous model: a second generator, and its model shapes the result.
    out_a, report = run(SMALL, 0.0)
    out_b, _ = run(SMALL, 0.5)
    assert "past-gen-cls" in report
    assert np.abs(out_a["head.weight"] - out_b["head.weight"]).max() > 1e-3
    # Ablated: nothing is kept at the end of a task, no old-class generator, no replay.
    sc = Scenario(make_strategy(ablate="previous-model", **SMALL))
    assert sc.strategy.previous is None and "previous.head.weight" not in sc.strategy.state_dict()
    sc.strategy.previous, sc.strategy.previous_task = {"bogus": np.zeros(1)}, 0  # even if state were there
    sc.consolidate()
    assert "past-gen-cls" not in sc.strategy.last_report
    assert sc.strategy.last_report["past-generator-seconds"] == pytest.approx(0.0, abs=1e-3)


# ---------------------------------------------------------------------------- server state
def test_server_keeps_only_the_previous_task_model_and_checkpoints_it():
    s = make_strategy(**SMALL, **SLICES)
    sc = Scenario(s)
    state = s.state_dict()
    kept = {k for k in state if k.startswith("previous.")}
    assert kept == {"previous.prompt.p0", "previous.prompt.k0", "previous.prompt.p1", "previous.prompt.k1",
                    "previous.head.weight", "previous.head.bias"}
    assert state["previous.prompt.p0"].shape == (2, 4, D)  # only the slices of tasks seen so far
    assert state["previous-task"] == 0
    first = sc.consolidate()
    # A fresh server restored from the checkpoint consolidates identically.
    fresh = make_strategy(**SMALL, **SLICES)
    fresh.load_state_dict(copy.deepcopy(state))
    fresh.task, fresh.round = 1, 0
    again = from_array_record(fresh.consolidate(2, to_array_record(sc.provisional), accepted_of(sc.replies, tasks=1)))
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])


# ---------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_simulation_end_to_end(tmp_path):
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "hepco", strategy="hepco", lr=0.01, **PLAIN_MEAN, **{
        "hepco.generator-epochs": 5, "hepco.distill-epochs": 5, "hepco.diagnostics": True,
        "hepco.diagnostics-per-class": 4})
    assert results["config"]["strategy"] == "hepco"
    assert results["config"]["hepco.generator-epochs"] == 5
    acc = results["accuracy_matrix"]
    assert acc[0][0] is not None and acc[1][1] is not None and acc[1][0] is None
    rounds = results["rounds"]
    assert len(rounds) == 4 and all(r["server_seconds"] > 0 and r["clients_aggregated"] == 3 for r in rounds)
    # The latent diagnostics land in results.json, real-data ones from the server's central data.
    first, last = rounds[0]["strategy_metrics"], rounds[-1]["strategy_metrics"]
    assert {"gen-teacher-acc", "real-new-acc-distilled", "latent-feature-cos-new"} <= set(first)
    assert "past-gen-teacher-acc" not in first and "real-old-acc-provisional" not in first  # no old task yet
    assert {"past-gen-teacher-acc", "real-old-acc-distilled-head", "latent-query-ncm-old"} <= set(last)
    assert 0.0 <= last["real-old-acc-distilled"] <= 100.0
    # What travels: prompts and keys (no attention vectors), the head, and the pool-training switch.
    cfg = tiny_config()
    n = len(cfg.model.layers) * cfg.model.pool_size * (cfg.model.prompt_length * D + D) + NUM_CLASSES * (D + 1) + 1
    assert results["communication"]["trainable_parameters"] == n
    assert 4 * n <= results["communication"]["bytes_per_client_exchange"] <= 4 * n * 1.05 + 4096


# ---------------------------------------------------------------------------- asynchronous arrival
def test_async_latents_follow_the_replies_and_each_client_teaches_its_own_task():
    from promptfcl.strategies.hepco.distill import group_generator_losses
    from promptfcl.strategies.hepco.latents import TaskTeachers, draw_labels

    sc = Scenario(make_strategy(), clients=4)
    cpu = torch.device("cpu")
    behind = Teachers.stack(sc.clients[:1], sc.strategy.model.layers, 2, cpu)  # one client still on task 0
    ahead = Teachers.stack(sc.clients[1:], sc.strategy.model.layers, 4, cpu)  # three on task 1
    groups = [TaskTeachers(torch.arange(5), behind, 1), TaskTeachers(torch.arange(5, 10), ahead, 3)]
    labels = draw_labels(groups, 20_000, torch.Generator().manual_seed(0))
    assert abs(float((labels >= 5).double().mean()) - 0.75) < 0.02  # a task's share: its replies
    assert set(labels.tolist()) == set(range(10))
    student = LatentStudent(sc.provisional, sc.strategy.model.layers, slice(0, 4), cpu)
    z, y = sc.latents(range(10), n_per_class=8)
    both = group_generator_losses(z, y, groups, student)
    old, new = y < 5, y >= 5
    parts = [generator_losses(z[old], y[old], torch.arange(5), behind, student),
             generator_losses(z[new], y[new], torch.arange(5, 10), ahead, student)]
    for name in ("cls", "kl", "mse"):  # each client on its own task's latents, through its own slices
        torch.testing.assert_close(both[name], parts[0][name] + parts[1][name])
    one = group_generator_losses(z[new], y[new], groups[1:], student)  # one task: exactly the synchronous loss
    for name in ("cls", "kl", "mse"):
        assert torch.equal(one[name], parts[1][name])


def test_async_server_step_over_several_rounds(flower_identity):
    """4 clients, 2 rounds per task, every round 2 move on: round 2 trains tasks 0 and 1 at once."""
    from flwr.app import ConfigRecord, Message

    from tests.helpers import NodeList

    cfg = tiny_config(strategy="hepco", num_clients=4, clients_per_round=4, rounds_per_task=2, switch_every=1,
                      switch_fraction=0.5, **{"hepco.generator-epochs": 3, "hepco.distill-epochs": 3,
                                              "hepco.pool-training": "task-slices"})
    s = HePCoStrategy.of(cfg, NUM_CLASSES, cfg.method_options("hepco"))
    per = cfg.model.pool_size // cfg.data.num_tasks
    g = torch.Generator().manual_seed(0)
    prompt = HePCoPrompt(D, cfg.model.layers, cfg.model.pool_size, cfg.model.prompt_length, cfg.data.num_tasks)
    state = {f"prompt.{k}": v.detach().numpy().copy() for k, v in prompt.state_dict().items()}
    state |= {"head.weight": 0.1 * torch.randn(NUM_CLASSES, D, generator=g).numpy(),
              "head.bias": np.zeros(NUM_CLASSES, np.float32)}
    arrays = s.on_task_start(0, to_array_record(state))

    outcomes = []  # each round's, as the server loop receives it

    def round_(server_round: int, arrays: ArrayRecord) -> tuple[ArrayRecord, MetricRecord, list[int]]:
        index = server_round - 1
        task, round_in = s.schedule.steps()[index]
        for new in s.schedule.tasks_starting(index):
            arrays = s.on_task_start(new, arrays)
        sent = list(s.configure_train(server_round, arrays, ConfigRecord({"task": task, "round": round_in}),
                                      NodeList(4)))
        replies = []
        for msg in sent:  # each client moves its own task's slice and head rows
            t = int(msg.content["config"]["task"])
            mine = {k: v.copy() for k, v in from_array_record(arrays).items()}
            for name in mine:
                rows = slice(t * per, (t + 1) * per) if name.startswith("prompt.") else slice(5 * t, 5 * t + 5)
                mine[name][rows] += 0.1 * torch.randn(mine[name][rows].shape, generator=g).numpy()
            replies.append(Message(content=reply(mine), reply_to=msg))
        outcome = s.aggregate_round(server_round, replies)
        outcomes.append(outcome)
        out, metrics = outcome.arrays, outcome.metrics
        assert not outcome.rejected
        return out, metrics, sorted(int(m.content["config"]["task"]) for m in sent)

    arrays, m1, tasks1 = round_(1, arrays)
    assert tasks1 == [0, 0, 0, 0] and "past-gen-cls" not in m1
    before = from_array_record(arrays)
    arrays, m2, tasks2 = round_(2, arrays)
    assert tasks2 == [0, 0, 1, 1]
    groups = s.task_teachers(list(outcomes[-1].accepted))
    assert [(g.share, g.classes.tolist(), g.teachers.keys[0].shape[1]) for g in groups] == \
        [(2, list(range(5)), per), (2, list(range(5, 10)), 2 * per)]
    # the distilled model moved both tasks' slices away from the replies' uniform average
    average = {k: np.mean([from_array_record(m.content["arrays"])[k] for m in outcomes[-1].accepted], axis=0)
               for k in before}
    after = from_array_record(arrays)
    for t in (0, 1):
        rows = slice(t * per, (t + 1) * per)
        assert not np.allclose(after["prompt.p0"][rows], average["prompt.p0"][rows], atol=1e-7)
    assert not np.array_equal(after["prompt.p0"][:per], before["prompt.p0"][:per])
    assert "past-gen-cls" not in m2  # no task has ended for every client yet
    # task 0's nominal end (round 2): the server model then is the past teacher from now on
    s.on_task_end(0, arrays)
    frozen = {k: v.copy() for k, v in s.previous.items()}
    assert set(frozen) == {f"prompt.{k}{l}" for l in cfg.model.layers for k in "pk"} | {"head.weight", "head.bias"}
    np.testing.assert_array_equal(frozen["prompt.p0"], after["prompt.p0"][:per])
    for server_round in (3, 4):
        arrays, metrics, tasks = round_(server_round, arrays)
        assert tasks == [1, 1, 1, 1] and "past-gen-cls" in metrics
        for name, value in frozen.items():  # the teacher stays the model of task 0's nominal end
            np.testing.assert_array_equal(s.previous[name], value)
    assert not np.array_equal(from_array_record(arrays)["head.weight"], frozen["head.weight"])


@pytest.mark.e2e
def test_hepco_asynchronous_end_to_end(tmp_path):
    """Every round 2 of 3 clients move on (3 clients, 2 rounds per task): round 2 has both tasks in flight."""
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "hepco", strategy="hepco", lr=0.01, **PLAIN_MEAN, **{
        "hepco.generator-epochs": 5, "hepco.distill-epochs": 5, "switch-every": 1, "switch-fraction": 0.5})
    rounds = results["rounds"]
    assert [sorted(r["client_tasks"]) for r in rounds] == [[0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert all(r["clients_aggregated"] == 3 and not r["rejected"] for r in rounds)
    assert "past-gen-cls" not in rounds[1]["strategy_metrics"] and "past-gen-cls" in rounds[2]["strategy_metrics"]
    acc = results["accuracy_matrix"]
    assert acc[1][0] is None and all(v is not None and 0 <= v <= 100 for v in (acc[0][0], acc[0][1], acc[1][1]))


def test_a_defended_round_gives_hepcos_server_step_the_screened_replies(flower_identity):
    """HePCo's provisional model and its teachers are built from the replies the platform's
    defences left: a reply 4x longer than the others reaches consolidate clipped to update-clip x
    the lower median, the same replies the average is taken over (like with like)."""
    from flwr.app import ConfigRecord, Message

    from tests.helpers import NodeList

    cfg = tiny_config(strategy="hepco", num_clients=4, clients_per_round=4, defences="on")
    s = HePCoStrategy.of(cfg, NUM_CLASSES, cfg.method_options("hepco"))
    state = {"head.weight": np.zeros((NUM_CLASSES, D), np.float32), "head.bias": np.zeros(NUM_CLASSES, np.float32)}
    msgs = list(s.configure_train(1, to_array_record(state), ConfigRecord({"task": 0, "round": 0}), NodeList(4)))
    seen = {}

    def spy(server_round, arrays, accepted):
        seen["teachers"] = [from_array_record(a.content["arrays"])["head.weight"] for a in accepted]
        seen["provisional"] = from_array_record(arrays)["head.weight"]
        return arrays

    s.consolidate = spy  # the method's server step, as the platform calls it
    scales = [1.0, 1.1, 0.9, 4.0]  # 4x: over the clip (3x), under update-strike-norm (5x: excluded)
    outcome = s.aggregate_round(1, [Message(reply({"head.weight": np.full((NUM_CLASSES, D), v, np.float32),
                                         "head.bias": np.zeros(NUM_CLASSES, np.float32)}), reply_to=m)
                          for v, m in zip(scales, msgs)])
    assert outcome.defences["clip"] == 1
    longest = np.abs(seen["teachers"][3]).max()
    assert longest == pytest.approx(cfg.robustness.update_clip * 1.0, rel=1e-5)  # 3 x the lower median (1.0)
    np.testing.assert_allclose(seen["provisional"], np.mean(seen["teachers"], axis=0), rtol=1e-5)
