"""The `kiln` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kiln.errors import KilnError


def _pull(args: argparse.Namespace) -> int:
    from kiln.frontend.pull import pull

    path = pull(args.model, progress=lambda line: print(line, file=sys.stderr))
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kiln.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop or [],
    )
    llm = LLM(args.model, max_model_len=args.max_model_len)
    tokenizer = llm.get_tokenizer()
    prompt: str | list[int] = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
    engine = llm.engine
    engine.add_request("generate", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.outputs[0].delta_text, end="", flush=True)
    print()
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from kiln.frontend.capture import capture_weights
    from kiln.frontend.load import load_model
    from kiln.ir import print_graph

    source = load_model(args.model)
    config = source.config
    print(f"model: {source.name} ({config.architecture}) from {source.path}")
    print(
        f"layers {config.num_hidden_layers}, hidden {config.hidden_size}, heads {config.num_attention_heads}"
        f"/{config.num_key_value_heads} kv, head_dim {config.head_dim}, vocab {config.vocab_size}, "
        f"tied {config.tie_word_embeddings}, sliding_window {config.sliding_window}"
    )
    if args.ir:
        captured = capture_weights(config, source.float_weights())
        print(print_graph(captured.graph), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Compile LLMs ahead of time; run them.")
    commands = parser.add_subparsers(dest="command", required=True)

    pull = commands.add_parser("pull", help="fetch a known model into the cache ($KILN_HOME)")
    pull.add_argument("model", help="a known model name, e.g. smollm2-135m-instruct")
    pull.set_defaults(run=_pull)

    generate = commands.add_parser(
        "generate", help="generate from one prompt on the engine (reference backend)"
    )
    generate.add_argument("model", help="a known model name, a .gguf file or a HF model directory")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--max-model-len", type=int, default=None)
    generate.set_defaults(run=_generate)

    inspect = commands.add_parser("inspect", help="describe a model; --ir prints its captured IR")
    inspect.add_argument("model")
    inspect.add_argument("--ir", action="store_true")
    inspect.set_defaults(run=_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KilnError as error:
        print(f"kiln: error: {error.one_line()}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"kiln: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
