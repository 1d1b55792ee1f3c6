"""Every config under configs/callbacks and configs/recipe composes and instantiates, and the example's
configs/train.yaml takes command-line overrides of the callback (``fuse.*``) and its recipe (``fuse.recipe.*``).

The configs are composed with Hydra's compose API, as the example's ``@hydra.main`` does, and built with
``hydra.utils.instantiate``, as the example does with ``cfg.fuse``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from lightning_fuse import CurrentScaling, DelayedScaling, FuseConfig, FusedBackwardCallback
from lightning_fuse.kernels import ACTIVATIONS
from lightning_fuse.recipe import make_recipe

pytest.importorskip("hydra")
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import ConfigCompositionException, InstantiationException  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CALLBACK_CONFIGS = sorted(path.stem for path in (CONFIG_DIR / "callbacks").glob("*.yaml"))
RECIPE_CONFIGS = sorted(path.stem for path in (CONFIG_DIR / "recipe").glob("*.yaml"))
EXPERIMENTS = sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))


def compose_config(name: str, overrides: tuple[str, ...] = ()) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_there_are_configs_to_test():
    assert "fused_backward" in CALLBACK_CONFIGS
    assert {"delayed", "current"} <= set(RECIPE_CONFIGS)


# -- each config file on its own ------------------------------------------------------------------


@pytest.mark.parametrize("name", CALLBACK_CONFIGS)
def test_callback_config_instantiates(name):
    cfg = compose_config(f"callbacks/{name}").callbacks
    callback = instantiate(cfg)
    assert isinstance(callback, FusedBackwardCallback)
    # Every field reached the callback.
    fields = OmegaConf.to_container(cfg)
    fields.pop("_target_")
    assert callback.recipe == (make_recipe(fields["recipe"]) if fields.get("recipe") is not None else None)
    assert (callback.benchmark, callback.log_every_n_steps, callback.benchmark_tokens, callback.fp8_eval) == \
        (fields["benchmark"], fields["log_every_n_steps"], fields["benchmark_tokens"], fields["fp8_eval"])
    assert callback.fuse_config == FuseConfig(convert=fields["convert"], activations=tuple(fields["activations"]),
                                              exclude=tuple(fields["exclude"]), emulate=fields["emulate"])


def test_fused_backward_config_spells_out_the_defaults():
    # The YAML documents every flag with its default value: it must not drift from the code's.
    configured, default = instantiate(compose_config("callbacks/fused_backward").callbacks), FusedBackwardCallback()
    assert configured.recipe == default.recipe == DelayedScaling()
    assert configured.fuse_config == default.fuse_config == FuseConfig()
    assert configured.fuse_config.activations == ACTIVATIONS
    for attr in ("benchmark", "log_every_n_steps", "benchmark_tokens", "fp8_eval", "module_filter_fn"):
        assert getattr(configured, attr) == getattr(default, attr), attr


@pytest.mark.parametrize("override", [
    "callbacks.module_filter_fn=boring_models.keep_except",
    "callbacks.module_filter_fn={_target_:boring_models.keep_except,_partial_:true,names:[mlp.0]}",
], ids=["path", "partial-node"])
def test_module_filter_fn_comes_from_the_config(override):
    # The callback's config is not instantiated recursively (_recursive_: false): the filter arrives as a
    # string or a DictConfig, which the callback resolves to the function itself.
    callback = instantiate(compose_config("callbacks/fused_backward", (override,)).callbacks)
    expected_rejected = "mlp.0" if "names" in override else "mlp.2"
    assert callback.module_filter_fn(None, expected_rejected) is False
    assert callback.module_filter_fn(None, "mlp.1") is True
    clone = pickle.loads(pickle.dumps(callback))  # ddp_spawn pickles the callbacks
    assert clone.module_filter_fn(None, expected_rejected) is False


@pytest.mark.parametrize("name", RECIPE_CONFIGS)
def test_recipe_config_instantiates(name):
    cfg = compose_config(f"recipe/{name}").recipe
    recipe = instantiate(cfg)
    expected = {"delayed": DelayedScaling, "current": CurrentScaling}[name]
    assert type(recipe) is expected
    fields = OmegaConf.to_container(cfg)
    fields.pop("_target_")
    assert recipe == expected(**fields)
    assert recipe == expected()  # the files spell out the defaults
    # The un-instantiated node works too: the callback accepts a recipe mapping with its _target_.
    assert make_recipe(cfg) == recipe
    assert FusedBackwardCallback(recipe=cfg).recipe == recipe


# -- the example's train.yaml and its command-line overrides ---------------------------------------


def fuse_callback(*overrides: str) -> FusedBackwardCallback:
    cfg = compose_config("train", overrides)
    callback = instantiate(cfg.fuse)
    assert isinstance(callback, FusedBackwardCallback)
    return callback


def test_train_config_has_the_callback_on_with_delayed_scaling():
    callback = fuse_callback()
    assert callback.recipe == DelayedScaling()
    assert callback.benchmark == "auto"
    assert callback.fuse_config == FuseConfig()


@pytest.mark.parametrize("overrides, recipe", [
    (["fuse.recipe.amax_history_len=16"], DelayedScaling(amax_history_len=16)),
    (["fuse.recipe.amax_compute_algo=most_recent", "fuse.recipe.margin=2", "fuse.recipe.fp8_format=e4m3",
      "fuse.recipe.reduce_amax=false"],
     DelayedScaling(amax_compute_algo="most_recent", margin=2, fp8_format="e4m3", reduce_amax=False)),
    (["recipe@fuse.recipe=current"], CurrentScaling()),
    (["recipe@fuse.recipe=current", "fuse.recipe.margin=1"], CurrentScaling(margin=1)),
    (["fuse.recipe=null"], None),  # the fused high-precision backward, no FP8 GEMMs
], ids=["history", "delayed-fields", "current", "current-margin", "no-fp8"])
def test_train_config_recipe_overrides(overrides, recipe):
    assert fuse_callback(*overrides).recipe == recipe


def test_train_config_callback_overrides():
    callback = fuse_callback("fuse.convert=all", "fuse.benchmark=log", "fuse.log_every_n_steps=10",
                             "fuse.benchmark_tokens=4096", "fuse.fp8_eval=false", "fuse.exclude=[lm_head,'*.attn.*']",
                             "fuse.activations=[gelu,relu]", "fuse.emulate=true")
    assert (callback.benchmark, callback.log_every_n_steps, callback.benchmark_tokens, callback.fp8_eval) == \
        ("log", 10, 4096, False)
    assert callback.fuse_config == FuseConfig(convert="all", exclude=("lm_head", "*.attn.*"),
                                              activations=("gelu", "relu"), emulate=True)


@pytest.mark.parametrize("override", ["fuse=null", "~fuse"])
def test_train_config_without_the_callback(override):
    assert compose_config("train", (override,)).get("fuse") is None


@pytest.mark.parametrize("override, match", [
    ("fuse.benchmark=fast", r"`benchmark` must be one of off, log, auto; got 'fast'"),
    ("fuse.log_every_n_steps=0", r"`log_every_n_steps` must be a positive int; got 0"),
    ("fuse.convert=everything", r"`convert` must be one of chains, mlp, all; got 'everything'"),
    ("fuse.recipe.amax_history_len=0", r"`amax_history_len` must be a positive int; got 0"),
    ("fuse.recipe.amax_compute_algo=mean", r"`amax_compute_algo` must be one of max, most_recent; got 'mean'"),
    ("+fuse.bechmark=log", r"unknown argument\(s\) \['bechmark'\]; valid arguments: .*benchmark"),
])
def test_train_config_bad_values_fail_at_instantiation_naming_the_problem(override, match):
    cfg = compose_config("train", (override,))
    with pytest.raises(InstantiationException, match=match):
        instantiate(cfg.fuse)


def test_train_config_misspelt_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="fuse.bechmark"):
        compose_config("train", ("fuse.bechmark=log",))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_keeps_a_working_callback(experiment):
    callback = fuse_callback(f"experiment={experiment}", "fuse.recipe.amax_history_len=16")
    assert callback.recipe == DelayedScaling(amax_history_len=16)
