"""Run llama.cpp's own `convert_hf_to_gguf.py`, replacing only its pre-tokenizer lookup.

    python scripts/llama_cpp_convert.py LLAMA_CPP_SOURCE PRE_TOKENIZER HF_DIR [converter flags...]

LLAMA_CPP_SOURCE holds convert_hf_to_gguf.py, conversion/ and gguf-py/ (scripts/llama_cpp_source.sh).
The converter names a BPE vocabulary's pre-tokenizer by hashing how it splits a sample text, and refuses
a vocabulary it does not know. Synthetic vocabularies (scripts/make_shaped_gguf.py's Llama 3 one, the
tests' tiny byte-level ones) hash like no real model, so an unrecognised hash becomes PRE_TOKENIZER,
and a recognised one must be PRE_TOKENIZER. Everything else (vocabulary, tensors, their names, order,
permutations and types, metadata) is the converter's own doing, with llama.cpp's own gguf-py.
"""

import logging
import sys

source, expected = sys.argv[1], sys.argv[2]
sys.argv = [source + "/convert_hf_to_gguf.py", *sys.argv[3:]]
sys.path[:0] = [source, source + "/gguf-py"]

import gguf  # noqa: E402
from conversion.base import TextModel  # noqa: E402

lookup = TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):  # type: ignore[no-untyped-def]
    try:
        name = lookup(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("llama_cpp_convert").warning("synthetic vocabulary: pre-tokenizer %r", expected)
        return expected
    if name != expected:
        raise SystemExit(f"the tokenizer hashes as pre-tokenizer {name!r}, expected {expected!r}")
    logging.getLogger("llama_cpp_convert").info("tokenizer recognised as %r", name)
    return name


TextModel.get_vocab_base_pre = get_vocab_base_pre
if not gguf.__file__.startswith(source):
    raise SystemExit(f"imported gguf from {gguf.__file__}, not from llama.cpp's {source}/gguf-py")

import convert_hf_to_gguf  # noqa: E402

convert_hf_to_gguf.main()
