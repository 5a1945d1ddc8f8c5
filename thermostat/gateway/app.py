"""The gateway's FastAPI app: `create_gateway_app(GatewayConfig)`. Serve's error handlers, API
key gate and body limits, in front of one upstream."""

from __future__ import annotations

from fastapi import FastAPI

from thermostat.api.agents.response_store import ResponseStore
from thermostat.api.agents.routes import agent_router
from thermostat.api.body_limits import BodyLimitsMiddleware
from thermostat.api.console import install_console
from thermostat.api.errors import install_error_handlers
from thermostat.api.middleware import GateMiddleware
from thermostat.gateway.agent_backend import GatewayChat
from thermostat.gateway.config import GatewayConfig
from thermostat.gateway.routes import router
from thermostat.gateway.state import GatewayState


def create_gateway_app(config: GatewayConfig) -> FastAPI:
    state = GatewayState(config)
    app = FastAPI(title="Thermostat gateway", lifespan=state.lifespan)
    app.state.thermostat = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(agent_router(GatewayChat(), ResponseStore(config.responses_store_size)))
    install_console(app, config)
    state.route_paths = {getattr(route, "path", "") for route in app.routes}
    app.add_middleware(BodyLimitsMiddleware, state=state)
    app.add_middleware(GateMiddleware, state=state)
    return app
