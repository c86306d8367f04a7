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


# a repository's name and a file's start, by model family (llama.cpp's repo-level pattern)
REPO_MARKERS = (
    ("<|repo_name|>", "<|file_sep|>"),  # Qwen2.5-Coder
    ("<reponame>", "<file_sep>"),  # StarCoder2
)
SNIPPET = "\n\n--- snippet ---\n\n"  # an extra chunk's start where there are no markers


def repo_markers_of(tokenizer) -> tuple[str, str] | None:
    """The tokenizer's repository-name and file-separator tokens, if it has both."""
    for markers in REPO_MARKERS:
        ids = [tokenizer(m, add_special_tokens=False)["input_ids"] for m in markers]
        if all(len(i) == 1 for i in ids) and ids[0] != ids[1]:
            return markers
    return None


def infill_ids(
    tokenizer,
    markers: tuple[str, str, str],
    repo: tuple[str, str] | None,
    prefix: str,
    suffix: str,
    extra: list[tuple[str, str]],
    prompt: str,
    extra_room: int,
    batch: int,
) -> list[int]:
    """llama-server's /infill prompt: the extra chunks ((filename, text), as files of the
    repository where the model has its markers), then prefix, suffix and middle markers
    around the input, the `prompt` after the middle one. The prefix keeps its last
    3/4 * batch tokens, the suffix its first batch/4 less the prompt's and 2, the extra
    context its last `extra_room`. The input's text is text (a special token's spelling
    in the code is not the token); the prompt's may name special tokens."""

    def text(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def token(marker: str) -> list[int]:
        return tokenizer(marker, add_special_tokens=False)["input_ids"]

    before, after, middle = (token(m) for m in markers)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    context: list[int] = token(repo[0]) + text("myproject\n") if repo else []
    for filename, chunk in extra:
        context += token(repo[1]) + text(filename + "\n") if repo else text(SNIPPET)
        context += text(chunk)
    if repo:
        context += token(repo[1]) + text("filename\n")
    head = text(prefix)[-(3 * (batch // 4)) :] if 3 * (batch // 4) else []
    tail = text(suffix)[: max(0, batch // 4 - (2 + len(prompt_ids)))]
    kept = context[len(context) - min(max(0, extra_room), len(context)) :]
    return kept + before + head + prompt_ids + after + tail + middle
