"""Engine: the Python API — per-agent persistent KV caches in one block pool under an mlx-lm
model.

::

    eng = Engine()                                   # embedded SmolLM2-135M, 4-bit KV
    r = eng.chat("planner", [{"role": "user", "content": "..."}], max_tokens=64)
    r.text, r.tokens, r.stats.cache                  # "hot" | "warm" | "cold"
    for piece in eng.stream_chat("planner", messages): ...
    eng.generate("planner", "raw prompt text")      # no chat template
    eng.pool_stats()                                 # blocks in use, shared, cached, free
    eng.close()                                      # flushes every agent to disk

One agent's turns run one at a time (a lock per agent); different agents may be driven
from different threads. Every model step, and everything that touches the pool, runs on
the scheduler's thread (``engine/scheduler.py``); each finished turn is saved by a
background writer, off the request path. The pieces: ``pool/`` (blocks, arenas, sharing),
``engine/resume.py`` (where a turn starts), ``engine/residency.py`` (which agents stay in
memory), ``engine/runner.py`` (admission, forward passes, the end of a turn).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

from ..agent_id import validate_agent_id
from ..errors import AgentKVError, CacheFormatError, InvalidRequestError
from ..format.choice import choose_kv_quant
from ..format.quant import KVQuant
from ..kernels import gpu as gpu_kernels
from ..model.load import LoadedModel, load_model
from ..model.wide_layers import with_wide_layers
from ..paths import kv_dir
from ..pool import KVPool, PoolStats, default_pool_bytes
from ..progress import ProgressBar
from ..store.agent_store import AgentStore, DurableState
from ..store.writer import BackgroundWriter
from ..text.matcher import DEFAULT_MIN_REUSE
from ..text.tokens import TokenText
from ..tools import ToolFormat, tool_format
from ..tools.render import render_prompt
from .config import EngineConfig
from .constraints import Constraint, GrammarCompiler
from .drafts import DEFAULT_DRAFT_TOKENS
from .generation import SamplingParams
from .job import DONE, Job
from .messages import check_salt, check_text, validate_messages
from .residency import Residency
from .results import ChatResult
from .resume import Resumer
from .runner import TurnRunner
from .scheduler import Scheduler
from .state import AgentState
from .swapping import Swapper
from .warmup import kernels_problem, warm_up

log = logging.getLogger("agentkv.engine")

__all__ = ["AgentInfo", "ChatStream", "Engine", "EngineConfig"]


@dataclass(frozen=True)
class AgentInfo:
    agent_id: str
    tokens: int
    tier: str  # "hot" (in memory) or "warm" (on disk only)
    memory_bytes: int  # its blocks in the pool (a block shared with others counts in full)
    disk_bytes: int  # its own files (manifest, private segment), not shared block files
    last_used: float | None  # time.time() of the last turn in this process, if any
    shared_blocks: int = 0  # its blocks held by other agents too


class ChatStream:
    """Iterate to get text pieces as they are generated; ``result`` is set at the end."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: ChatResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._pieces

    def close(self) -> None:
        self._pieces.close()


class AgentLocks:
    """One lock per agent id, made on first use: an agent's turns run one at a time."""

    def __init__(self):
        self._registry = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def __call__(self, agent_id: str) -> threading.Lock:
        with self._registry:
            return self._locks.setdefault(agent_id, threading.Lock())


def adds_bos(tokenizer) -> bool:
    """Whether the model's text starts with its BOS token, as its tokenizer encodes text:
    the tokenizer says so (``add_bos_token``), or its post-processor puts BOS first (a
    ``tokenizer.json`` alone, as a GGUF's SentencePiece vocabulary is rebuilt; mlx-lm
    encodes prompts through it too)."""
    if getattr(tokenizer, "add_bos_token", False):
        return True
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    try:
        with_specials = tokenizer.encode("a")
        plain = tokenizer.encode("a", add_special_tokens=False)
    except Exception:  # noqa: BLE001  (a tokenizer that cannot say: no BOS, as before)
        return False
    return with_specials == [bos, *plain]


