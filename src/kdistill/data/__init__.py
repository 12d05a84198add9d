"""Training data: read, tokenize once (cached), split by document, pack, and batch.

    data = prepare_data(cfg.data, tokenizer, seed=0)   # PreparedData: .train, .heldout (N, seq_len+1) int64
    print(data.summary())                               # how many tokens and sequences each side has
    batches = Batcher(data.train, batch_size=8, seed=0)
    input_ids, labels = batches.next()                  # (B, T) int64 tensors, labels = inputs shifted by one

The modules, in the order data flows through them:
- sources: data paths expanded to files (FileSpec), the text and JSONL readers (TokenDocs);
- binfmt: `.bin` token shards (KDTOKENS, llm.c, raw u16/u32), memory-mapped;
- cache: the on-disk token cache and its file format;
- load: every file of a list of paths, read by its kind through the cache;
- packing: the held-out split, EOS-joined streams, fixed-length windows (prepare_data);
- batches: shuffled resumable training batches and fixed held-out batches.
"""

from kdistill.data.batches import Batcher, HeldoutBatches, check_batch, heldout_batches
from kdistill.data.binfmt import bin_layout, read_bin, write_bin
from kdistill.data.cache import CACHE_VERSION, TokenCache, cache_dir
from kdistill.data.load import LoadedFile, load_file, load_files
from kdistill.data.packing import PreparedData, Selection, pack, prepare_data, split_score, stream_tokens
from kdistill.data.sources import FileSpec, TokenDocs, UndecodableError, expand_paths, read_jsonl, read_text

__all__ = [
    "CACHE_VERSION",
    "Batcher",
    "FileSpec",
    "HeldoutBatches",
    "LoadedFile",
    "PreparedData",
    "Selection",
    "TokenCache",
    "TokenDocs",
    "UndecodableError",
    "bin_layout",
    "cache_dir",
    "check_batch",
    "expand_paths",
    "heldout_batches",
    "load_file",
    "load_files",
    "pack",
    "prepare_data",
    "read_bin",
    "read_jsonl",
    "read_text",
    "split_score",
    "stream_tokens",
    "write_bin",
]
