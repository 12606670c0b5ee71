"""Engine: the Python API — per-agent persistent KV caches under an mlx-lm model.

::

    eng = Engine()                                   # embedded SmolLM2-135M, 4-bit KV
    r = eng.chat("planner", [{"role": "user", "content": "..."}], max_tokens=64)
    r.text, r.tokens, r.stats.cache                  # "hot" | "warm" | "cold"
    for piece in eng.stream_chat("planner", messages): ...
    eng.generate("planner", "raw prompt text")      # no chat template
    eng.close()                                      # flushes every agent to disk

One agent's turns run one at a time (a lock per agent); different agents may
be driven from different threads (model steps are serialized internally).
Each finished turn is saved by a background writer, off the request path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..agent_id import validate_agent_id
from ..errors import AgentKVError, CacheFormatError, InvalidRequestError
from ..kv.cache import window_start
from ..kv.quant import KVQuant
from ..model.load import LoadedModel, load_model
from ..paths import kv_dir
from ..store.agent_store import AgentStore, DurableState, build_save_job
from ..store.format import BLOCK_TOKENS
from ..store.writer import BackgroundWriter
from ..text.matcher import DEFAULT_MIN_REUSE, MatchKind, match_prefix
from ..text.tokens import TokenText
from .generation import SamplingParams, prefill_chunk
from .job import DONE, Job, Resumed
from .results import ChatResult
from .scheduler import POLICIES, Scheduler
from .state import AgentState

log = logging.getLogger("agentkv.engine")

DEFAULT_HOT_BUDGET = 1 << 30
# A full rewrite after this many incremental saves keeps an agent's segment count bounded.
MAX_INCREMENTAL_SAVES = 32
PACK_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class AgentInfo:
    agent_id: str
    tokens: int
    tier: str  # "hot" (in memory) or "warm" (on disk only)
    memory_bytes: int
    disk_bytes: int
    last_used: float | None  # time.time() of the last turn in this process, if any


class ChatStream:
    """Iterate to get text pieces as they are generated; ``result`` is set at the end."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: ChatResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._pieces

    def close(self) -> None:
        self._pieces.close()


