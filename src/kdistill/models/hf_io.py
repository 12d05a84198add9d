"""Hugging Face model I/O: model directories in and out, safetensors only, formats told by their bytes.

    fmt = sniff_format(path)                          # "safetensors" | "gguf" | "apr" | "pickle" | ...
    header, data_offset = read_safetensors_header(path)
    model = load_model("path/to/hf_dir", device="cuda", dtype=torch.bfloat16, vocab_rows=151665)
    save_model(model, Path("out/student"), source_dir=Path("path/to/hf_dir"))

Our decoder's parameter names equal Hugging Face's, so the weight map is the identity: a tensor named
`model.layers.0.self_attn.q_proj.weight` in the file is the parameter of that name. Formats are told
apart by their bytes, never by file names. Pickle-based files (PyTorch .bin/.pt) are refused outright:
nothing in this module ever unpickles. The safetensors header is parsed by our own bounded, strict
reader (the header length is checked against the file size and a 100 MB cap before anything is read),
and tensor data is read through a private memory map, straight to the target device and dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kdistill.dtypes import SAFETENSORS, long_name, torch_dtype
from kdistill.errors import UserError
from kdistill.fileio import fault_point, write_json_durable
from kdistill.jsonio import short_repr
from kdistill.models.decoder import KD_ONLY_PREFIX, Decoder, join_projections
from kdistill.models.spec import read_config_json, spec_from_hf_config
from kdistill.outputs import staged_output
from kdistill.rundir import has_marker

MAX_HEADER_BYTES = 100 * 1024 * 1024

# The dtypes we load and save: safetensors header name -> torch dtype (from the one dtype table).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {k: torch_dtype(v) for k, v in SAFETENSORS.items()}

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
# What a chat model needs besides its weights (transformers 5 keeps the template in chat_template.jinja).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
EXTRA_FILES = ("generation_config.json",)

# Tensors some HF checkpoints carry that are recomputed, not learned (old Llama exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# -- format sniffing -------------------------------------------------------------------------------


def sniff_format(path: Path) -> str:
    """Tell a weight file's format from its first bytes (never from its name).

    Returns:
        "safetensors" (8-byte little-endian header length, then a JSON object that fits in the file),
        "gguf" (magic ``GGUF``), "apr" (aprender, magic ``APR\\0``), "torch-zip" (``PK\\x03\\x04``, as
        ``torch.save`` writes), "pickle" (``\\x80`` then a protocol byte 2-5) or "unknown".

    Raises:
        UserError: the file cannot be opened.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.__class__.__name__}: {e.strerror or e})") from None
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] in (b"APR\0", b"APR1", b"APR2"):
        return "apr"
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    return "unknown"


def refusal(path: Path, fmt: str) -> str:
    """The one-line message for a weight file we do not read, by its sniffed format."""
    if fmt in ("pickle", "torch-zip"):
        kind = "a Python pickle" if fmt == "pickle" else "a PyTorch zip (torch.save) pickle"
        return (
            f"{path}: is {kind} checkpoint; refused: kdistill never unpickles model files (they can run code). "
            f"Convert it to safetensors where you trust it (transformers save_pretrained(..., "
            f"safe_serialization=True)) and pass that directory"
        )
    if fmt == "gguf":
        return (
            f"{path}: is a GGUF (llama.cpp) file; kdistill reads Hugging Face safetensors only: convert it "
            f"first (transformers: AutoModelForCausalLM.from_pretrained(DIR, gguf_file=FILE) then "
            f"save_pretrained(OUT), which writes safetensors) and pass that directory"
        )
    if fmt == "apr":
        return (
            f"{path}: is an aprender APR model; kdistill reads Hugging Face safetensors only: export it with "
            f"aprender (apr export MODEL.apr --format safetensors) and pass a directory with config.json"
        )
    return f"{path}: unknown weight format (expected safetensors: an 8-byte header length then a JSON header)"


