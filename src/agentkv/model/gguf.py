"""Import a GGUF file into an mlx-lm model directory.

What a GGUF file lacks for mlx-lm is the directory around its weights: mlx-lm's tensor
names, a ``config.json`` and a Hugging Face tokenizer. This module writes all three from the
GGUF's own metadata, so the import works offline, and a ``generation_config.json`` where the
GGUF names its sampling (``general.sampling.temp`` and ``.top_p``).

The tensors are read by agentkv itself (``gguf_tensors``: MLX's reader knows Q4_0, Q4_1 and
Q8_0 only) and kept quantized as the file ships them, as MLX's affine triplets (agentkv's CPU
kernel or ``mx.quantized_matmul`` on a GPU runs them), or written dequantized to float32
for comparison. The architectures (llama, qwen2, qwen3, gemma2, gemma3, phi3) and their
configs are in ``gguf_arch``. What each tensor became is written beside the weights
(``agentkv_tensors.json``, shown by ``agentkv models import``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np

from ..errors import ModelImportError
from ..paths import FILE_MODE, atomic_write_text, secure_mkdir
from ..progress import ProgressBar
from .generation_config import GENERATION_CONFIG, gguf_generation_config
from .gguf_arch import ROPE_FREQS, Architecture, architecture_of, build_config
from .gguf_tensors import (
    GROUP,
    Converted,
    GGUFFile,
    ImportReport,
    check_tensor,
    convert_tensor,
    read_gguf,
)

log = logging.getLogger("agentkv.model")

#: Bumped whenever the import recipe changes what it writes; part of a model's identity.
IMPORT_RECIPE_VERSION = 1
IMPORT_INFO_FILE = "agentkv_import.json"
# What each tensor became (not part of the weights' identity: the import info is)
TENSORS_FILE = "agentkv_tensors.json"
# K-quant tensors' super-block factors ({module}.scales: d, {module}.biases: -dmin; float16
# [rows, K / 256]), from which the CPU kernel holds their scales in two levels (mlx_adapter)
SUPER_SCALES_FILE = "agentkv_super_scales.safetensors"
# The record's note of where the GGUF file was (size, mtime, inode): not part of what was
# imported, so no identity includes it.
SOURCE_STAT = "source_stat"
WeightDtype = Literal["float32", "quantized"]

# Pre-tokenizer regexes by GGUF ``tokenizer.ggml.pre`` name (the public patterns of
# the tokenizers these names stand for).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SPLIT_DIGITS = {"smollm", "starcoder", "refact"}
_PRE_PATTERNS = {
    "default": _GPT2_PATTERN,
    "gpt2": _GPT2_PATTERN,
    "smollm": _GPT2_PATTERN,
    "starcoder": _GPT2_PATTERN,
    "refact": _GPT2_PATTERN,
    "llama-bpe": _LLAMA3_PATTERN,
    "llama3": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@dataclass(frozen=True)
class ImportResult:
    """Where an import went and what identifies it."""

    path: Path
    source_sha256: str
    weight_dtype: WeightDtype
    reused: bool


def default_weight_dtype() -> WeightDtype:
    """What ``load_model`` runs by default on every device (``load.default_weights``):
    the weights as shipped."""
    return "quantized"


def _file_stat(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev}


def _record_stat(dest: Path, info: dict, stat: dict) -> None:
    """Rewrite an import's record with the file's new stat, so the next start need not hash
    it; where the directory is not writable the next start hashes it again."""
    try:
        atomic_write_text(
            dest / IMPORT_INFO_FILE, json.dumps({**info, SOURCE_STAT: stat}, indent=2)
        )
    except OSError as exc:
        log.debug("agentkv: could not update %s: %s", dest / IMPORT_INFO_FILE, exc)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def import_gguf(
    gguf_path: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    weight_dtype: WeightDtype | None = None,
    force: bool = False,
) -> ImportResult:
    """Write an mlx-lm model directory for ``gguf_path`` into ``dest``.

    An existing import of the same file with the same recipe and dtype is reused
    unless ``force``; a directory holding anything else is never overwritten. The file is
    known by its SHA-256; the import also records the file's size, mtime and inode, and
    while those are unchanged a start reuses it without reading the file again (hashing
    the embedded model's 98 MB took ~0.1-0.2 s of every start).
    """
    src = Path(gguf_path)
    if not src.is_file():
        raise ModelImportError(f"GGUF file not found: {src}")
    dtype = weight_dtype or default_weight_dtype()
    if dtype not in ("float32", "quantized"):
        raise ModelImportError(f"weight dtype must be 'float32' or 'quantized', not {dtype!r}")
    dest = Path(dest)
    existing = _read_import_info(dest)
    stat = _file_stat(src)
    recipe = {"source": src.name, "recipe_version": IMPORT_RECIPE_VERSION, "weight_dtype": dtype}
    if (
        not force
        and existing is not None
        and existing.get(SOURCE_STAT) == stat
        and isinstance(existing.get("source_sha256"), str)
        and all(existing.get(k) == v for k, v in recipe.items())
    ):
        return ImportResult(dest, existing["source_sha256"], dtype, reused=True)
    sha = file_sha256(src)
    info = {
        "source": src.name,
        "source_sha256": sha,
        "recipe_version": IMPORT_RECIPE_VERSION,
        "weight_dtype": dtype,
    }
    if existing is not None and not force and {k: existing.get(k) for k in info} == info:
        _record_stat(dest, info, stat)  # the same bytes under a new mtime or inode
        return ImportResult(dest, sha, dtype, reused=True)
    info[SOURCE_STAT] = stat
    if dest.exists() and any(dest.iterdir()) and existing is None:
        raise ModelImportError(
            f"{dest} exists and is not an agentkv import; choose another destination"
        )

    with ProgressBar(4, f"importing {src.name}", unit="step") as bar:
        return _import(src, dest, dtype, info, sha, bar)


def _import(src: Path, dest: Path, dtype: WeightDtype, info: dict, sha: str, bar) -> ImportResult:
    log.info("agentkv: importing %s into %s (%s weights)", src, dest, dtype)
    gguf_file = read_gguf(src)
    meta = gguf_file.metadata
    arch = architecture_of(meta, src.name)
    names = {t.name for t in gguf_file.tensors}
    for t in gguf_file.tensors:  # every refusal before anything is converted or written
        if arch.mlx_name(t.name) is not None:
            check_tensor(t, float32=dtype == "float32")
    freqs = next((t for t in gguf_file.tensors if t.name == ROPE_FREQS), None)
    config = build_config(
        meta,
        arch,
        tied="output.weight" not in names,
        rope_freqs=None if freqs is None else np.asarray(freqs.raw, np.float32),
    )
    tokenizer = _build_tokenizer(meta)
    bar.advance()

    secure_mkdir(dest)
    tensors, supers, quant_config, report = _convert_weights(gguf_file, arch, dtype)
    if quant_config:
        config["quantization"] = quant_config
    bar.advance()

    # The temporary name must not match mlx-lm's "model*.safetensors" glob.
    tmp_weights = dest / f".tmp-{os.getpid()}.safetensors"
    mx.save_safetensors(str(tmp_weights), tensors, metadata={"format": "mlx"})
    os.chmod(tmp_weights, FILE_MODE)
    _fsync_path(tmp_weights)
    os.replace(tmp_weights, dest / "model.safetensors")
    if supers:
        tmp_supers = dest / f".tmp-{os.getpid()}-supers.safetensors"
        mx.save_safetensors(str(tmp_supers), supers)
        os.chmod(tmp_supers, FILE_MODE)
        _fsync_path(tmp_supers)
        os.replace(tmp_supers, dest / SUPER_SCALES_FILE)
    else:  # a forced import over one whose file had K-quants
        (dest / SUPER_SCALES_FILE).unlink(missing_ok=True)
    tokenizer.save_pretrained(str(dest))
    for written in dest.iterdir():
        os.chmod(written, FILE_MODE)
    atomic_write_text(dest / "config.json", json.dumps(config, indent=2))
    atomic_write_text(dest / TENSORS_FILE, json.dumps(report.as_json(), indent=1))
    sampling = gguf_generation_config(
        _meta_num(meta, "general.sampling.temp"), _meta_num(meta, "general.sampling.top_p")
    )
    if sampling is not None:
        atomic_write_text(dest / GENERATION_CONFIG, json.dumps(sampling, indent=2))
    # Written last: its presence marks a complete import.
    atomic_write_text(dest / IMPORT_INFO_FILE, json.dumps(info, indent=2))
    bar.advance()
    return ImportResult(dest, sha, dtype, reused=False)


def read_tensor_report(path: Path) -> list[dict]:
    """What an import made of each GGML type (``ImportReport.as_json``: type, kept, tensors,
    file_bytes, resident_bytes), or [] for a directory imported before agentkv wrote it."""
    try:
        rows = json.loads((Path(path) / TENSORS_FILE).read_text())
    except (OSError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


def read_import_info(path: Path) -> dict | None:
    """The import record of an agentkv-imported directory, or None."""
    return _read_import_info(path)


def _read_import_info(path: Path) -> dict | None:
    try:
        return json.loads((path / IMPORT_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _meta_str(meta: dict, key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def _meta_num(meta: dict, key: str, default=None):
    value = meta.get(key)
    if value is None:
        return default
    return value.item() if isinstance(value, mx.array) else value


def _convert_weights(
    gguf_file: GGUFFile, arch: Architecture, dtype: WeightDtype
) -> tuple[dict, dict, dict, ImportReport]:
    """Rename tensors; keep them quantized as MLX affine triplets (``gguf_tensors``: lossless
    where MLX's format holds the GGML type) or dequantize them to float32. Returns the
    tensors, the K-quants' super-block factors (``SUPER_SCALES_FILE``), the quantization
    config and the report."""
    out: dict[str, mx.array] = {}
    supers: dict[str, mx.array] = {}
    per_module: dict[str, dict] = {}
    report = ImportReport()
    for tensor in gguf_file.tensors:
        mlx_name = arch.mlx_name(tensor.name)
        if mlx_name is None:  # held by the config
            continue
        offset = arch.norm_offset if arch.is_norm(tensor.name) else 0.0
        # a norm stored as offset + w loses w's low bits if rounded to float16 before the
        # offset comes off: it comes off in float32 first
        converted = convert_tensor(tensor, float32=dtype == "float32" or bool(offset))
        if converted.bits is None:
            value = converted.arrays["weight"]
            if offset:
                value = value - offset
                value = value if dtype == "float32" else value.astype(mx.float16)
                converted = Converted({"weight": value}, None, converted.how)
            out[mlx_name] = value
        else:
            module = mlx_name.removesuffix(".weight")
            for part, value in converted.arrays.items():
                out[f"{module}.{part}"] = value
            for part, value in converted.supers.items():
                supers[f"{module}.{part}"] = value
            per_module[module] = {"group_size": GROUP, "bits": converted.bits}
        report.add(tensor, converted)
        mx.eval(list(converted.arrays.values()))
    for line in report.notes():
        log.info("agentkv: %s", line)
    if not per_module:
        return out, supers, {}, report
    bits_used = sorted({q["bits"] for q in per_module.values()})
    default = {"group_size": GROUP, "bits": bits_used[0]}
    quant = dict(default)
    for module, q in per_module.items():
        if q != default:
            quant[module] = q
    return out, supers, quant, report


def _build_tokenizer(meta: dict):
    """A Hugging Face fast tokenizer rebuilt from the GGUF vocabulary: byte-level BPE
    ("gpt2") here, from the vocabulary and merges; every other kind transformers rebuilds
    from a GGUF (SentencePiece "llama": Llama 2, Mistral, Gemma...) through its converter."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = _meta_str(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        return _converted_tokenizer(meta, kind)
    pre = _meta_str(meta, "tokenizer.ggml.pre") or "default"
    if pre not in _PRE_PATTERNS:
        raise ModelImportError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    splitters = [
        pre_tokenizers.Split(Regex(_PRE_PATTERNS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    if pre in _SPLIT_DIGITS:
        splitters.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splitters)
    tok.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else list(types or [])
    added = [
        AddedToken(tokens[i], special=(t == _TOKEN_TYPE_CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_tokens(added)

    def token_at(key):
        value = _meta_num(meta, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(value)] if value is not None and int(value) < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_at("bos"),
        eos_token=token_at("eos"),
        unk_token=token_at("unknown"),
        pad_token=token_at("padding"),
        clean_up_tokenization_spaces=False,
    )
    template = _meta_str(meta, "tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def _converted_tokenizer(meta: dict, kind: str | None):
    """A GGUF tokenizer that is not byte-level BPE, rebuilt by transformers' GGUF converter
    (the classes transformers' own ``gguf_file=`` loading builds: SentencePiece vocabularies
    as ``LlamaTokenizer`` with merges recovered from the scores, Gemma's and Phi-3's fixes).
    llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to; so does
    the engine here (the tokenizer's ``add_bos_token``)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    def plain(value):
        return value.tolist() if isinstance(value, mx.array) else value

    fields = {
        name: plain(meta[f"tokenizer.{key}"])
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    tokens = fields.get("tokens")
    if not kind or not isinstance(tokens, list) or not tokens:
        raise ModelImportError(f"the GGUF has no tokenizer vocabulary (tokenizer model {kind!r})")
    arch = _meta_str(meta, "general.architecture") or "llama"
    try:
        backend, _ = convert_gguf_tokenizer(arch, fields)
    except Exception as exc:  # a kind or a field transformers' converter does not take
        raise ModelImportError(
            f"tokenizer model {kind!r} of this GGUF could not be rebuilt: "
            f"{type(exc).__name__}: {str(exc)[:200]}"
        ) from None

    def token_at(key):
        value = _meta_num(meta, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None

    bos = token_at("bos")
    add_bos = _meta_num(meta, "tokenizer.ggml.add_bos_token", kind == "llama")
    add_bos = bool(add_bos) and bos is not None
    if add_bos:  # as llama.cpp tokenizes: BOS first
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )  # fmt: skip
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token_at("eos"),
        unk_token=token_at("unknown"),
        pad_token=token_at("padding"),
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
    )
    template = _meta_str(meta, "tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast
