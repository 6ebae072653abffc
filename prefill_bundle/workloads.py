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

from . import HEAD_DIM, MINI, OP_TYPE, RAGGED
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


def check_every_row_sees_a_key(batch: RaggedBatch) -> None:
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
        if q_len > 0 and q_len > kv_len:
            raise ValueError(
                f"workload {batch.name}: a sequence with {q_len} queries and {kv_len} keys has "
                "query rows that see no key under the causal mask (their lse is -inf)"
            )


def blob_path(batch: RaggedBatch) -> str:
    return f"blob/workloads/{OP_TYPE}/{RAGGED}/{batch.name}.safetensors"


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
    return Trace.model_validate(
        {
            "definition": RAGGED,
            "workload": {
                "uuid": batch.name,
                "axes": {
                    "total_q": sum(batch.q_lens),
                    "total_kv": sum(batch.kv_lens),
                    "len_indptr": len(batch.q_lens) + 1,
                },
                "inputs": {
                    "q": {"type": "random"},
                    "k": {"type": "random"},
                    "v": {"type": "random"},
                    "qo_indptr": {"type": "safetensors", "path": path, "tensor_key": "qo_indptr"},
                    "kv_indptr": {"type": "safetensors", "path": path, "tensor_key": "kv_indptr"},
                    "sm_scale": {"type": "scalar", "value": 1.0 / math.sqrt(HEAD_DIM)},
                },
            },
        }
    )


def ragged_blob(batch: RaggedBatch) -> bytes:
    return save({"qo_indptr": batch.qo_indptr, "kv_indptr": batch.kv_indptr})


def workload_files() -> list[GeneratedFile]:
    for batch in RAGGED_BATCHES:
        check_every_row_sees_a_key(batch)
    return [
        GeneratedFile(f"workloads/{OP_TYPE}/{MINI}.jsonl", [mini_trace(s) for s in MINI_SHAPES]),
        GeneratedFile(
            f"workloads/{OP_TYPE}/{RAGGED}.jsonl", [ragged_trace(b) for b in RAGGED_BATCHES]
        ),
        *(GeneratedFile(blob_path(b), ragged_blob(b)) for b in RAGGED_BATCHES),
    ]
