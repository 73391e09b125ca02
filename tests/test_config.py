"""Configuration: strict parsing, clear errors, and pyproject defaults in sync."""

import tomllib
from pathlib import Path

import pytest

from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.config.files import parse_overrides
from promptfcl.server.cli import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_equals_the_dataclass_defaults():
    from promptfcl.strategies.registry import app_config_tables, namespaced_defaults

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    run_config = dict(doc["tool"]["flwr"]["app"]["config"])
    tables = {k: run_config.pop(k) for k in list(run_config) if isinstance(run_config[k], dict)}
    assert run_config == ExperimentConfig().to_dict()
    # every namespaced option (dp.*, <method>.*) is declared with its default
    assert tables == namespaced_defaults(), "regenerate with scripts/app-config-tables.py:\n" + app_config_tables()
    assert doc["tool"]["flwr"]["app"]["components"] == {"serverapp": "promptfcl.server.app:app", "clientapp": "promptfcl.client.app:app"}


def test_every_key_passes_flowers_own_run_config_check():
    """The check the SuperLink applies to `flwr run -c` (and so to deploy/submit-run.sh): every key
    the project knows is accepted, and the fused run config gives the run's method its options."""
    from promptfcl.common.flower_internals import internal

    get_fused_config_from_dir = internal("fused_run_config")

    from promptfcl.strategies.registry import namespaced_defaults

    every = dict(ExperimentConfig().to_dict())
    for namespace, options in namespaced_defaults().items():
        every.update({f"{namespace}.{k}": v for k, v in options.items()})
    assert len(every) > 150
    assert get_fused_config_from_dir(ROOT, every) == every
    overrides = {"strategy": "hgp", "hgp.cov-type": "diag", "dp.clip": 1.0, "dp.noise-multiplier": 0.5,
                 "powder.row-top": 2, "fppl.debias": False, "hepco.ablate": "prompt-distillation"}
    fused = get_fused_config_from_dir(ROOT, overrides)
    cfg = ExperimentConfig.from_run_config(fused)
    # the run's method's options and dp.*, not the other methods'
    assert cfg.method_options("hgp")["cov-type"] == "diag" and cfg.method_options("dp")["clip"] == 1.0
    assert cfg.method_options("dp")["noise-multiplier"] == 0.5
    assert set(cfg.method_options("hgp")) == set(namespaced_defaults()["hgp"])
    assert not cfg.method_options("powder") and not cfg.method_options("fppl")
    with pytest.raises(ValueError, match="not present in the main dictionary"):
        get_fused_config_from_dir(ROOT, {"hgp.no-such-option": 1})


def test_round_trip_through_flat_dict():
    cfg = ExperimentConfig.from_dict({"num-tasks": 10, "pool-size": 100, "hepco.lambda-kl": 0.5})
    again = ExperimentConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.method_options("hepco") == {"lambda-kl": 0.5}
    assert again.digest() == cfg.digest()
    assert ExperimentConfig.from_dict({"seed": 1}).digest() != cfg.digest()


@pytest.mark.parametrize("raw, message", [
    ({"num-taks": 3}, "unknown configuration key 'num-taks'"),
    ({"num-tasks": "three"}, "not a valid int"),
    ({"num-tasks": 2.5}, "not a valid int"),
    ({"dirichlet-beta": 0}, "dirichlet-beta must be > 0"),
    ({"category-ratio": 1.5}, "category-ratio must be in"),
    ({"partition": "random"}, "partition must be one of"),
    ({"prompt-length": 7}, "prompt-length must be even"),
    ({"clients-per-round": 20}, "exceeds num-clients"),
    ({"num-tasks": 3}, "pool-size (20) must be a positive multiple of num-tasks (3)"),
    ({"device": "tpu"}, "device must be one of"),
    ({"prompt-layers": "a,b"}, "prompt-layers must be comma-separated integers"),
    ({"query-cache": "maybe"}, "not a valid bool"),
    ({"client-gpus": -0.5}, "client-gpus must be 'auto' or a number >= 0"),
    ({"client-gpus": "half"}, "client-gpus must be 'auto' or a number >= 0"),
    ({"client-gpus": 1.5}, "client-gpus above 1 must be a whole number"),
    ({"client-cpus": 0}, "client-cpus must be 'auto' or a number > 0"),
    ({"ray-address": "head-node"}, "ray-address must be"),
    ({"ray-address": "10.0.0.1:99999"}, "ray-address must be"),
    ({"max-rounds": -1}, "max-rounds must be >= 0"),
    ({"augment": "mixup"}, "augment must be one of"),
    ({"centralised-mode": "all"}, "centralised-mode must be one of"),
    ({"centralised-mode": "joint"}, "needs centralised = true"),
    ({"partition": "quantity_skew"}, "partition must be one of"),
])
def test_bad_values_are_rejected_with_a_clear_message(raw, message):
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict(raw)
    assert message in str(err.value)