# -- safetensors header ----------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_safetensors_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """Parse and validate a safetensors header without reading any tensor data.

    Bounded: the 8-byte header length is checked against the file size and a 100 MB cap before the
    header is read, so no input makes this allocate more than that.

    Returns:
        (header, data_offset): header maps tensor name -> {"dtype", "shape", "data_offsets"} (the
        optional "__metadata__" entry is removed); data_offset is where tensor data starts in the file.

    Raises:
        UserError: one line naming the file and what is wrong (truncated file, header length past the end
        of the file, corrupt JSON, unsupported dtype, bad shape or offsets).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise UserError(
                    f"{path}: truncated safetensors file ({size} bytes; expected an 8-byte header length first)"
                )
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise UserError(
                    f"{path}: safetensors header length {n} runs past the end of the file ({size} bytes): "
                    f"the file is truncated or not safetensors"
                )
            if n > MAX_HEADER_BYTES:
                raise UserError(
                    f"{path}: safetensors header length {n} exceeds the {MAX_HEADER_BYTES} byte limit"
                )
            raw = f.read(n)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.__class__.__name__}: {e.strerror or e})") from None
    if len(raw) != n:
        raise UserError(f"{path}: truncated safetensors file (header shorter than its length field {n})")
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: corrupt safetensors header (not UTF-8 at byte {8 + e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}: corrupt safetensors header (not valid JSON: {e.msg.removesuffix(' at')} at byte {8 + e.pos})"
        ) from None
    except (ValueError, RecursionError) as e:
        raise UserError(
            f"{path}: corrupt safetensors header (not valid JSON: {e.__class__.__name__})"
        ) from None
    if not isinstance(header, dict):
        raise UserError(
            f"{path}: corrupt safetensors header (expected a JSON object, got {type(header).__name__})"
        )
    data_offset = 8 + n
    data_size = size - data_offset
    meta = header.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise UserError(f"{path}: safetensors '__metadata__' is {type(meta).__name__}, expected an object")
    spans = []
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not name:
            raise UserError(f"{path}: safetensors header has a tensor with an empty name")
        if not isinstance(entry, dict):
            raise UserError(f"{where}: header entry is {type(entry).__name__}, expected an object")
        dtype = entry.get("dtype")
        if not isinstance(dtype, str):
            raise UserError(f"{where}: header field 'dtype' is {dtype!r}, expected a string such as 'BF16'")
        if dtype not in SAFETENSORS_DTYPES:
            raise UserError(
                f"{where}: dtype {dtype[:32]} is not supported (supported: {', '.join(SAFETENSORS_DTYPES)})"
            )
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise UserError(
                f"{where}: header field 'shape' is {str(shape)[:80]}, expected a list of non-negative ints"
            )
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise UserError(
                f"{where}: header field 'data_offsets' is {str(offsets)[:80]}, expected [begin, end] integers"
            )
        begin, end = offsets
        nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if not 0 <= begin <= end:
            raise UserError(f"{where}: bad data_offsets [{begin}, {end}] (expected 0 <= begin <= end)")
        if end - begin != nbytes:
            raise UserError(
                f"{where}: bad data_offsets [{begin}, {end}]: {end - begin} bytes, but shape {shape} in {dtype} "
                f"needs {nbytes}"
            )
        if end > data_size:
            raise UserError(
                f"{where}: data_offsets end {end} is past the end of the data ({data_size} bytes): truncated file"
            )
        spans.append((begin, end, name))
    spans.sort()
    for (_, prev_end, prev), (begin, end, name) in zip(spans, spans[1:]):
        if begin < prev_end and end > begin:
            raise UserError(f"{path}: tensors {prev!r} and {name!r} overlap in the data section")
    return header, data_offset


# -- reading tensors -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, safetensors dtype, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF model directory (one file, or the shards named by the index).

    Raises:
        UserError: no safetensors weights (naming any pickle/GGUF/APR file found instead), a bad index,
        or an index that names a file outside the directory.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    single = model_dir / WEIGHTS_NAME
    if index.is_file():
        data = read_config_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(
                f"{index}: field 'weight_map' is missing or empty (expected tensor name -> shard file)"
            )
        files: list[Path] = []
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or not fname or Path(fname).name != fname or fname in (".", ".."):
                raise UserError(
                    f"{index}: weight_map[{short_repr(name)}] is {short_repr(fname)}, expected a file name inside {model_dir}"
                )
            shard = model_dir / fname
            if not shard.is_file():
                raise UserError(
                    f"{index}: weight_map[{short_repr(name)}] names {fname}, which does not exist in {model_dir}"
                )
            if shard not in files:
                files.append(shard)
        return files
    if single.is_file():
        return [single]
    for other in _candidate_weight_files(model_dir):
        fmt = sniff_format(other)
        if fmt in ("pickle", "torch-zip", "gguf", "apr"):
            raise UserError(refusal(other, fmt))
    shards = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if shards:
        return shards
    raise UserError(
        f"{model_dir}: no {WEIGHTS_NAME} or {INDEX_NAME} (expected a Hugging Face safetensors directory)"
    )


def _candidate_weight_files(model_dir: Path) -> Iterator[Path]:
    """Files that could hold weights: every regular file that is not a known JSON/text companion."""
    skip = {"config.json", INDEX_NAME, *TOKENIZER_FILES, *EXTRA_FILES}
    if not model_dir.is_dir():
        return
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and p.name not in skip and p.suffix not in (".json", ".txt", ".md", ".model", ".py"):
            yield p


