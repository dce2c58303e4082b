"""Greedy decoding of one sequence, step by step: the smallest driver of an executable."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kiln.backends.base import Executable, allocate_kv_cache
from kiln.ir.step import SequenceSlice, build_step_inputs


def greedy_generate(
    executable: Executable,
    prompt_ids: Sequence[int],
    max_tokens: int,
    eos_token_ids: Sequence[int] = (),
    block_size: int = 16,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generate up to `max_tokens` tokens after the prompt, stopping after an EOS id."""
    if not prompt_ids:
        raise ValueError("prompt_ids: the prompt must have at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    total = len(prompt_ids) + max_tokens
    num_blocks = (total + block_size - 1) // block_size
    kv_cache = allocate_kv_cache(executable, num_blocks, block_size)
    block_table = list(range(num_blocks))
    generated: list[int] = []
    pending, num_cached = list(prompt_ids), 0
    while len(generated) < max_tokens:
        inputs = build_step_inputs([SequenceSlice(pending, num_cached, block_table)], block_size)
        logits = executable.step(inputs, kv_cache)
        token = int(np.argmax(logits[0]))
        generated.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_token_ids:
            break
        num_cached += len(pending)
        pending = [token]
    return generated