class Engine:
    """Serve chats for many agents, each with its own persistent quantized KV cache.

    The options are ``EngineConfig``'s fields, given as keywords (``Engine(kv_bits=8)``)
    or as one record (``Engine(config=EngineConfig(kv_bits=8))``); each is checked before
    the model loads.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        kv_bits: int = 4,
        *,
        config: EngineConfig | None = None,
        store_url: str | None = None,
        key_bits: int | None = None,
        value_bits: int | None = None,
        group_size: int | None = None,
        pool_bytes: int | None = None,
        min_reuse_tokens: int = DEFAULT_MIN_REUSE,
        prefill_chunk: int | None = None,
        max_batch: int = 8,
        max_queue: int = 64,
        schedule: str = "interleave",
        warmup: bool = True,
        kv_format: int = 2,
        kv_wide_layers: Sequence[int] | None = None,
        weights: str | None = None,
        kv_swap_budget: int | None = None,
        kv_swap_read_ahead: bool = False,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    ):
        options = EngineConfig(
            model=model,
            weights=weights,
            cache_dir=cache_dir,
            store_url=store_url,
            kv_bits=kv_bits,
            key_bits=key_bits,
            value_bits=value_bits,
            group_size=group_size,
            pool_bytes=pool_bytes,
            min_reuse_tokens=min_reuse_tokens,
            prefill_chunk=prefill_chunk,
            max_batch=max_batch,
            max_queue=max_queue,
            schedule=schedule,
            warmup=warmup,
            kv_format=kv_format,
            kv_wide_layers=kv_wide_layers,
            kv_swap_budget=kv_swap_budget,
            kv_swap_read_ahead=kv_swap_read_ahead,
            draft_tokens=draft_tokens,
        )
        self.config = _one_config(config, options)
        # Not a bound method: the runner holds it, and a method would tie the runner back to
        # the engine in a cycle that keeps a closed engine's model and pool alive until the
        # garbage collector runs.
        self._agent_lock = AgentLocks()
        self._tool_format: ToolFormat | None = None
        self._closed = False
        with ProgressBar(2, "starting the engine", unit="step") as bar:
            self.loaded: LoadedModel = load_model(self.config.model, weights=self.config.weights)
            bar.advance()
            self._build_parts()
            if self.config.warmup:
                self._start()
            bar.advance()
        self.scheduler = Scheduler(
            self.runner,
            max_batch=self.config.max_batch,
            max_queue=self.config.max_queue,
            policy=self.config.schedule,
        )

    def _build_parts(self) -> None:
        """The pool, the store and the turn machinery for the loaded model."""
        config, loaded = self.config, self.loaded
        self.quant = kv_format_for(config, loaded)
        self.pool = KVPool(
            loaded.spec, self.quant, pool_bytes=config.pool_bytes or default_pool_bytes()
        )
        if config.kv_swap_budget is not None:
            self._check_swappable()  # before the store and its writer thread exist
        self.context_limit = loaded.context_limit
        hf_tokenizer = loaded.tokenizer._tokenizer
        self.token_text = TokenText.for_tokenizer(hf_tokenizer)
        self.eos_ids = frozenset(loaded.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(hf_tokenizer, self.eos_ids)
        self.bos_id = hf_tokenizer.bos_token_id if adds_bos(hf_tokenizer) else None
        self.store = open_store(config.cache_dir, loaded, self.quant)
        self.writer = BackgroundWriter(self.store)
        self.residency = Residency(self.pool)
        resumer = Resumer(
            pool=self.pool,
            store=self.store,
            writer=self.writer,
            residency=self.residency,
            token_text=self.token_text,
            bos_id=self.bos_id,
            min_reuse=config.min_reuse_tokens,
            context_limit=self.context_limit,
        )
        self.swapper = None
        if config.kv_swap_budget is not None:
            self.swapper = Swapper(
                pool=self.pool,
                store=self.store,
                loaded=loaded,
                budget=config.kv_swap_budget,
                read_ahead=config.kv_swap_read_ahead,
            )
            self.swapper.projections()  # measured once per model and format (~15 s), then read
        self.runner = TurnRunner(
            loaded=loaded,
            resumer=resumer,
            eos_ids=self.eos_ids,
            prefill_chunk=config.prefill_chunk,
            agent_lock=self._agent_lock,
            swapper=self.swapper,
            draft_tokens=config.draft_tokens,
        )
        if self.swapper is not None:  # a turn over the budget: its blocks one by one
            self.swapper.prefill_chunk = self.runner.prefill_chunk
            resumer.swapper = self.swapper
        self.residency.save = self.runner.save
        self.fleet = None
        if config.store_url is not None:
            from .fleet import Fleet

            self.fleet = Fleet(config.store_url, self.store, self.writer, self.residency)
            resumer.fleet = self.fleet
            self.writer.on_saved = self.fleet.saved

    def _check_swappable(self) -> None:
        """KVSwap's needs (docs/kvswap.md), or a clear error at start."""
        quant = self.quant
        reasons = []
        if self.pool.window is not None:
            reasons.append("the model has sliding-window layers")
        if not quant.channel_keys or quant.channel_tokens != 64:
            reasons.append("the KV format is not format 2 with 64-token channel groups")
        if mx.default_device() != mx.cpu:
            reasons.append("it runs on the CPU only, so far")
        if reasons:
            raise InvalidRequestError("kv_swap_budget: " + "; ".join(reasons))

    # -- public API -------------------------------------------------------------

    @property
    def spec(self):
        return self.loaded.spec

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token(self.quant)

    def chat(self, agent_id: str, messages: list[dict], **options) -> ChatResult:
        """Run one chat turn: ``messages`` is the whole conversation so far."""
        return _drain(self.stream_chat(agent_id, messages, **options))

    def stream_chat(
        self,
        agent_id: str,
        messages: list[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop=None,
        logprobs: int | None = None,
        cache_salt: str | None = None,
        constraint: Constraint | None = None,
    ) -> ChatStream:
        """Like ``chat``, yielding text pieces as they are generated. ``constraint`` (an
        ``agentkv.Constraint``): the reply must match it (a JSON schema, a tool call...).
        ``logprobs`` (0-20): the result's ``logprobs`` lists each token's log-probability
        under the model, with that many of the likeliest tokens beside it."""
        params = SamplingParams.create(max_tokens, temperature, top_p, stop, logprobs)
        job = self._chat_job(
            agent_id, messages, params, stream=True, salt=cache_salt, constraint=constraint
        )
        return self._stream(job)

    def chat_many(self, turns, **options) -> list[ChatResult]:
        """Run several agents' turns as one batch: ``turns`` is ``[(agent_id, messages), ...]``.

        Each agent's cache is resumed and prefilled on its own, then all decode together
        in one batch; results come back in order. Same tokens as running each turn alone;
        turns of the same agent run one after another. ``options`` (``stream_chat``'s:
        sampling, ``cache_salt``, ``constraint``) apply to every turn, a constraint with its
        own grammar state in each (``submit_chat`` gives turns different ones).
        """
        return self._run_many(self._chat_job, turns, **options)

    def generate_many(self, turns, **options) -> list[ChatResult]:
        """``generate`` for several agents as one batch: ``turns`` is ``[(agent_id, prompt)]``;
        ``options`` as in ``chat_many``."""
        return self._run_many(self._raw_job, turns, **options)

    def _run_many(
        self,
        make_job,
        turns,
        *,
        cache_salt: str | None = None,
        constraint: Constraint | None = None,
        **sampling,
    ) -> list[ChatResult]:
        params = SamplingParams.create(**sampling)
        jobs = [
            make_job(agent_id, body, params, salt=cache_salt, constraint=constraint)
            for agent_id, body in turns
        ]
        self._check_open()
        for job in jobs:
            self._submit(job)
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
        logprobs: int | None = None,
        cache_salt: str | None = None,
        tools: list[dict] | None = None,
        reply_prefix: str = "",
        constraint: Constraint | None = None,
    ) -> Job:
        """Queue a chat turn and return at once (for servers and event loops).

        ``tools`` (OpenAI function tools) are rendered into the prompt through the chat
        template (see ``agentkv.tools``); ``reply_prefix`` is text the reply starts with,
        appended to the prompt (a forced tool call's opening): it is part of the reply
        the agent's history keeps, not of the generated text.

        ``listener(event, value)`` is called on the engine's thread with
        ``("start", resumed)`` when the agent's state is found (``resumed.tier``
        is hot/warm/cold), ``("piece", text)`` as text is generated and
        ``("end", None)`` at the end. The returned job has ``wait()`` (the
        ``ChatResult``, or raises the turn's error), ``result``/``error`` once
        ended, and ``cancel()``: a cancelled turn saves no reply. Raises
        ``EngineBusyError`` when ``max_queue`` turns are already waiting. With ``constraint``
        the reply must match it; a bad one raises ``InvalidRequestError`` here.
        """
        self._check_open()
        params = SamplingParams.create(max_tokens, temperature, top_p, stop, logprobs)
        job = self._chat_job(
            agent_id,
            messages,
            params,
            tools=tools,
            reply_prefix=reply_prefix,
            listener=listener,
            salt=cache_salt,
            constraint=constraint,
        )
        self._submit(job)
        return job

    def generate(self, agent_id: str, prompt: str, **options) -> ChatResult:
        """Continue raw text (no chat template): ``prompt`` is the agent's whole context."""
        return _drain(self.stream_generate(agent_id, prompt, **options))

    def stream_generate(
        self,
        agent_id: str,
        prompt: str,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop=None,
        logprobs: int | None = None,
        cache_salt: str | None = None,
        constraint: Constraint | None = None,
    ) -> ChatStream:
        """Like ``generate``, yielding text pieces as they are generated."""
        params = SamplingParams.create(max_tokens, temperature, top_p, stop, logprobs)
        job = self._raw_job(
            agent_id, prompt, params, stream=True, salt=cache_salt, constraint=constraint
        )
        return self._stream(job)

    def _chat_job(
        self,
        agent_id: str,
        messages: list[dict],
        params: SamplingParams,
        *,
        tools: list[dict] | None = None,
        reply_prefix: str = "",
        **job_options,
    ) -> Job:
        """A turn of ``messages`` through the chat template (checked, not yet queued)."""
        messages = validate_messages(messages)
        prompt = self.render_chat(messages, tools=tools) + check_text(reply_prefix, "prefix")
        return self._job(
            agent_id, prompt, params, messages, reply_prefix=reply_prefix, **job_options
        )

    def _raw_job(self, agent_id: str, prompt: str, params: SamplingParams, **job_options) -> Job:
        """A turn continuing raw text ``prompt`` (checked, not yet queued)."""
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty string")
        check_text(prompt, "prompt")
        return self._job(agent_id, prompt, params, None, **job_options)

    def _job(
        self,
        agent_id: str,
        prompt: str,
        params: SamplingParams,
        messages: list[dict] | None,
        *,
        stream: bool = False,
        listener=None,
        salt: str | None = None,
        constraint: Constraint | None = None,
        reply_prefix: str = "",
    ) -> Job:
        agent_id = validate_agent_id(agent_id)
        grammar = None
        if constraint is not None:
            grammar = self.grammars.start(constraint, prefix=reply_prefix)
        job = Job(
            agent_id,
            prompt.encode("utf-8"),
            params,
            messages,
            stream=stream,
            listener=listener,
            grammar=grammar,
        )
        job.salt = check_salt(salt)
        job.reply_prefix = reply_prefix
        return job

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None) -> str:
        """The prompt of ``messages`` (and ``tools``) through the model's chat template."""
        tokenizer = self.loaded.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use generate()")
        return render_prompt(tokenizer, self.tool_format, messages, tools)

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (its family, markers, whether its template
        renders tools itself)."""
        if self._tool_format is None:
            self._tool_format = tool_format(self.loaded.tokenizer)
        return self._tool_format

    def history(self, agent_id: str) -> list[dict] | None:
        """The chat messages of the agent's last chat turn (with the reply), if stored."""
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            state = self.residency.get(agent_id)
            if state is not None:
                return state.messages
            self.writer.flush(agent_id)
            try:
                manifest, _ = self.store.read_manifest(agent_id)
            except CacheFormatError:
                return None
            return manifest.messages if manifest else None

    def agents(self) -> list[AgentInfo]:
        ids = set(self.store.agent_ids()) | set(self.residency.ids())
        return [info for agent_id in sorted(ids) if (info := self.agent_info(agent_id))]

    def agent_info(self, agent_id: str) -> AgentInfo | None:
        validate_agent_id(agent_id)
        state = self.residency.get(agent_id)
        disk = self.store.disk_bytes(agent_id)
        if state is None and not disk:
            return None
        if state is None:
            return AgentInfo(
                agent_id,
                _stored_tokens(self.store, agent_id),
                "warm",
                0,
                disk,
                self.residency.last_used.get(agent_id),
            )
        records = self.pool.blocks.records
        blocks = list(state.table.blocks)
        return AgentInfo(
            agent_id,
            state.size,
            "hot",
            len(blocks) * self.pool.block_bytes,
            disk,
            self.residency.last_used.get(agent_id),
            sum(1 for b in blocks if records[b].refs > 1),
        )

    def pool_stats(self) -> PoolStats:
        """The block pool: capacity, blocks in use / shared / cached / free, reserved (a
        snapshot read beside the scheduler: counts may be a step apart)."""
        return self.pool.stats()

    def resident_bytes(self) -> int:
        """KV bytes in memory: every pool block holding data, each counted once (however
        many agents share it), not the reserved budget."""
        return self.pool.resident_bytes()

    def disk_bytes(self) -> int:
        """KV bytes stored on disk for this model: agents' files and shared block files."""
        own = sum(self.store.disk_bytes(agent_id) for agent_id in self.store.agent_ids())
        return own + self.store.shared.disk_bytes()

    def evict(self, agent_id: str) -> bool:
        """Drop an agent from memory (its state stays on disk); True if it was hot."""
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            dropped = self.scheduler.call(lambda: self.residency.drop(agent_id))
            self.writer.flush(agent_id)
            return dropped

    def drop_cached_blocks(self) -> int:
        """Forget the pool's cached blocks (held by no agent, kept findable by hash): the
        next turn that needs them reads them from disk. Returns how many were dropped."""
        return self.scheduler.call(self.pool.blocks.drop_cached)

    def fork_agent(self, src: str, dst: str) -> None:
        """Start agent ``dst`` as a copy of ``src`` (to branch a conversation). In memory the
        copy shares every block of ``src`` (refcounts, no bytes copied until one of them
        writes its partial tail); on disk it names the same shared block files."""
        validate_agent_id(src)
        validate_agent_id(dst)
        if src == dst:
            raise InvalidRequestError("an agent cannot be forked onto itself")
        first, second = sorted((src, dst))  # one order for every caller: no deadlock
        with self._agent_lock(first), self._agent_lock(second):
            if dst in self.residency or self.store.manifest_path(dst).exists():
                raise InvalidRequestError(f"agent {dst!r} already exists")
            forked = self.scheduler.call(lambda: self._fork_hot(src, dst))
            if not forked:
                self.writer.flush(src)
                self.store.copy_agent(src, dst)
            self.writer.flush(dst)

    def _fork_hot(self, src: str, dst: str) -> bool:
        state = self.residency.get(src)
        if state is None:
            return False
        twin = AgentState(
            dst,
            state.quant,
            state.table.fork(),
            list(state.tokens),
            state.spans.copy(),
            state.text,
            messages=state.messages,
        )
        self.writer.set_durable(dst, DurableState())
        self.runner.save(twin)
        self.residency.put(twin)
        return True

    def delete_agent(self, agent_id: str) -> bool:
        """Forget an agent in memory and on disk; True if anything was deleted."""
        validate_agent_id(agent_id)
        with self._agent_lock(agent_id):
            self.writer.flush(agent_id)
            hot = self.scheduler.call(lambda: self._forget(agent_id))
            deleted = self.store.delete(agent_id)
            if self.fleet is not None:
                self.fleet.delete(agent_id)
            self.writer.set_durable(agent_id, DurableState())
            self.store.collect_blocks()
            return hot or deleted

    def _forget(self, agent_id: str) -> bool:
        state = self.residency.take(agent_id)
        if state is None:
            return False
        state.release()
        return True

    def flush(self) -> None:
        """Wait until every finished turn is on disk."""
        self.writer.flush()

    def wait_saved(self, agent_id: str, timeout: float | None = None) -> bool:
        """Wait until the agent's finished turns are on disk (False on timeout); with a
        ``store_url``, committed to the store too (or queued for it, where the store cannot
        be reached). ``AgentBusyError`` there: another engine committed the agent since this
        turn started; this turn is not in the store and the agent's next turn here starts
        from the store's state (docs/fleet.md)."""
        if not self.writer.flush(agent_id, timeout):
            return False
        if self.fleet is not None:
            self.fleet.commit(validate_agent_id(agent_id))
        return True

    def close(self) -> None:
        """Finish the turns in flight, flush every agent's state to disk, stop the threads."""
        if not self._closed:
            self._closed = True
            self.scheduler.stop()
            self.writer.close()
            if self.fleet is not None:
                self.fleet.close()
            # The residency saves through the runner, which holds the residency: without this
            # cycle a closed engine's model and pool go as soon as the last reference does.
            self.residency.save = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        """Hand a turn to the scheduler; with a fleet, its agent's look at the store starts
        now, off the scheduler's thread (Fleet.prefetch), and the turn waits for it."""
        if self.fleet is not None:
            job.store_check = self.fleet.prefetch(
                job.agent_id, self._agent_lock, self.scheduler.call
            )
            job.store_check.add_done_callback(lambda _: self.scheduler.wake())
        self.scheduler.submit(job)

    def _check_open(self) -> None:
        if self._closed:
            raise AgentKVError("the engine is closed")

    def _stream(self, job: Job) -> ChatStream:
        self._check_open()

        def pieces() -> Iterator[str]:
            self._submit(job)
            try:
                while (piece := job.pieces.get()) is not DONE:
                    yield piece
            finally:
                if not job.done.is_set():  # the consumer walked away: stop the turn
                    job.cancel()
                    job.done.wait()
            return job.wait()

        return ChatStream(pieces())

    def _start(self) -> None:
        """Warm up (``engine/warmup.py``). Where this GPU refuses one of agentkv's
        kernels or computes something else with it (Metal has not run them yet:
        docs/platforms.md), say so and run without them, slower: the parts are built again,
        since such a kernel leaves the pool's arrays unreadable or wrong (unless
        ``AGENTKV_GPU_KERNELS=1``, which makes it an error)."""
        try:
            key = (self.pool.bits, self.loaded.spec.fingerprint, self.quant.identity)
            problem = kernels_problem(self.runner, self.pool, self.token_text, key)
            if problem is not None:
                if gpu_kernels.kernels_required():
                    raise AgentKVError(gpu_kernels.way_around(problem))
                log.warning(
                    "agentkv: %s; running every GPU path on MLX's own operations instead, "
                    "slower. Please report this with `agentkv doctor`'s output; %s=0 skips "
                    "the attempt.",
                    problem, gpu_kernels.KERNELS_ENV,
                )  # fmt: skip
                gpu_kernels.refuse(problem)
                self._drop_parts()
                self._let_go()  # the old pool goes before the new one takes as much memory
                self._build_parts()
                warm_up(self.runner, self.pool, self.token_text)
        except BaseException as exc:
            self._drop_parts()
            self._let_go()  # not held by the traceback
            self.loaded = None
            if (words := gpu_kernels.refusal(exc)) is not None:  # MLX's own kernels too
                told = f"agentkv: this machine's GPU refused a kernel of MLX's own: {words}"
                raise AgentKVError(told) from exc
            raise

    def _let_go(self) -> None:
        """Drop the parts' memory (the pool's arrays first), whoever still holds the engine."""
        self.pool = self.runner = self.residency = self.swapper = self.store = None
        gc.collect()
        mx.clear_cache()

    def _drop_parts(self) -> None:
        """Stop what ``_build_parts`` started (the writer's and the fleet's threads)."""
        self.writer.close()
        if self.fleet is not None:
            self.fleet.close()
        if self.residency is not None:  # None while the parts are built again
            self.residency.save = None


