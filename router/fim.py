"""Fill in the middle: a completion's `suffix` (the OpenAI API's field) with a model that
has FIM tokens, as SGLang's completion templates and llama.cpp's /infill build it: the
prompt is `<prefix marker>{prompt}<suffix marker>{suffix}<middle marker>` and the output
is the middle (prefix-suffix-middle order, the order these models were trained on). The
model ends the middle with its end-of-text token (or a FIM marker after it: the verifier
stops at those too, as llama.cpp does)."""

from __future__ import annotations

# (prefix, suffix, middle) markers by model family, each found only where the tokenizer
# has all three as single tokens
MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, CodeQwen 1.5
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def markers_of(tokenizer) -> tuple[str, str, str] | None:
    """The tokenizer's FIM markers, if it has them (each one token)."""
    for markers in MARKERS:
        ids = [tokenizer(m, add_special_tokens=False)["input_ids"] for m in markers]
        # each one token, and three of them (not an unknown token's stand-in thrice)
        if all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 3:
            return markers
    return None


def infill_prompt(prefix: str, suffix: str, markers: tuple[str, str, str]) -> str:
    before, after, middle = markers
    return f"{before}{prefix}{after}{suffix}{middle}"
