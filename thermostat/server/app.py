"""The FastAPI app for one model: `create_app(ServerConfig)`."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from thermostat.api.agents.response_store import ResponseStore
from thermostat.api.agents.routes import agent_router
from thermostat.api.body_limits import BodyLimitsMiddleware
from thermostat.api.console import install_console
from thermostat.api.defaults import DefaultsReport
from thermostat.api.errors import install_error_handlers
from thermostat.api.middleware import GateMiddleware
from thermostat.engine.checkpoint import ModelLoadError
from thermostat.engine.loader import (
    DEMO_MODEL_DIR,
    check_architecture,
    model_config_dict,
    resolve_model_path,
)
from thermostat.engine.packaged_models import PACKAGED
from thermostat.engine.speculative import no_next_n
from thermostat.server.agent_backend import ServeChat
from thermostat.server.config import ServerConfig
from thermostat.server.routes import router
from thermostat.server.state import ServerState
from thermostat.server.tokenizer_routes import router as tokenizer_router


def locate_model(model: str) -> Path:
    """The model directory (or .gguf file); raises ModelLoadError with a message a person can
    act on."""
    if model == "demo" and not (DEMO_MODEL_DIR / "config.json").is_file():
        raise ModelLoadError(
            f"bundled demo model not found (expected in {DEMO_MODEL_DIR}); serve a Hugging Face "
            f"model directory instead: thermostat serve --model DIR"
        )
    return resolve_model_path(model)


def create_app(config: ServerConfig) -> FastAPI:
    """Raises ModelLoadError (no model directory) or ValueError (sampling defaults that cannot
    apply to this model) before anything is loaded. The model loads when the app starts."""
    model_dir = locate_model(config.engine.model)
    named = config.engine.model == "demo" or config.engine.model in PACKAGED
    name = config.served_model_name or (config.engine.model if named else model_dir.name)
    model_config = model_config_dict(model_dir)
    check_architecture(model_dir, model_config)  # refused before the server listens
    if config.engine.speculative == "mtp" and not model_config.get("num_nextn_predict_layers"):
        raise ModelLoadError(no_next_n(model_dir))  # refused before anything loads
    defaults = DefaultsReport.for_model(
        model_dir, name, config.sampling_defaults, config.policy, model_config
    )
    state = ServerState(config, model_dir, defaults)
    app = FastAPI(title="Thermostat", lifespan=state.lifespan)
    app.state.thermostat = state
    install_error_handlers(app)

    app.include_router(router)
    app.include_router(tokenizer_router)
    app.include_router(agent_router(ServeChat(), ResponseStore(config.responses_store_size)))
    install_console(app, config)
    state.route_paths = {getattr(route, "path", "") for route in app.routes}
    app.add_middleware(BodyLimitsMiddleware, state=state)  # inside the gate: after auth
    app.add_middleware(GateMiddleware, state=state)
    return app