class Engine:
    """Serve chats for many agents, each with its own persistent quantized KV cache."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        kv_bits: int = 4,
        *,
        key_bits: int | None = None,
        value_bits: int | None = None,
        group_size: int = 64,
        min_reuse_tokens: int = DEFAULT_MIN_REUSE,
        hot_budget_bytes: int = DEFAULT_HOT_BUDGET,
        prefill_chunk: int = 512,
        max_batch: int = 8,
        max_queue: int = 64,
        schedule: str = "interleave",
        warmup: bool = True,
    ):
        self.quant = KVQuant.from_bits(
            kv_bits, key_bits=key_bits, value_bits=value_bits, group_size=group_size
        )
        if min_reuse_tokens < 0 or prefill_chunk < 64:
            raise InvalidRequestError("min_reuse_tokens must be >= 0 and prefill_chunk >= 64")
        if max_batch < 1 or max_queue < 1:
            raise InvalidRequestError("max_batch and max_queue must be >= 1")
        if schedule not in POLICIES:
            raise InvalidRequestError(f"schedule must be one of {', '.join(POLICIES)}")
        self.loaded: LoadedModel = load_model(model)
        spec = self.loaded.spec
        self.quant.check_head_dims(spec.key_head_dim, spec.value_head_dim)
        self.min_reuse = min_reuse_tokens
        self.hot_budget = hot_budget_bytes
        self.prefill_chunk = prefill_chunk
        self.query_heads = _query_heads(self.loaded.model, spec.kv_heads)
        self.context_limit = _context_limit(self.loaded.model)
        self.bytes_per_token = spec.bytes_per_token(self.quant)
        hf_tokenizer = self.loaded.tokenizer._tokenizer
        self.token_text = TokenText.for_tokenizer(hf_tokenizer)
        self.eos_ids = frozenset(self.loaded.tokenizer.eos_token_ids)
        self.bos_id = (
            hf_tokenizer.bos_token_id if getattr(hf_tokenizer, "add_bos_token", False) else None
        )
        self.store = AgentStore(Path(cache_dir) if cache_dir else kv_dir(), spec, self.loaded.name)
        self.store.ensure_layout()
        self.writer = BackgroundWriter(self.store)
        self._registry = threading.Lock()
        self._agent_locks: dict[str, threading.Lock] = {}
        self._hot: OrderedDict[str, AgentState] = OrderedDict()
        self._saves: dict[str, int] = {}
        self._last_used: dict[str, float] = {}
        self._closed = False
        if warmup:
            self._warmup()
        self.scheduler = Scheduler(
            self,
            max_batch=max_batch,
            max_queue=max_queue,
            kv_budget=hot_budget_bytes,
            policy=schedule,
        )

    # -- public API -------------------------------------------------------------

    @property
    def spec(self):
        return self.loaded.spec

    def chat(self, agent_id: str, messages: list[dict], **options) -> ChatResult:
        """Run one chat turn: ``messages`` is the whole conversation so far."""
        stream = self.stream_chat(agent_id, messages, **options)
        for _ in stream:
            pass
        return stream.result

    def stream_chat(
        self,
        agent_id: str,
        messages: list[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop=None,
    ) -> ChatStream:
        """Like ``chat``, yielding text pieces as they are generated."""
        messages = validate_messages(messages)
        prompt = self.render_chat(messages)
        params = SamplingParams.create(max_tokens, temperature, top_p, stop)
        return self._stream(validate_agent_id(agent_id), prompt, params, messages)

    def chat_many(self, turns, **options) -> list[ChatResult]:
        """Run several agents' turns as one batch: ``turns`` is ``[(agent_id, messages), ...]``.

        Each agent's cache is resumed and prefilled on its own, then all decode
        together in one batch; results come back in order. Same tokens as
        running each turn alone; turns of the same agent run one after another.
        """
        params = SamplingParams.create(**options)
        jobs = []
        for agent_id, messages in turns:
            messages = validate_messages(messages)
            prompt = self.render_chat(messages)
            jobs.append(self._job(validate_agent_id(agent_id), prompt, params, messages))
        return self._run_all(jobs)

    def generate_many(self, turns, **options) -> list[ChatResult]:
        """``generate`` for several agents as one batch: ``turns`` is ``[(agent_id, prompt)]``."""
        params = SamplingParams.create(**options)
        jobs = []
        for agent_id, prompt in turns:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("every prompt must be a non-empty string")
            check_text(prompt, "prompt")
            jobs.append(self._job(validate_agent_id(agent_id), prompt, params, None))
        return self._run_all(jobs)

    def _run_all(self, jobs: list[Job]) -> list[ChatResult]:
        self._check_open()
        for job in jobs:
            self.scheduler.submit(job)
        return [job.wait() for job in jobs]

    def submit_chat(
        self,
        agent_id: str,
        messages: list[dict],
        *,
        listener=None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop=None,
    ) -> Job:
        """Queue a chat turn and return at once (for servers and event loops).

        ``listener(event, value)`` is called on the engine's thread with
        ``("start", resumed)`` when the agent's state is found (``resumed.tier``
        is hot/warm/cold), ``("piece", text)`` as text is generated and
        ``("end", None)`` at the end. The returned job has ``wait()`` (the
        ``ChatResult``, or raises the turn's error), ``result``/``error`` once
        ended, and ``cancel()``: a cancelled turn saves no reply. Raises
        ``EngineBusyError`` when ``max_queue`` turns are already waiting.
        """
        self._check_open()
        messages = validate_messages(messages)
        prompt = self.render_chat(messages)
        params = SamplingParams.create(max_tokens, temperature, top_p, stop)
        job = self._job(validate_agent_id(agent_id), prompt, params, messages, listener=listener)
        self.scheduler.submit(job)
        return job

    def _job(self, agent_id, prompt: str, params, messages, *, stream=False, listener=None) -> Job:
        job = Job(
            agent_id, prompt.encode("utf-8"), params, messages, stream=stream, listener=listener
        )
        # KV bytes reserved for admission: ~3 bytes of text per token, plus the reply.
        new = (
            params.max_tokens
            if self.context_limit is None
            else min(params.max_tokens, self.context_limit)
        )
        job.footprint = self.bytes_per_token * (len(job.prompt) // 3 + new)
        return job

    def generate(self, agent_id: str, prompt: str, **options) -> ChatResult:
        """Continue raw text (no chat template): ``prompt`` is the agent's whole context."""
        stream = self.stream_generate(agent_id, prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def stream_generate(
        self,
        agent_id: str,
        prompt: str,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop=None,
    ) -> ChatStream:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty string")
        check_text(prompt, "prompt")
        params = SamplingParams.create(max_tokens, temperature, top_p, stop)
        return self._stream(validate_agent_id(agent_id), prompt, params, None)

    def render_chat(self, messages: list[dict]) -> str:
        tokenizer = self.loaded.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use generate()")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def history(self, agent_id: str) -> list[dict] | None:
        """The chat messages of the agent's last chat turn (with the reply), if stored."""
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            state = self._hot.get(agent_id)
            if state is not None:
                return state.messages
            self.writer.flush(agent_id)
            try:
                manifest, _ = self.store.read_manifest(agent_id)
            except CacheFormatError:
                return None
            return manifest.messages if manifest else None

    def agents(self) -> list[AgentInfo]:
        ids = set(self.store.agent_ids()) | set(self._hot)
        return [self.agent_info(agent_id) for agent_id in sorted(ids)]

    def agent_info(self, agent_id: str) -> AgentInfo | None:
        validate_agent_id(agent_id)
        state = self._hot.get(agent_id)
        disk = self.store.disk_bytes(agent_id)
        if state is None and not disk:
            return None
        tokens = state.size if state is not None else _stored_tokens(self.store, agent_id)
        return AgentInfo(
            agent_id,
            tokens,
            "hot" if state is not None else "warm",
            state.nbytes if state is not None else 0,
            disk,
            self._last_used.get(agent_id),
        )

    def resident_bytes(self) -> int:
        """KV bytes of the agents held in memory."""
        return sum(state.nbytes for state in list(self._hot.values()))

    def disk_bytes(self) -> int:
        """KV bytes stored on disk for this model (every agent's files)."""
        return sum(self.store.disk_bytes(agent_id) for agent_id in self.store.agent_ids())

    def evict(self, agent_id: str) -> bool:
        """Drop an agent from memory (its state stays on disk); True if it was hot."""
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            self.writer.flush(agent_id)
            return self._hot.pop(agent_id, None) is not None

    def fork_agent(self, src: str, dst: str) -> None:
        """Start agent ``dst`` from a copy of ``src``'s saved state (to branch a conversation)."""
        validate_agent_id(src)
        validate_agent_id(dst)
        with self._agent_lock(src):
            self.writer.flush(src)
        with self._agent_lock(dst):
            if dst in self._hot:
                raise InvalidRequestError(f"agent {dst!r} already exists")
            self.store.copy_agent(src, dst)

    def delete_agent(self, agent_id: str) -> bool:
        """Forget an agent in memory and on disk; True if anything was deleted."""
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            self.writer.flush(agent_id)
            hot = self._hot.pop(agent_id, None) is not None
            deleted = self.store.delete(agent_id)
            self.writer.set_durable(agent_id, DurableState())
            return hot or deleted

    def flush(self) -> None:
        """Wait until every finished turn is on disk."""
        self.writer.flush()

    def wait_saved(self, agent_id: str, timeout: float | None = None) -> bool:
        """Wait until the agent's finished turns are on disk (False on timeout)."""
        return self.writer.flush(agent_id, timeout)

    def close(self) -> None:
        """Finish the turns in flight, flush every agent's state to disk, stop the threads."""
        if not self._closed:
            self._closed = True
            self.scheduler.stop()
            self.writer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- turns ------------------------------------------------------------------

    def _agent_lock(self, agent_id: str) -> threading.Lock:
        with self._registry:
            return self._agent_locks.setdefault(agent_id, threading.Lock())

    def _check_open(self) -> None:
        if self._closed:
            raise AgentKVError("the engine is closed")

    def _stream(self, agent_id: str, prompt: str, params: SamplingParams, messages) -> ChatStream:
        self._check_open()
        job = self._job(agent_id, prompt, params, messages, stream=True)

        def pieces() -> Iterator[str]:
            self.scheduler.submit(job)
            try:
                while (piece := job.pieces.get()) is not DONE:
                    yield piece
            finally:
                if not job.done.is_set():  # the consumer walked away: stop the turn
                    job.cancel()
                    job.done.wait()
            return job.wait()

        return ChatStream(pieces())

    def _resume(self, agent_id: str, prompt: bytes) -> Resumed:
        """Find the agent's state (memory, then disk), keep what matches, plan the prefill."""
        state = self._hot.pop(agent_id, None)
        if state is not None:
            m = match_prefix(
                state.text, state.token_ends, state.tokens, prompt, min_reuse=self.min_reuse
            )
            in_memory = all(window_start(m.reuse, c.window) >= c.start for c in state.caches)
            if m.kind is not MatchKind.DIVERGE and in_memory:
                refeed_span = state.spans[m.reuse] if m.refeed is not None else None
                stored = state.size
                state.trim(m.reuse)
                state.cap_windows()
                return self._plan(state, "hot", m, stored, refeed_span, prompt, 0.0)
            if m.kind is MatchKind.DIVERGE:
                fresh = AgentState.empty(agent_id, self.quant, self.spec.layers)
                return self._plan(fresh, "cold", m, state.size, None, prompt, 0.0)
        return self._resume_from_disk(agent_id, prompt)

    def _resume_from_disk(self, agent_id: str, prompt: bytes) -> Resumed:
        fresh = AgentState.empty(agent_id, self.quant, self.spec.layers)
        self.writer.flush(agent_id)
        t0 = time.perf_counter()
        try:
            manifest, durable = self.store.read_manifest(agent_id)
        except CacheFormatError as exc:
            return self._reject(agent_id, exc, fresh, prompt)
        if manifest is None:
            self.writer.set_durable(agent_id, DurableState())
            self._saves[agent_id] = 0
            others = self.store.other_fingerprints(agent_id)
            note = (
                (
                    f"no stored state for this model; the agent has one for another model "
                    f"({', '.join(others)}), which this model cannot use"
                )
                if others
                else None
            )
            return self._plan(fresh, "cold", None, 0, None, prompt, 0.0, note=note)
        self.writer.set_durable(agent_id, durable)
        self._saves[agent_id] = len(manifest.segments)
        m = match_prefix(
            manifest.text, manifest.spans[:, 1], manifest.tokens, prompt, min_reuse=self.min_reuse
        )
        if m.kind is MatchKind.DIVERGE or m.reuse == 0:
            load_ms = (time.perf_counter() - t0) * 1000
            return self._plan(fresh, "cold", m, manifest.token_count, None, prompt, load_ms)
        try:
            caches = self.store.load_caches(manifest, agent_id, m.reuse)
        except CacheFormatError as exc:
            return self._reject(agent_id, exc, fresh, prompt)
        end = int(manifest.spans[m.reuse - 1, 1])
        state = AgentState(
            agent_id,
            manifest.quant,
            caches,
            manifest.tokens[: m.reuse].tolist(),
            manifest.spans[: m.reuse].astype(np.int64),
            manifest.text[:end],
            durable=m.reuse,
            messages=manifest.messages,
        )
        refeed_span = manifest.spans[m.reuse] if m.refeed is not None else None
        load_ms = (time.perf_counter() - t0) * 1000
        return self._plan(state, "warm", m, manifest.token_count, refeed_span, prompt, load_ms)

    def _reject(
        self, agent_id: str, exc: CacheFormatError, fresh: AgentState, prompt: bytes
    ) -> Resumed:
        moved = self.store.quarantine(agent_id, str(exc))
        self.writer.set_durable(agent_id, DurableState())
        self._saves[agent_id] = 0
        note = f"stored state rejected ({exc.reason}); kept at {moved}"
        return self._plan(fresh, "cold", None, 0, None, prompt, 0.0, note=note)

    def _plan(
        self,
        state: AgentState,
        tier: str,
        m,
        stored: int,
        refeed_span,
        prompt: bytes,
        load_ms: float,
        note: str | None = None,
    ) -> Resumed:
        reusing = tier != "cold" and m is not None
        resume = m.resume_at if reusing else 0
        encoded = self.token_text.encode(prompt[resume:].decode("utf-8"))
        ids, spans = list(encoded.ids), encoded.spans + resume
        if reusing and m.refeed is not None:
            ids.insert(0, m.refeed)
            spans = np.concatenate([np.asarray(refeed_span, dtype=np.int64)[None], spans])
        elif state.size == 0 and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
            spans = np.concatenate([np.zeros((1, 2), dtype=np.int64), spans])
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        total = state.size + len(ids)
        if self.context_limit is not None and total >= self.context_limit:
            raise InvalidRequestError(
                f"the conversation is {total} tokens; this model's context is "
                f"{self.context_limit} tokens (including the reply)"
            )
        if (
            note is None
            and m is not None
            and m.kind is not MatchKind.EXTEND
            and (reusing or stored)
        ):
            note = m.note
        match = m.kind.value if m is not None else "none"
        return Resumed(state, tier, match, stored, ids, spans, note, load_ms, state.size)

    def _commit(self, state: AgentState, failed: bool) -> None:
        agent_id = state.agent_id
        if failed:
            return  # the caches may hold a partial step; the next turn reloads from disk
        self._hot[agent_id] = state
        self._hot.move_to_end(agent_id)
        self._last_used[agent_id] = time.time()
        self._enqueue_save(state)
        self._evict_over_budget(keep=agent_id)

    def _enqueue_save(self, state: AgentState) -> None:
        """Queue the blocks that changed since the last save (the turn's, and its partial block)."""
        agent_id = state.agent_id
        if state.size == 0 or state.durable == state.size:
            return
        self.writer.take_failure(agent_id)  # already logged; what is durable says where to resume
        durable_blocks = self.writer.planned_blocks(agent_id) or 0
        first_block = min(state.durable // BLOCK_TOKENS, durable_blocks)
        held_from = max(c.start for c in state.caches) // BLOCK_TOKENS
        saves = self._saves.get(agent_id, 0)
        if saves >= MAX_INCREMENTAL_SAVES:
            first_block = min(first_block, held_from)  # compact: rewrite all that memory holds
        if first_block < held_from:
            log.warning(
                "agentkv: agent %r cannot be saved: its blocks before %d are neither "
                "on disk nor in memory",
                agent_id,
                held_from,
            )
            return
        job = build_save_job(
            self.spec,
            agent_id,
            state.caches,
            tokens=state.tokens,
            spans=state.spans,
            text=state.text,
            messages=state.messages,
            first_block=first_block,
            threads=PACK_THREADS,
        )
        self.writer.submit(job)
        self._saves[agent_id] = 1 if first_block == held_from else saves + 1
        state.durable = state.size

    def _evict_over_budget(self, keep: str) -> None:
        total = sum(s.nbytes for s in list(self._hot.values()))
        for agent_id in list(self._hot):
            if total <= self.hot_budget:
                return
            lock = self._agent_lock(agent_id)
            if agent_id == keep or not lock.acquire(blocking=False):
                continue
            try:
                state = self._hot.pop(agent_id, None)
                total -= state.nbytes if state else 0
            finally:
                lock.release()

    def _warmup(self) -> None:
        """Run the model once on a scratch cache so the first real turn pays no one-time costs."""
        scratch = AgentState.empty("warmup", self.quant, self.spec.layers)
        ids = self.token_text.encode("Warm up the kernels.").ids or [0]
        logits = prefill_chunk(self.loaded.model, scratch.caches, ids, last=True)
        for _ in range(2):
            token = mx.argmax(logits, axis=-1)
            logits = self.loaded.model(token[:, None], cache=scratch.caches)[:, -1, :]
            mx.eval(logits)


def validate_messages(messages) -> list[dict]:
    """Check chat messages; text content blocks are joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string")
        if isinstance(content, list):
            parts = []
            for j, block in enumerate(content):
                if (
                    not isinstance(block, dict)
                    or block.get("type") != "text"
                    or not isinstance(block.get("text"), str)
                ):
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be a text block")
                parts.append(block["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or text blocks")
        check_text(content, f"messages[{i}].content")
        out.append({"role": role, "content": content})
    return out


def check_text(text: str, what: str) -> str:
    """Text must be valid Unicode (no lone surrogates, which UTF-8 cannot encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode: {exc.reason}") from None
    return text


def _query_heads(model, kv_heads: int) -> int:
    layers = getattr(model, "layers", None) or []
    attn = getattr(layers[0], "self_attn", None) if layers else None
    return int(getattr(attn, "n_heads", kv_heads))


def _context_limit(model) -> int | None:
    """The model's context length (max_position_embeddings), if its config says."""
    args = getattr(model, "args", None)
    limit = getattr(args, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def _stored_tokens(store: AgentStore, agent_id: str) -> int:
    try:
        manifest, _ = store.read_manifest(agent_id)
    except CacheFormatError:
        return 0
    return manifest.token_count if manifest else 0
