"""``FuseConfig``: an OmegaConf structured config whose bad keys and values fail with the valid ones."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from lightning_fuse import FuseConfig, FusedBackwardCallback, make_fuse_config
from lightning_fuse.kernels import ACTIVATIONS


def test_defaults():
    config = FuseConfig()
    assert (config.convert, config.activations, config.exclude, config.emulate) == ("mlp", ACTIVATIONS, (), False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.convert = "all"
    hash(config)  # frozen and hashable: lists are stored as tuples


@pytest.mark.parametrize("source", [
    {"convert": "all", "activations": ["gelu", "relu"], "exclude": ["lm_head"], "emulate": True},
    OmegaConf.create({"convert": "all", "activations": ["gelu", "relu"], "exclude": ["lm_head"], "emulate": True}),
    OmegaConf.create({"_target_": "lightning_fuse.FuseConfig", "convert": "all", "activations": ["gelu", "relu"],
                      "exclude": ["lm_head"], "emulate": "true"}),  # Hydra YAML: strings coerced by the schema
], ids=["dict", "dictconfig", "hydra"])
def test_from_mappings(source):
    expected = FuseConfig(convert="all", activations=("gelu", "relu"), exclude=("lm_head",), emulate=True)
    assert make_fuse_config(source) == expected


def test_create_and_passthrough():
    config = FuseConfig.create(convert="chains")
    assert config == FuseConfig(convert="chains")
    assert make_fuse_config(config) is config
    assert make_fuse_config(None) == FuseConfig()
    assert OmegaConf.to_object(OmegaConf.structured(FuseConfig)) == FuseConfig()


def test_hydra_instantiate():
    hydra_utils = pytest.importorskip("hydra.utils")
    config = hydra_utils.instantiate({"_target_": "lightning_fuse.FuseConfig", "activations": ["gelu"],
                                      "exclude": ["lm_head"]})
    assert config == FuseConfig(activations=("gelu",), exclude=("lm_head",))


def test_misspelt_key_names_it_and_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        FuseConfig.create(convrt="all")
    message = str(err.value)
    assert "'convrt'" in message and "did you mean 'convert'" in message
    assert "valid keys: convert, activations, exclude, emulate" in message
    with pytest.raises(ValueError, match="'emulat'"):
        make_fuse_config(OmegaConf.create({"emulat": True}))
    with pytest.raises(TypeError, match="'convrt' \\(did you mean 'convert'\\?\\); valid keys: convert, activations"):
        FuseConfig(convrt="all")


@pytest.mark.parametrize("kwargs, match", [
    ({"convert": "everything"}, "`convert` must be one of chains, mlp, all; got 'everything'"),
    ({"activations": ["gelu", "swish"]}, "unknown activation 'swish'; accepted: gelu, gelu_tanh, relu, silu"),
])
def test_bad_values_name_the_accepted_ones(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FuseConfig.create(**kwargs)
    with pytest.raises(ValueError, match=match):
        FuseConfig(**kwargs)


def test_bad_types():
    with pytest.raises(TypeError, match="`activations` must be a list of strings"):
        FuseConfig(activations="gelu")
    with pytest.raises(TypeError, match="`activations` must be a list of strings"):
        FuseConfig.create(activations="gelu")
    with pytest.raises(TypeError, match="`emulate` must be a bool"):
        FuseConfig(emulate="yes")
    with pytest.raises(ValueError, match="`emulate`"):
        FuseConfig.create(emulate="maybe")
    with pytest.raises(TypeError, match="FuseConfig, a mapping"):
        make_fuse_config(["convert", "all"])
    with pytest.raises(ValueError, match="_target_"):
        make_fuse_config({"_target_": "lightning_fuse.FusedBackwardCallback"})


@pytest.mark.parametrize("value, error", [(2, TypeError), (1.0, TypeError), ("yes", ValueError), ("1", ValueError),
                                          ("on", ValueError)])
def test_emulate_given_through_a_mapping_must_be_a_bool(value, error):
    # (the strings 'true' and 'false' a config file or an interpolation gives are read as the bools)
    with pytest.raises(error, match=r"`emulate` must be a bool.*; got"):
        make_fuse_config({"emulate": value})
    with pytest.raises(error, match=r"`emulate` must be a bool.*; got"):
        FusedBackwardCallback(emulate=value)
