"""The workloads: the shapes users run, written deterministically by scripts/generate.py.

The ragged definition's indptr tensors come from safetensors blobs: flashinfer-bench draws random
int32 inputs from randint(-1024, 1024), which is no indptr. flashinfer-bench also judges any inf in
an output as wrong, even where the reference's lse is -inf, so no workload may hold a query row
that sees no key (queries without keys, or more queries than keys under causal): those edge cases
belong to the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from flashinfer_bench import Trace
from safetensors.torch import save

from . import HEAD_DIM, MINI, OP_TYPE, PAGE_SIZES, PAGED_FP8, PAGED_OP_TYPE, RAGGED, SWA
from .generated import GeneratedFile


@dataclass(frozen=True)
class PaddedShape:
    name: str
    batch: int
    seq_q: int
    seq_kv: int
    causal: bool


@dataclass(frozen=True)
class RaggedBatch:
    name: str
    q_lens: tuple
    kv_lens: tuple
    window_left: int | None = None  # set: a batch of the sliding-window definition

    @property
    def definition(self) -> str:
        return RAGGED if self.window_left is None else SWA

    @property
    def qo_indptr(self) -> torch.Tensor:
        return lengths_to_indptr(self.q_lens)

    @property
    def kv_indptr(self) -> torch.Tensor:
        return lengths_to_indptr(self.kv_lens)


def lengths_to_indptr(lengths) -> torch.Tensor:
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return indptr


def _seeded_lengths(count: int, low: int, high: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(low, high + 1, (count,), generator=gen).tolist())


MINI_SHAPES = [
    # The exercise's five configurations, then long context.
    PaddedShape("small_b1_q128_kv128_causal", 1, 128, 128, True),
    PaddedShape("medium_b4_q512_kv512_causal", 4, 512, 512, True),
    PaddedShape("large_b8_q2048_kv2048_causal", 8, 2048, 2048, True),
    PaddedShape("noncausal_b4_q512_kv512", 4, 512, 512, False),
    PaddedShape("asymmetric_b4_q128_kv2048_causal", 4, 128, 2048, True),
    PaddedShape("long_b1_q8192_kv8192_causal", 1, 8192, 8192, True),
    PaddedShape("long_b1_q16384_kv16384_noncausal", 1, 16384, 16384, False),
]

_SHORT_PROMPTS = _seeded_lengths(15, 20, 110, seed=15)  # 15 sequences, mean about 65 tokens
_LONG_PROMPTS = _seeded_lengths(4, 1024, 3072, seed=4)
_MIXED = (1, 3, 17, 4096, 2, 1500, 9)

RAGGED_BATCHES = [
    RaggedBatch("single_token", (1,), (1,)),
    RaggedBatch("prompt_7", (7,), (7,)),
    RaggedBatch("prompt_35", (35,), (35,)),
    RaggedBatch("batch15_short_prompts", _SHORT_PROMPTS, _SHORT_PROMPTS),
    RaggedBatch("batch4_prompts_1k_3k", _LONG_PROMPTS, _LONG_PROMPTS),
    RaggedBatch("prompt_8k", (8192,), (8192,)),
    RaggedBatch("mixed_short_and_long", _MIXED, _MIXED),
    RaggedBatch("batch_with_empty_sequence", (37, 0, 120, 5), (37, 0, 120, 5)),
    # Chunked prefill: each new chunk attends to its cached prefix (bottom-right mask).
    RaggedBatch("chunked_prefill_with_prefix", (512, 256), (2048, 1280)),
]

# Sliding windows as models use them: Mistral 4096, Gemma 3's local layers 1024, gpt-oss 128.
SWA_BATCHES = [
    RaggedBatch("prompt_32k_window_4096", (32768,), (32768,), 4096),
    RaggedBatch("prompt_8k_window_1024", (8192,), (8192,), 1024),
    RaggedBatch("mixed_short_and_long_window_128", _MIXED, _MIXED, 128),
    RaggedBatch("batch4_prompts_1k_3k_window_1024", _LONG_PROMPTS, _LONG_PROMPTS, 1024),
    # A 2K chunk over 14K of cached context: the window reaches 2K back into the prefix.
    RaggedBatch("chunked_prefill_2k_over_16k_window_4096", (2048,), (16384,), 4096),
    # A window longer than every sequence: plain causal attention through the window path.
    RaggedBatch("window_8192_over_prompts_1k_3k", _LONG_PROMPTS, _LONG_PROMPTS, 8192),
]


def ragged_batch_named(name: str) -> RaggedBatch | None:
    """The ragged or sliding-window workload batch called `name` (None if there is none)."""
    return next((b for b in RAGGED_BATCHES + SWA_BATCHES if b.name == name), None)


def check_every_row_sees_a_key(batch: RaggedBatch) -> None:
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
        if q_len > 0 and q_len > kv_len:
            raise ValueError(
                f"workload {batch.name}: a sequence with {q_len} queries and {kv_len} keys has "
                "query rows that see no key under the causal mask (their lse is -inf)"
            )


def blob_path(batch: RaggedBatch) -> str:
    return f"blob/workloads/{OP_TYPE}/{batch.definition}/{batch.name}.safetensors"


def mini_trace(shape: PaddedShape) -> Trace:
    return Trace.model_validate(
        {
            "definition": MINI,
            "workload": {
                "uuid": shape.name,
                "axes": {"batch": shape.batch, "seq_q": shape.seq_q, "seq_kv": shape.seq_kv},
                "inputs": {
                    "q": {"type": "random"},
                    "k": {"type": "random"},
                    "v": {"type": "random"},
                    "causal": {"type": "scalar", "value": shape.causal},
                },
            },
        }
    )


def ragged_trace(batch: RaggedBatch) -> Trace:
    path = blob_path(batch)
    inputs = {
        "q": {"type": "random"},
        "k": {"type": "random"},
        "v": {"type": "random"},
        "qo_indptr": {"type": "safetensors", "path": path, "tensor_key": "qo_indptr"},
        "kv_indptr": {"type": "safetensors", "path": path, "tensor_key": "kv_indptr"},
    }
    if batch.window_left is not None:
        inputs["window_left"] = {"type": "scalar", "value": batch.window_left}
    inputs["sm_scale"] = {"type": "scalar", "value": 1.0 / math.sqrt(HEAD_DIM)}
    return Trace.model_validate(
        {
            "definition": batch.definition,
            "workload": {
                "uuid": batch.name,
                "axes": {
                    "total_q": sum(batch.q_lens),
                    "total_kv": sum(batch.kv_lens),
                    "len_indptr": len(batch.q_lens) + 1,
                },
                "inputs": inputs,
            },
        }
    )


def ragged_blob(batch: RaggedBatch) -> bytes:
    return save({"qo_indptr": batch.qo_indptr, "kv_indptr": batch.kv_indptr})


# ---- Paged KV cache: page tables as a serving engine's allocator hands them out ---------------


@dataclass(frozen=True)
class PagedBatch:
    """A batch over a paged cache. Sequence s has q_lens[s] new tokens and kv_lens[s] tokens in
    the cache (its new ones last); the first shared_prefix[s] of them are a prefix that every
    sequence with the same shared_prefix value shares page for page (a prefix-cache hit; whole
    pages only). Pages come from a shuffled pool with spare_pages never listed."""

    name: str
    q_lens: tuple
    kv_lens: tuple
    shared_prefix: tuple = ()  # per sequence; () for none
    spare_pages: int = 3
    seed: int = 0

    def page_table(self, page_size: int) -> dict:
        """qo_indptr, kv_indptr, kv_indices, kv_last_page_len and num_pages."""
        gen = torch.Generator().manual_seed(self.seed)
        prefixes = self.shared_prefix or (0,) * len(self.kv_lens)
        shared_pages = {p: p // page_size for p in set(prefixes) if p}
        pages_needed = [-(-kv // page_size) for kv in self.kv_lens]
        own = [n - shared_pages.get(p, 0) for n, p in zip(pages_needed, prefixes)]
        num_pages = sum(shared_pages.values()) + sum(own) + self.spare_pages
        pool = iter(torch.randperm(num_pages, generator=gen).tolist())
        shared_ids = {p: [next(pool) for _ in range(n)] for p, n in shared_pages.items()}
        indices, last_lens = [], []
        for kv_len, prefix, n_own in zip(self.kv_lens, prefixes, own):
            indices += shared_ids.get(prefix, []) + [next(pool) for _ in range(n_own)]
            last_lens.append(kv_len - (-(-kv_len // page_size) - 1) * page_size if kv_len else 1)
        return {
            "qo_indptr": lengths_to_indptr(self.q_lens),
            "kv_indptr": lengths_to_indptr(pages_needed),
            "kv_indices": torch.tensor(indices, dtype=torch.int32),
            "kv_last_page_len": torch.tensor(last_lens, dtype=torch.int32),
            "num_pages": num_pages,
        }


_HISTORIES = _seeded_lengths(8, 0, 700, seed=8)  # each conversation's own earlier turns
_SYSTEM_PROMPT = 4096
_HITS = tuple(_SYSTEM_PROMPT + h + 256 for h in _HISTORIES)

PAGED_BATCHES = [
    # Prefix-cache hits: 8 conversations share a 4096-token system prompt's pages; each adds its
    # own cached turns and a 256-token new message.
    PagedBatch("prefix_cache_hits_8x256", (256,) * 8, _HITS, (_SYSTEM_PROMPT,) * 8),
    # Chunked prefill of long prompts: one 2K chunk over its cached context.
    PagedBatch("chunked_prefill_2k_over_8k", (2048,), (8131,)),
    PagedBatch("chunked_prefill_2k_over_32k", (2048,), (32611,)),
    PagedBatch("chunked_prefill_4x2k_over_16k", (2048,) * 4, (16000, 16384, 15000, 12345)),
    # Fresh prompts: nothing cached, the new tokens are the whole context.
    PagedBatch("fresh_prompts_4x1k_3k", _LONG_PROMPTS, _LONG_PROMPTS),
    PagedBatch("fresh_prompt_8k", (8192,), (8192,)),
    # One new token per sequence over long contexts (speculative or multi-turn tails).
    PagedBatch("single_token_rows_16", (1,) * 16, _seeded_lengths(16, 4000, 16000, seed=16)),
    # What a serving step mixes: fresh prompts, prefix hits, a chunk, single tokens.
    PagedBatch(
        "mixed_batch",
        (300, 128, 2048, 1, 37, 128),
        (300, _SYSTEM_PROMPT + 500, 8131, 6000, 37, _SYSTEM_PROMPT + 128),
        (0, _SYSTEM_PROMPT, 0, 0, 0, _SYSTEM_PROMPT),
    ),
]


# The FP8 cache's dequantization scales in the workloads (flashinfer-bench draws random FP8
# caches clamped to [-2, 2]): not 1, so a kernel that drops a scale fails.
FP8_K_SCALE, FP8_V_SCALE = 0.5, 1.25
PAGED_DEFINITIONS = {**PAGE_SIZES, PAGED_FP8: 64}  # page size of every paged definition


def paged_blob_path(batch: PagedBatch, definition: str) -> str:
    return f"blob/workloads/{PAGED_OP_TYPE}/{definition}/{batch.name}.safetensors"


def paged_trace(batch: PagedBatch, definition: str) -> Trace:
    page_size = PAGED_DEFINITIONS[definition]
    table = batch.page_table(page_size)
    path = paged_blob_path(batch, definition)
    axes = {
        "len_indptr": len(batch.q_lens) + 1,
        "total_q": sum(batch.q_lens),
        "num_kv_indices": len(table["kv_indices"]),
        "num_pages": table["num_pages"],
    }
    blob_keys = ["qo_indptr", "kv_indptr", "kv_indices"]
    if page_size > 1:  # only the page size 64 definition takes kv_last_page_len
        axes["batch_size"] = len(batch.q_lens)
        blob_keys.append("kv_last_page_len")
    inputs = {"q": {"type": "random"}, "k_cache": {"type": "random"}, "v_cache": {"type": "random"}}
    for key in blob_keys:
        inputs[key] = {"type": "safetensors", "path": path, "tensor_key": key}
    if definition == PAGED_FP8:
        inputs["k_scale"] = {"type": "scalar", "value": FP8_K_SCALE}
        inputs["v_scale"] = {"type": "scalar", "value": FP8_V_SCALE}
    inputs["sm_scale"] = {"type": "scalar", "value": 1.0 / math.sqrt(HEAD_DIM)}
    suffix = "fp8kv" if definition == PAGED_FP8 else f"ps{page_size}"
    return Trace.model_validate(
        {
            "definition": definition,
            "workload": {"uuid": f"{batch.name}_{suffix}", "axes": axes, "inputs": inputs},
        }
    )


def paged_blob(batch: PagedBatch, definition: str) -> bytes:
    table = batch.page_table(PAGED_DEFINITIONS[definition])
    keys = ["qo_indptr", "kv_indptr", "kv_indices"]
    if PAGED_DEFINITIONS[definition] > 1:
        keys.append("kv_last_page_len")
    return save({key: table[key] for key in keys})


def paged_workload_files() -> list[GeneratedFile]:
    files = []
    for definition in PAGED_DEFINITIONS:
        traces = [paged_trace(b, definition) for b in PAGED_BATCHES]
        files.append(GeneratedFile(f"workloads/{PAGED_OP_TYPE}/{definition}.jsonl", traces))
        files += [
            GeneratedFile(paged_blob_path(b, definition), paged_blob(b, definition))
            for b in PAGED_BATCHES
        ]
    return files


def workload_files() -> list[GeneratedFile]:
    for batch in RAGGED_BATCHES + SWA_BATCHES + PAGED_BATCHES:
        check_every_row_sees_a_key(batch)
    return paged_workload_files() + [
        GeneratedFile(f"workloads/{OP_TYPE}/{MINI}.jsonl", [mini_trace(s) for s in MINI_SHAPES]),
        GeneratedFile(
            f"workloads/{OP_TYPE}/{RAGGED}.jsonl", [ragged_trace(b) for b in RAGGED_BATCHES]
        ),
        GeneratedFile(f"workloads/{OP_TYPE}/{SWA}.jsonl", [ragged_trace(b) for b in SWA_BATCHES]),
        *(GeneratedFile(blob_path(b), ragged_blob(b)) for b in RAGGED_BATCHES + SWA_BATCHES),
    ]
