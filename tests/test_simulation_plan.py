"""Sizing the simulation's client actors for a machine or a Ray cluster (server/simulation.py)."""

from __future__ import annotations

import pytest

from promptfcl.common.config.experiment import ConfigError
from promptfcl.server.simulation import RayNode, plan_simulation
from tests.conftest import tiny_config


def plan_of(cfg, nodes, supernodes=None, address=""):
    """The plan of run ``cfg`` on ``nodes`` (plan_simulation takes the two sections it reads)."""
    return plan_simulation(cfg.federation, cfg.placement, nodes, supernodes, address)


def node(cpus: float, gpus: float = 0.0, name: str = "n") -> RayNode:
    return RayNode(name, cpus, gpus)


def test_cpu_machine_shares_its_cores_and_gives_no_gpu():
    plan = plan_of(tiny_config(**{"clients-per-round": 2}), [node(8)])
    assert (plan.supernodes, plan.client_cpus, plan.client_gpus, plan.parallel_clients) == (2, 4.0, 0.0, 2)
    assert plan.backend_config() == {"client_resources": {"num_cpus": 4.0, "num_gpus": 0.0}}


def test_auto_divides_the_gpus_among_the_clients_that_train_at_once():
    cfg = tiny_config(**{"num-clients": 10, "clients-per-round": 5})
    one_gpu = plan_of(cfg, [node(16, 1)])
    assert one_gpu.client_cpus == 3.0 and one_gpu.client_gpus == 0.2 and one_gpu.parallel_clients == 5
    four_gpus = plan_of(cfg, [node(16, 4)])
    assert four_gpus.client_gpus == 0.8
    many = plan_of(cfg, [node(16, 8)])
    assert many.client_gpus == 1.0  # never more than one GPU for one client
    # only two actors fit the cores: each gets half the GPU, not a fifth
    assert plan_of(cfg.replace(client_cpus="8"), [node(16, 1)]).client_gpus == 0.5


def test_explicit_shares_are_kept_and_a_cluster_spreads_them():
    cfg = tiny_config(**{"num-clients": 10, "clients-per-round": 6, "client-cpus": 2, "client-gpus": 0.5})
    plan = plan_of(cfg, [node(0, 0, "head"), node(4, 1, "w1"), node(4, 1, "w2")], address="10.0.0.1:6379")
    assert (plan.client_cpus, plan.client_gpus) == (2.0, 0.5)
    assert plan.parallel_clients == 4  # 2 per worker: bounded by both cores and GPU shares
    assert "Ray cluster at 10.0.0.1:6379: 3 node(s), 8 CPUs, 2 GPUs" in plan.describe()


def test_impossible_placements_are_refused_before_any_training():
    with pytest.raises(ConfigError, match="client-gpus = 0.5 but this machine's Ray has no GPU"):
        plan_of(tiny_config(**{"client-gpus": 0.5}), [node(8)])
    with pytest.raises(ConfigError, match="device = cuda"):
        plan_of(tiny_config(device="cuda"), [node(8)])
    with pytest.raises(ConfigError, match="no node of the Ray cluster at h:1 can host a client actor of 4 CPU"):
        plan_of(tiny_config(**{"client-cpus": 4}), [node(0, name="head"), node(2)], address="h:1")


def test_nodes_population_starts_one_flower_node_per_client():
    cfg = tiny_config(**{"population": "nodes", "num-clients": 3, "clients-per-round": 2})
    assert plan_of(cfg, [node(2)]).supernodes == 3
