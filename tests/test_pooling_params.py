"""PoolingParams and PoolerConfig refuse what they cannot do, naming the field."""

from __future__ import annotations

import pytest

from pagedserve.config import ModelConfig, PoolerConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.errors import InvalidRequestError
from pagedserve.pooling_params import PoolingParams


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"task": "generate"}, "task"),
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": True}, "dimensions"),
    ({"normalize": 1}, "normalize"),
    ({"pooling_type": "max"}, "pooling_type"),
    ({"task": "classify", "dimensions": 8}, "dimensions"),
])
def test_bad_params_name_their_field(kwargs, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        PoolingParams(**kwargs).validate()
    assert e.value.param == param


def test_only_mean_and_cls_embeddings_need_every_prompt_state() -> None:
    assert not PoolingParams(pooling_type="LAST").needs_every_state
    assert PoolingParams(pooling_type="MEAN").needs_every_state
    assert PoolingParams(pooling_type="CLS").needs_every_state
    assert not PoolingParams(task="classify", pooling_type="MEAN").needs_every_state


def test_pooler_config_from_the_command_line() -> None:
    config = EngineArgs(runner="pooling", pooler_config='{"pooling_type": "mean", "normalize": false}'
                        ).create_engine_config(load_hf_config=False)
    assert config.model_config.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=False)
    assert EngineArgs(runner="pooling").create_engine_config(load_hf_config=False).model_config.pooler_config \
        == PoolerConfig()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pooler_config": "{}"}, "set runner='pooling'"),
    ({"runner": "pooling", "pooler_config": '{"pooling": "MEAN"}'}, "unknown field"),
    ({"runner": "pooling", "pooler_config": '{"pooling_type": "MAX"}'}, "pooling_type must be one of"),
    ({"runner": "pooling", "pooler_config": '{"classifier_from_token": ["yes"]}'}, "two token strings"),
    ({"runner": "pooling", "pooler_config": "MEAN"}, "must be a JSON object"),
    ({"runner": "pooling", "speculative_config": {"method": "ngram"}}, "speculative_config"),
    ({"runner": "pooling", "async_scheduling": True}, "async_scheduling"),
    ({"runner": "embed"}, "runner must be one of"),
])
def test_bad_pooler_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs).create_engine_config(load_hf_config=False)


def test_model_config_fills_the_default_pooler() -> None:
    assert ModelConfig(runner="pooling").pooler_config == PoolerConfig()
    assert ModelConfig().pooler_config is None
