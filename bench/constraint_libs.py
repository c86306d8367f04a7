"""Which structured-generation library to build on: compile and mask times with our
tokenizer (how specd/constraint.py chose llguidance; numbers in docs/benchmarks-log.md).

    python -m bench.constraint_libs [--model default-target]

Measures, for each of llguidance, xgrammar and outlines-core that is importable (only
llguidance is a dependency: `pip install xgrammar outlines-core` for the others): building
the library's view of the tokenizer, compiling one function-call JSON schema, and the
median / max time of a next-token mask while walking a valid answer token by token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench import flags

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ANSWERS = [  # the walk uses whichever spacing the library accepts further
    '{"name":"Ada Lovelace","age":36,"tags":["math","poetry","engines"]}',
    '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}',
]


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def llguidance_walk(tok, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    lltok, setup = _timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher, compile_s = _timed(lambda: llguidance.LLMatcher(lltok, grammar))
    ids = max((tok(a)["input_ids"] for a in ANSWERS), key=matcher.validate_tokens)
    ids = ids[: matcher.validate_tokens(ids)]
    mask = llt.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        times.append(_timed(lambda: llt.fill_next_token_bitmask(matcher, mask))[1])
        matcher.consume_token(t)
    return setup, compile_s, times


def xgrammar_walk(tok, vocab: int):
    import xgrammar as xg

    compiler, setup = _timed(
        lambda: xg.GrammarCompiler(xg.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    )
    compiled, compile_s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xg.GrammarMatcher(compiled)

    def accepted(ids):
        matcher.reset()
        return [t for t in ids if matcher.accept_token(t)]  # stops counting at a refusal

    ids = max((accepted(tok(a)["input_ids"]) for a in ANSWERS), key=len)
    matcher.reset()
    mask = xg.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        times.append(_timed(lambda: matcher.fill_next_token_bitmask(mask))[1])
        matcher.accept_token(t)
    return setup, compile_s, times


def outlines_walk(tok, vocab: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    def build():
        byte_of = {v: k for k, v in bytes_to_unicode().items()}
        table: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i != tok.eos_token_id:
                raw = (
                    bytes(byte_of[c] for c in text)
                    if all(c in byte_of for c in text)
                    else text.encode()
                )
                table.setdefault(raw, []).append(i)
        return Vocabulary(tok.eos_token_id, table)

    vocabulary, setup = _timed(build)
    index, compile_s = _timed(
        lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    )
    guide = Guide(index)
    ids = tok(ANSWERS[0])["input_ids"]
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    times = []
    for t in ids:
        if not guide.accepts_tokens([t]):
            break
        times.append(_timed(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4))[1])
        guide.advance(t)
    return setup, compile_s, times


def main(argv: list[str] | None = None) -> int:
    from specd.models.loader import load_config, load_tokenizer
    from specd.models.resolve import resolve

    p = argparse.ArgumentParser(prog="bench.constraint_libs", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default-target", help=f"its tokenizer's: {flags.MODEL}")
    args = p.parse_args(argv)
    folder = resolve(args.model)
    tok, vocab = load_tokenizer(folder), load_config(folder).vocab_size
    print("| library | tokenizer setup | compile schema | mask median | mask max | tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, walk in [
        ("llguidance", llguidance_walk),
        ("xgrammar", xgrammar_walk),
        ("outlines-core", outlines_walk),
    ]:
        try:
            setup, compile_s, times = walk(tok, vocab)
        except ImportError:
            print(f"| {name} | not installed | | | | |")
            continue
        print(
            f"| {name} | {setup * 1e3:.0f} ms | {compile_s * 1e3:.1f} ms | "
            f"{statistics.median(times) * 1e6:.0f} us | {max(times) * 1e6:.0f} us | {len(times)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
