"""Every shipped config composes and validates; bad input fails with the key, the value and the fix."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from hp_tool.cli import available_search_configs, compose
from hp_tool.config import AppConfig, to_app_config
from hp_tool.errors import ConfigError

SHIPPED = available_search_configs()


def load(*overrides: str) -> AppConfig:
    cfg, _ = compose(list(overrides))
    return to_app_config(cfg)


def test_all_gpt3_sizes_are_shipped():
    for size in ("tiny", "126m", "400m", "1b", "2b", "5b", "8b", "20b", "43b", "175b", "unknown_size"):
        assert f"gpt3/{size}" in SHIPPED


def user_model(name: str) -> list[str]:
    """finetune/custom takes the user's model on the command line: here the shipped tiny config."""
    return ["search_config.model.hf_config=tiny"] if name == "finetune/custom" else []


@pytest.mark.parametrize("cluster", ["local", "auto", "bcm", "in_process"])
def test_every_cluster_preset_composes_and_validates(cluster):
    """Each cluster preset composes with a search config (every search config is composed and planned in
    test_config_surface.py)."""
    app = load("search_config=gpt3/tiny", f"cluster={cluster}", "cluster.slurm.partition=batch")
    assert app.search_config.model_family == "gpt3"
    assert app.cluster.type == cluster


def test_defaults():
    cfg, name = compose([])
    app = to_app_config(cfg)
    assert name == "gpt3/5b"
    assert app.cluster.type == "auto"
    assert app.base_results_dir == "results"
    assert app.dry_run is False and app.wandb.enable is False


def test_list_override_from_the_command_line():
    app = load("search_config.train_settings.tensor_parallel_sizes=[1,2]",
               "search_config.train_settings.micro_batch_sizes=[1,2,4]")
    assert app.search_config.train_settings.tensor_parallel_sizes == [1, 2]
    assert app.search_config.train_settings.micro_batch_sizes == [1, 2, 4]


def test_unknown_key_fails_at_compose_with_its_name():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as exc:
        load("search_config.train_settings.tensor_paralel_sizes=[1]")
    assert "tensor_paralel_sizes" in str(exc.value)


def test_unknown_key_added_with_plus_fails_with_its_name_and_the_closest_key():
    with pytest.raises(ConfigError) as exc:
        load("+search_config.train_settings.tensr_parallel_sizes=[1]")
    assert exc.value.key == "search_config.train_settings.tensr_parallel_sizes"
    assert "search_config.train_settings.tensor_parallel_sizes" in exc.value.fix


def test_wrong_type_fails_at_compose_with_its_name():
    with pytest.raises((ConfigCompositionException, ValidationError)) as exc:
        load("search_config.train_settings.num_nodes=many")
    assert "num_nodes" in str(exc.value)


@pytest.mark.parametrize("override, key", [
    ("search_config.train_settings.num_nodes=0", "search_config.train_settings.num_nodes"),
    ("search_config.train_settings.micro_batch_sizes=[0,2]", "search_config.train_settings.micro_batch_sizes"),
    ("search_config.train_settings.tensor_parallel_sizes=[]", "search_config.train_settings.tensor_parallel_sizes"),
    ("search_config.train_settings.seq_length=-5", "search_config.train_settings.seq_length"),
    ("search_config.train_settings.vocab_size=1", "search_config.train_settings.vocab_size"),
    ("search_config.train_settings.memory_margin=1.5", "search_config.train_settings.memory_margin"),
    ("search_config.inference_settings.end_id=99999999", "search_config.inference_settings.end_id"),
    ("search_config.inference_settings.max_batch_sizes=[]", "search_config.inference_settings.max_batch_sizes"),
    ("search_config.train_settings.gpus_per_node=0", "search_config.train_settings.gpus_per_node"),
    ("gpu.memory_gib=0", "gpu.memory_gib"),
    ("gpu.peak_tflops.bf16=-1", "gpu.peak_tflops.bf16"),
    ("gpu.memory_overhead_gib=90", "gpu.memory_overhead_gib"),
    ("gpu.price_per_gpu_hour=0", "gpu.price_per_gpu_hour"),
    ("cluster.type=slurm", "cluster.type"),
])
def test_bad_values_name_key_value_and_fix(override, key):
    with pytest.raises(ConfigError) as exc:
        load(override)
    assert exc.value.key == key
    assert str(exc.value).startswith(f"{key}=")
    assert "Fix:" in str(exc.value)


def test_slurm_cluster_requires_a_partition():
    with pytest.raises(ConfigError) as exc:
        load("cluster=bcm")
    assert exc.value.key == "cluster.slurm.partition"
    assert load("cluster=bcm", "cluster.slurm.partition=batch").cluster.slurm.partition == "batch"


@pytest.mark.parametrize("old, new", [("cluster.partition=batch", "cluster.slurm.partition"),
                                      ("cluster.setup=[module load cuda]", "cluster.slurm.setup"),
                                      ("cluster.address=http://head:8265", "cluster.ray.address")])
def test_a_backend_key_given_flat_names_its_section(old, new):
    """Each launcher backend's keys live in its own section of the cluster group; the flat key a command line
    from before still passes fails naming where it went, with the value to carry over."""
    from hp_tool.cli import _check_args

    with pytest.raises(ConfigError) as exc:
        _check_args(["search_config=gpt3/tiny", "cluster=bcm", "cluster.slurm.partition=batch", old])
    assert exc.value.key == old.split("=")[0]
    assert f"was moved to {new}" in str(exc.value) and f"Fix: use {new}=<value>" in str(exc.value)
    assert "gpu=" not in str(exc.value)  # not the hardware keys' fix