def checkpoint_index(model_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor of an HF safetensors directory, by name, from the headers alone (no data read).

    Raises:
        UserError: see `weight_files` and `read_safetensors_header`; also a tensor stored in two shards,
        or an index entry whose shard lacks that tensor.
    """
    model_dir = Path(model_dir)
    out: dict[str, TensorEntry] = {}
    files = weight_files(model_dir)
    for file in files:
        fmt = sniff_format(file)
        if fmt in ("pickle", "torch-zip", "gguf", "apr"):
            raise UserError(refusal(file, fmt))
        header, data_offset = read_safetensors_header(file)
        for name, e in header.items():
            if name in out:
                raise UserError(f"{file}: tensor {name!r} is also stored in {out[name].file.name}")
            b, end = e["data_offsets"]
            out[name] = TensorEntry(file, e["dtype"], tuple(e["shape"]), data_offset + b, data_offset + end)
    index = model_dir / INDEX_NAME
    if index.is_file():
        for name, fname in read_config_json(index)["weight_map"].items():
            if name not in out or out[name].file.name != fname:
                raise UserError(
                    f"{index}: weight_map says tensor {name!r} is in {fname}, but that file lacks it"
                )
    return out


class _Mapped:
    """Private (copy-on-write) memory maps of the weight files, opened once each."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def tensor(self, e: TensorEntry) -> torch.Tensor:
        """A CPU tensor over the file's bytes (no copy when aligned)."""
        dtype = SAFETENSORS_DTYPES[e.dtype]
        itemsize = dtype.itemsize
        if e.end == e.start:
            return torch.empty(e.shape, dtype=dtype)
        mm = self._maps.get(e.file)
        if mm is None:
            with open(e.file, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[e.file] = mm
        if e.start % itemsize:  # unaligned: copy the bytes out first
            buf: Any = bytearray(mm[e.start : e.end])
            t = torch.frombuffer(buf, dtype=dtype)
        else:
            t = torch.frombuffer(mm, dtype=dtype, count=(e.end - e.start) // itemsize, offset=e.start)
        return t.view(e.shape)


# -- load ------------------------------------------------------------------------------------------


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    vocab_rows: int | None = None,
) -> Decoder:
    """Load an HF model directory (config.json + safetensors) into our Decoder on `device` in `dtype`.

    The decoder is built on the meta device, every tensor is checked against config.json (no missing,
    unexpected or mis-shaped tensor), read memory-mapped and moved straight to `device`/`dtype`, then
    assigned. A tied model's checkpoint may or may not carry `lm_head.weight`.

    Args:
        path: a Hugging Face model directory with config.json and model.safetensors or
            model.safetensors.index.json and its shards.
        device: target device.
        dtype: target floating dtype of every parameter.
        vocab_rows: keep only the first `vocab_rows` embedding (and lm_head) rows: a teacher whose
            embedding is padded beyond the tokenizer's vocabulary. The returned spec has
            vocab_size == vocab_rows.

    Raises:
        UserError: a bad directory, config or weight file, as one line naming the file and tensor.
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        if model_dir.is_file():
            fmt = sniff_format(model_dir)
            if fmt in ("pickle", "torch-zip", "gguf", "apr"):
                raise UserError(refusal(model_dir, fmt))
        raise UserError(
            f"{model_dir}: not a directory (expected a Hugging Face model directory with config.json)"
        )
    cfg_path = model_dir / "config.json"
    spec = spec_from_hf_config(read_config_json(cfg_path), str(cfg_path))
    entries = checkpoint_index(model_dir)

    with torch.device("meta"):
        full = Decoder(spec)
    expected = {name: tuple(p.shape) for name, p in full.state_dict().items()}
    for name, e in entries.items():
        if name in expected or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            if e.shape != expected["model.embed_tokens.weight"]:
                raise UserError(
                    f"{e.file}: tensor 'lm_head.weight' has shape {list(e.shape)}, expected "
                    f"{list(expected['model.embed_tokens.weight'])} from {cfg_path}"
                )
            continue
        raise UserError(
            f"{e.file}: unexpected tensor {name!r} (not part of a {spec.arch} model with the shapes in {cfg_path})"
        )
    missing = [n for n in expected if n not in entries]
    if missing:
        files = sorted({e.file for e in entries.values()})
        where = (
            files[0] if len(files) == 1 else f"{model_dir} (weight files: {', '.join(f.name for f in files)})"
        )
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"{where}: missing tensor {missing[0]!r}{more} (expected by {cfg_path})")
    for name, shape in expected.items():
        e = entries[name]
        if e.shape != shape:
            raise UserError(
                f"{e.file}: tensor {name!r} has shape {list(e.shape)}, expected {list(shape)} from {cfg_path}"
            )

    rows = spec.vocab_size
    if vocab_rows is not None:
        if not _is_int(vocab_rows) or not 0 < vocab_rows <= spec.vocab_size:
            raise UserError(
                f"{cfg_path}: cannot trim the vocabulary to {vocab_rows} rows "
                f"(expected 1 to the embedding's {spec.vocab_size} rows)"
            )
        if vocab_rows < spec.vocab_size:
            rows = vocab_rows
            spec = dataclasses.replace(spec, vocab_size=vocab_rows)
    with torch.device("meta"):
        model = Decoder(spec)

    maps = _Mapped()
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in model.state_dict():
            src = maps.tensor(entries[name])
            if name in ("model.embed_tokens.weight", "lm_head.weight") and rows < src.shape[0]:
                src = src[:rows]
            t = src.to(device=device, dtype=dtype)
            if t.device.type == "cpu" and (
                t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
            ):
                t = t.clone()  # own the memory rather than keep the file mapped
            state[name] = t.contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()  # the model holds the tensors now: joining below frees each group's old ones as it goes
    del maps
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"left on the meta device: {leftover}"
    join_projections(model)  # the fused projections read [q; k; v] and [gate; up] without a copy
    return model


# -- save ------------------------------------------------------------------------------------------


def has_weights(model_dir: Path) -> bool:
    """True when `model_dir` holds safetensors weights (model.safetensors or a sharded index)."""
    model_dir = Path(model_dir)
    return (model_dir / WEIGHTS_NAME).is_file() or (model_dir / INDEX_NAME).is_file()


def save_model(
    model: Decoder,
    out_dir: Path,
    *,
    source_dir: Path | None = None,
    dtype: torch.dtype | None = None,
    chat_template: str | None = None,
    kind: str = "model",
    intact: str | None = None,
    inputs: Iterable[tuple[str, str | Path]] = (),
) -> None:
    """Write `model` as a Hugging Face directory that transformers.AutoModelForCausalLM loads as is.

    Writes config.json, model.safetensors (a tied model has no lm_head.weight) and copies the tokenizer
    files and generation_config.json from `source_dir` when present. Atomic (kdistill.outputs): written
    to a temporary sibling directory, marked as kdistill's output of `kind`, then renamed into place; an
    existing directory at `out_dir` is replaced only when it carries the marker of an earlier `kind`
    (or is a model directory inside a kdistill run directory, written before markers existed), and only
    once the new one is complete. Only fixed file names are written, so nothing from a checkpoint can
    write outside `out_dir`.

    Args:
        model: the decoder to save.
        out_dir: target directory.
        source_dir: the model directory to copy tokenizer and generation config files from.
        dtype: dtype to store (float32, bfloat16 or float16); default: the model's parameter dtype.
        chat_template: written as chat_template.jinja (the template a run rendered its conversations
            with, when it was not the source's own).
        kind: the marker's kind ("model"; `kdistill export --merge`: "export-merged").
        intact: what a write fault leaves intact, for its one-line error.
        inputs: (label, path) of the run's inputs: out_dir may not be, or contain, one of them.

    Raises:
        UserError: out_dir is a file, or a non-empty directory kdistill did not write as `kind`, or one
        of `inputs`, or cannot be written (disk full, read-only, ...: one line, nothing left behind).
    """
    out_dir = Path(out_dir)
    if dtype is None:
        dtype = next(model.parameters()).dtype
    if dtype not in SAFETENSORS_DTYPES.values():
        raise UserError(f"save dtype {dtype} is not supported (expected float32, bfloat16 or float16)")

    def legacy(p: Path) -> bool:  # a run's own student/, exported before markers existed
        return kind == "model" and (p / "config.json").is_file() and has_marker(p.absolute().parent)

    with staged_output(
        out_dir, kind, name="", what="write the model", intact=intact, inputs=inputs, legacy=legacy
    ) as tmp:
        cfg = model.spec.to_hf_config()
        cfg["torch_dtype"] = cfg["dtype"] = long_name(dtype)
        write_json_durable(tmp / "config.json", cfg)

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in model.state_dict().items():
            if model.spec.tie_word_embeddings and name == "lm_head.weight":
                continue
            if name.startswith(KD_ONLY_PREFIX):  # distillation-only modules (layer-map projections)
                continue
            t = t.detach().to(device="cpu", dtype=dtype).contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        fault_point(tmp / WEIGHTS_NAME, "safetensors")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        with open(tmp / WEIGHTS_NAME, "rb+") as f:
            os.fsync(f.fileno())

        if source_dir is not None:
            src = Path(source_dir)
            for fname in (*TOKENIZER_FILES, *EXTRA_FILES):
                if (src / fname).is_file():
                    fault_point(tmp / fname)
                    shutil.copyfile(src / fname, tmp / fname)
        if chat_template is not None:
            fault_point(tmp / "chat_template.jinja")
            (tmp / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