def test_empty_run_config_is_an_error_not_the_defaults():
    with pytest.raises(ConfigError, match="run config is empty"):
        ExperimentConfig.from_run_config({})


def test_cli_overrides_parse_as_toml_scalars():
    assert parse_overrides(["lr=1e-3", "dataset=digits", "query-cache=false", 'prompt-layers="0,1"']) == {
        "lr": 1e-3, "dataset": "digits", "query-cache": False, "prompt-layers": "0,1"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["lr"])


def test_config_files_flatten_method_tables(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('num-tasks = 10\npool-size = 100\n[hepco]\nlambda-kl = 0.5\n')
    cfg = load_config(str(f), ["seed=3"], "fedavg", None)
    assert cfg.data.num_tasks == 10 and cfg.run.seed == 3 and cfg.method_options("hepco") == {"lambda-kl": 0.5}
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "none.toml"), [], None, None)
    with pytest.raises(ConfigError, match="unknown strategy"):
        load_config(None, [], "nope", None)


def test_resources_and_cluster_keys_do_not_change_what_a_run_computes():
    plain = ExperimentConfig()
    placed = ExperimentConfig.from_dict({"client-gpus": 0.25, "client-cpus": 4, "ray-address": "10.0.0.1:6379",
                                         "max-rounds": 1})
    assert placed.digest() == plain.digest()  # a run resumes (and clients agree) on another cluster
    assert (placed.placement.client_gpus_value, placed.placement.client_cpus_value) == (0.25, 4.0)
    assert (plain.placement.client_gpus_value, plain.placement.client_cpus_value) == (None, None)
    assert ExperimentConfig.from_dict({"ray-address": "ray://head:10001"}).placement.ray_address == "ray://head:10001"


def test_every_key_has_a_section_and_the_derived_key_sets_follow_from_them():
    """The run config is split into sections; what a key enters (the digest, a decoded dataset, a
    node's folder cache, the backbone's identity, a client's data location) is declared on the key
    itself, so no list elsewhere has to change with a new key."""
    from promptfcl.common.config.experiment import (
        FLAT_ORDER,
        IDENTITIES,
        RESULT_NEUTRAL_KEYS,
        SECTIONS,
        keys_in,
        keys_of,
    )

    keys = [k for s in SECTIONS for k in keys_in(s)]
    assert len(keys) == len(set(keys))  # each key in exactly one section
    assert sorted(FLAT_ORDER) == sorted(keys) and list(ExperimentConfig().to_dict()) == list(FLAT_ORDER)
    assert all(keys_of(i) for i in IDENTITIES)
    base = ExperimentConfig()
    for key in keys_in("placement") + keys_in("output"):  # where and how a run goes: never what it computes
        assert key in RESULT_NEUTRAL_KEYS
    assert base.replace(threads=3, out_dir="elsewhere").digest() == base.digest()
    assert base.replace(lr=0.5).digest() != base.digest() and "lr" not in RESULT_NEUTRAL_KEYS
    # the decoded dataset depends on its source and preprocessing, not on training
    assert {"dataset", "data-dir", "image-size", "seed"} <= set(keys_of("dataset")) and "lr" not in keys_of("dataset")
    assert set(keys_of("architecture")) < set(keys_of("backbone")) and "weights" in keys_of("backbone")


def test_the_configuration_is_frozen_sections_each_checking_itself():
    """A run configuration is its sections: frozen values, each refusing its own bad values when made,
    the whole refusing values of different sections that cannot go together; flat keys change it
    only through ``replace``, which checks again."""
    import dataclasses

    from promptfcl.common.config.experiment import DataSection, ModelSection, TrainingSection

    cfg = ExperimentConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.lr = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training = TrainingSection(lr=0.5)  # type: ignore[misc]
    with pytest.raises(ConfigError, match="lr must be > 0"):
        TrainingSection(lr=0.0)
    with pytest.raises(ConfigError, match="num-tasks must be >= 1"):
        DataSection(num_tasks=0)
    ModelSection(pool_size=7)  # alone a pool of 7 is fine; over 5 tasks it is not:
    with pytest.raises(ConfigError, match="pool-size"):
        cfg.replace(model=ModelSection(pool_size=7))
    changed = cfg.replace(lr=0.5, num_tasks=4, pool_size=8)
    assert (changed.training.lr, changed.data.num_tasks, changed.model.pool_size) == (0.5, 4, 8)
    assert cfg.training.lr == 1e-2 and changed.replace(training=cfg.training).training.lr == 1e-2
    with pytest.raises(ConfigError, match="unknown configuration key 'learning-rate'"):
        cfg.replace(learning_rate=0.5)
