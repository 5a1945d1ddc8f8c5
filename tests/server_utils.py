"""Real Thermostat servers on loopback for tests: uvicorn in a background thread."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.waiting import HANG_GUARD_S, hang
from thermostat.api.lifecycle import DrainingServer
from thermostat.engine.config import EngineConfig
from thermostat.engine.llm_engine import LLMEngine
from thermostat.server import ServerConfig, create_app
from thermostat.server.state import ServerState

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
KV_GB = 4 * 2**-10  # 4 MiB of KV cache: 8192 tokens of a tiny test model (512 B/token)


@dataclass
class RunningServer:
    url: str
    server: DrainingServer
    thread: threading.Thread

    @property
    def state(self) -> ServerState:
        return self.server.lifecycle

    @property
    def engine(self) -> LLMEngine:
        assert self.state.engine is not None
        return self.state.engine.engine

    @property
    def model(self) -> str:
        return self.state.defaults.model

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs
        )

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60
        )


@contextlib.contextmanager
def running_server(model_dir: Path, **options: Any) -> Iterator[RunningServer]:
    """Serve `model_dir` on 127.0.0.1 (a free port) until the block ends. `options` are
    ServerConfig or EngineConfig fields."""
    engine_options = {k: options.pop(k) for k in list(options) if k in ENGINE_FIELDS}
    engine_options.setdefault("kv_cache_memory_gb", KV_GB)
    engine = EngineConfig(model=str(model_dir), **engine_options)
    config = ServerConfig(engine=engine, port=0, **options)
    server = DrainingServer(create_app(config), config, log_level="warning")
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    url = None
    deadline = time.monotonic() + HANG_GUARD_S
    while thread.is_alive() and server.lifecycle.status != "failed" and time.monotonic() < deadline:
        address = server.lifecycle.address
        ready = address is not None and server.lifecycle.status == "ready"
        if ready and httpx.get(f"{address}/health", timeout=HANG_GUARD_S).status_code == 200:
            url = address
            break
        time.sleep(0.05)
    timed_out = url is None and time.monotonic() >= deadline
    try:
        assert not timed_out, hang("the test server becoming ready")
        assert url is not None, f"the test server did not become ready: {server.lifecycle.status}"
        yield RunningServer(url, server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout=HANG_GUARD_S)
        assert not thread.is_alive(), hang("the test server stopping")
