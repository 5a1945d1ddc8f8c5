"""What `serve`'s app holds once the model is loaded, and its lifecycle (api/lifecycle.py):
ready once the model is loaded (and a prefill's bootstrap port listens), failed if it does not
load. The model loads on the engine thread after the app starts, so /health answers 503 while
it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from thermostat.api.defaults import DefaultsReport
from thermostat.api.lifecycle import Lifecycle
from thermostat.api.metrics import Metrics
from thermostat.api.tool_parsers import ToolParser, marker_tokens, parser_for
from thermostat.api.traffic import BUCKET_S
from thermostat.disagg.handoff import model_identity
from thermostat.engine.checkpoint import ModelLoadError
from thermostat.engine.llm_engine import LLMEngine
from thermostat.engine.loader import load_configured
from thermostat.server.async_engine import AsyncEngine
from thermostat.server.config import ServerConfig
from thermostat.server.disaggregation import DecodeRole, PrefillRole
from thermostat.server.logprobs import TokenText
from thermostat.server.prompts import PromptBuilder
from thermostat.server.serving import Serving

log = logging.getLogger("thermostat.server")


class ServerState(Lifecycle):
    """The app's lifecycle status and, once loaded, the engine and what serves requests."""

    def __init__(self, config: ServerConfig, model_dir: Path, defaults: DefaultsReport) -> None:
        super().__init__(log)
        self.config = config
        self.model_dir = model_dir
        self.defaults = defaults
        self.metrics = Metrics()
        self.metrics.set_queue_limit(config.max_queue)
        self.started = int(time.time())  # unix seconds; the model card's `created`
        # Set once loaded (routes that use serving, prompts and tokens are served only when
        # ready: see server.middleware):
        self.engine: AsyncEngine | None = None
        # the engine's KV cost (LLMEngine: per token of context, per sequence whatever its length)
        self.kv_bytes: dict[str, float | int | None] = dict.fromkeys(
            ("kv_bytes_per_token", "kv_fixed_bytes_per_sequence")
        )
        self.weights: dict[str, str | int | None] = dict.fromkeys(
            ("weight_format", "weight_bytes", "weight_source")
        )
        self.serving: Serving
        self.prompts: PromptBuilder
        self.tokens: TokenText
        self.max_model_len = 0
        self.model_config: dict[str, Any] = {}  # config.json, once loaded
        self.tool_parser: ToolParser  # the model family's tool-call format, once loaded
        self.role: PrefillRole | DecodeRole | None = None  # a disaggregated server's half
        self._load_task: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None  # the console's KV usage, unwatched too

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        findings = self.defaults.findings()
        self.report_defaults(self.defaults.render_table(), [text for _, text in findings])
        self.metrics.describe_defaults(self.defaults.to_dict(), [kind for kind, _ in findings])
        self._load_task = asyncio.create_task(self._load())
        try:
            yield
        finally:
            await self.shutdown()

    async def _load(self) -> None:
        cfg, model_dir, defaults = self.config.engine, self.model_dir, self.defaults.layers
        log.info("loading %s", model_dir)

        def build() -> LLMEngine:  # runs on the engine thread (see AsyncEngine)
            loaded = load_configured(replace(cfg, model=str(model_dir)))
            return LLMEngine(cfg, defaults, loaded)

        async_engine = AsyncEngine(build)
        try:
            engine = await async_engine.start()
        except ModelLoadError as exc:  # says what and why: one line
            self.fail("the model could not be loaded: %s; exiting", exc)
            return
        except Exception:
            self.fail("the model could not be loaded; exiting", traceback=True)
            return
        self.engine = async_engine
        self.prompts = PromptBuilder(engine.tokenizer, engine.max_model_len)
        self.tokens = TokenText(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self.weights = {
            "weight_format": engine.loaded.weight_format,
            "weight_bytes": engine.loaded.weight_bytes,
            "weight_source": engine.loaded.weight_source,
        }
        self.kv_bytes = {
            "kv_bytes_per_token": engine.kv_bytes_per_token,
            "kv_fixed_bytes_per_sequence": engine.kv_fixed_bytes_per_sequence,
        }
        self.model_config = engine.loaded.config_dict
        self.tool_parser = parser_for(
            self.model_config,
            self.config.tool_call_parser,
            marker_tokens(engine.tokenizer.added_tokens_decoder),
            engine.tokenizer.chat_template,  # tells DeepSeek's formats apart
        )
        try:
            self.role = await self._role(engine)
        except OSError as exc:  # the bootstrap port is taken
            self.fail("prefill: cannot listen on the bootstrap port: %s; exiting", exc)
            return
        self.serving = Serving(
            self.defaults.model,
            self.engine,
            self.defaults.layers,
            self.metrics,
            self.config.max_queue,
            self.config.retry_after_s,
            engine.max_model_len,
        )
        self._sampler = asyncio.create_task(self._sample_forever())
        self.mark_ready()

    async def _role(self, engine: LLMEngine) -> PrefillRole | DecodeRole | None:
        """The half this server serves, set up (a prefill listens on its bootstrap port)."""
        mode = self.config.disaggregation_mode
        if mode is None:
            return None
        loaded = engine.loaded
        model = model_identity(
            self.model_dir, loaded.arch.architecture, str(loaded.dtype), loaded.weight_format
        )
        kv_cache = engine.cache.spec.describe()
        timeout = self.config.disaggregation_timeout_s
        if mode == "prefill":
            role = PrefillRole(model, kv_cache, timeout, self.metrics)
            await role.start(self.config.host, self.config.bootstrap_port)
            return role
        name = f"decode@{self.config.host}:{self.config.port}"
        log.info("decode: claims KV from the prefill each request names (timeout %.0f s)", timeout)
        return DecodeRole(model, kv_cache, timeout, self.metrics, name)

    def console_facts(self) -> dict[str, Any]:
        cfg = self.config
        facts: dict[str, Any] = {
            "server": "thermostat serve",
            "model": self.defaults.model,
            "model path": str(self.model_dir),
            "architecture": ", ".join(self.model_config.get("architectures") or []) or None,
            "weights": self.weights["weight_format"],
            "KV cache dtype": cfg.engine.kv_cache_dtype,
            "context length": self.max_model_len or None,
            "max running requests": cfg.engine.max_num_seqs,
            "max queue": cfg.max_queue,
            "role": cfg.disaggregation_mode or "single server",
        }
        if isinstance(self.role, PrefillRole):
            facts["bootstrap port"] = self.role.server.port
            facts["handoffs parked"] = self.role.table.num_parked
        if isinstance(self.role, DecodeRole):
            last = self.role.last_handoff
            facts["last prefill"] = last["prefill"] if last else "none yet"
            facts["last handoff"] = last
        return facts

    def console_defaults(self) -> dict[str, Any]:
        return self.defaults.to_dict()

    def console_sample(self) -> None:
        self.metrics.sample(self.engine.stats if self.engine else None)

    async def _sample_forever(self) -> None:
        """Sample the engine's gauges once per traffic bucket, whether or not anyone looks."""
        while True:
            self.console_sample()
            await asyncio.sleep(BUCKET_S)

    def serving_line(self) -> str:
        role = self.config.disaggregation_mode
        return f"serving {f'{role} half of ' if role else ''}{self.defaults.model!r}"

    async def drain(self) -> None:
        if self.engine is not None and not await self.engine.drain(self.config.drain_timeout_s):
            log.warning("drain timed out with %d responses in flight", self.engine.num_in_flight)

    async def shutdown(self) -> None:
        self.begin_draining()
        if self._load_task is not None:
            await self._load_task  # a load in a thread cannot be interrupted
        if self._sampler is not None:
            self._sampler.cancel()
        if self.engine is not None:
            await self.drain()
            await self.engine.stop()
            self.engine = None
        if isinstance(self.role, PrefillRole):
            await self.role.close()