def _drain(stream: ChatStream) -> ChatResult:
    """Run a stream to its end; its result."""
    for _ in stream:
        pass
    return stream.result


def _stored_tokens(store: AgentStore, agent_id: str) -> int:
    try:
        manifest, _ = store.read_manifest(agent_id)
    except CacheFormatError:
        return 0
    return manifest.token_count if manifest else 0


def _one_config(config: EngineConfig | None, options: EngineConfig) -> EngineConfig:
    if config is None:
        return options
    if not isinstance(config, EngineConfig):
        raise InvalidRequestError(f"config must be an EngineConfig, not {type(config).__name__}")
    if options != EngineConfig():
        raise InvalidRequestError("give the Engine its options or a config, not both")
    return config


def kv_format_for(config: EngineConfig, loaded: LoadedModel) -> KVQuant:
    """The KV format the engine stores for ``loaded``'s model: the bits asked for, in KV
    format ``config.kv_format`` where the model's head dims allow it, with its wide layers
    (measured per model unless ``config.kv_wide_layers`` names them)."""
    spec = loaded.spec
    wanted = config.requested_quant()
    quant = choose_kv_quant(
        spec,
        key_bits=wanted.key_bits,
        value_bits=wanted.value_bits,
        group_size=config.group_size,
        kv_format=config.kv_format,
    )
    if config.kv_wide_layers is None:
        return with_wide_layers(quant, loaded.model, loaded.tokenizer, spec)
    if config.kv_wide_layers:
        quant = replace(quant, wide_layers=config.kv_wide_layers)
        spec.components(quant)  # every wide layer is one of the model's
    return quant


def open_store(cache_dir, loaded: LoadedModel, quant: KVQuant) -> AgentStore:
    """The model's store under ``cache_dir`` (None: ``$AGENTKV_HOME/kv``), laid out, its
    unused shared block files collected."""
    root = Path(cache_dir) if cache_dir else kv_dir()
    store = AgentStore(root, loaded.spec, loaded.name, quant)
    store.ensure_layout()
    store.collect_blocks()
    return store
