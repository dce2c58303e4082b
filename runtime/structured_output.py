"""Constrained decoding with xgrammar: a request's constraint (a JSON schema, any JSON object, a regex,
a choice of strings, or an EBNF grammar) compiled once per (kind, spec) against the model's vocabulary,
a matcher per sequence, and per step a token bitmask the sampler applies after the penalties. A reply's
reasoning block (`<think>` … `</think>`) is left free: the matcher starts outside it (`Constraint`).

Grammars compile in a thread pool (xgrammar releases the GIL), so a server compiles off its engine
loop; compiled grammars are cached. The bitmask covers the LM head's rows: tokens past the
tokenizer's vocabulary are never allowed; the stop tokens only where the grammar may end. The
bitmask is a numpy array; xgrammar, imported only once a constraint is used, imports torch itself.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kiln.runtime.sampling_params import ReasoningTokens, StructuredOutput

if TYPE_CHECKING:
    import xgrammar

    from kiln.runtime.tokenizer import Tokenizer

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[14:56:14] /project/cpp/x.cc:94: "


class GrammarError(ValueError):
    """A constraint xgrammar cannot compile; the message says why (a 400 for the server)."""


def _reason(error: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(error).strip()).strip()


class Grammars:
    """The compiled constraints of one model's vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, workers: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-grammar")
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: dict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = {}

    def _grammar_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            try:
                import transformers
                import xgrammar
            except ImportError as error:
                raise GrammarError(
                    f"structured outputs need xgrammar and transformers ({error}); install them with "
                    "pip install 'kiln[structured]'"
                ) from None
            from tokenizers import Tokenizer as HFTokenizer

            fast = transformers.PreTrainedTokenizerFast(
                tokenizer_object=HFTokenizer.from_str(self.tokenizer.tokenizer_json)
            )
            info = xgrammar.TokenizerInfo.from_huggingface(
                fast, vocab_size=self.vocab_size, stop_token_ids=list(self.tokenizer.eos_token_ids)
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def submit(self, constraint: StructuredOutput) -> Future[xgrammar.CompiledGrammar]:
        """The compiled constraint, compiling it in the pool the first time it is asked for."""
        key = (constraint.kind, constraint.spec or "")
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
        return future

    def compile(self, constraint: StructuredOutput) -> xgrammar.CompiledGrammar:
        """`submit`, waiting for it; raises GrammarError with xgrammar's reason."""
        return self.submit(constraint).result()

    def _compile(self, constraint: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._grammar_compiler()
        try:
            if constraint.kind == "json":
                return compiler.compile_json_schema(constraint.spec or "{}", any_whitespace=False)
            if constraint.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if constraint.kind == "regex":
                return compiler.compile_regex(constraint.spec or "")
            if constraint.kind == "choice":
                choices = json.loads(constraint.spec or "[]")
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
            return compiler.compile_grammar(constraint.spec or "")
        except RuntimeError as error:
            raise GrammarError(f"{constraint.describe()} does not compile: {_reason(error)}") from None

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def constraint(
        self,
        compiled: xgrammar.CompiledGrammar,
        reasoning: ReasoningTokens | None,
        prompt_token_ids: list[int],
    ) -> Constraint:
        return Constraint(self.matcher(compiled), reasoning, first_phase(reasoning, prompt_token_ids))

    def bitmask(self, constraints: list[Constraint | None]) -> npt.NDArray[np.int32] | None:
        """int32 [rows, ceil(vocab / 32)]: bit j of word w allows token 32 w + j; unconstrained rows
        (None, or a reply inside its reasoning) allow every token; None where no row is constrained."""
        if not any(c is not None and c.active for c in constraints):
            return None
        mask = np.full((len(constraints), -(-self.vocab_size // 32)), -1, dtype=np.int32)
        for row, constraint in enumerate(constraints):
            if constraint is None or not constraint.active:
                continue
            constraint.matcher.fill_next_token_bitmask(mask, row)  # any CPU array with DLPack, numpy's too
            if constraint.phase is ReasoningPhase.MAY_OPEN and constraint.reasoning is not None:
                start = constraint.reasoning.start
                mask.view(np.uint32)[row, start // 32] |= np.uint32(1 << (start % 32))
        return mask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ReasoningPhase(Enum):
    """Where a reply stands against its reasoning block (sampling_params.ReasoningTokens)."""

    MAY_OPEN = "may open"  # the next token may be `start`, or the constrained reply's first
    INSIDE = "inside"  # unconstrained until `end`
    OUTSIDE = "outside"  # constrained


def first_phase(reasoning: ReasoningTokens | None, prompt_token_ids: list[int]) -> ReasoningPhase:
    """The phase at a reply's first token, from the prompt's last reasoning marker."""
    if reasoning is None:
        return ReasoningPhase.OUTSIDE
    for token in reversed(prompt_token_ids):
        if token == reasoning.end:
            return ReasoningPhase.OUTSIDE
        if token == reasoning.start:
            return ReasoningPhase.INSIDE
    return ReasoningPhase.INSIDE if reasoning.implicit_start else ReasoningPhase.MAY_OPEN


@dataclass
class Constraint:
    """One sequence's structured output: its matcher, held back while the reply reasons."""

    matcher: xgrammar.GrammarMatcher
    reasoning: ReasoningTokens | None
    phase: ReasoningPhase

    @property
    def active(self) -> bool:
        return self.phase is not ReasoningPhase.INSIDE

    def accept(self, token: int) -> None:
        reasoning = self.reasoning
        if self.phase is ReasoningPhase.INSIDE:
            assert reasoning is not None
            if token == reasoning.end:
                self.phase = ReasoningPhase.OUTSIDE
        elif self.phase is ReasoningPhase.MAY_OPEN and reasoning is not None and token == reasoning.start:
            self.phase = ReasoningPhase.INSIDE
        else:
            self.matcher.accept_token(token)
            self.phase = ReasoningPhase.OUTSIDE
