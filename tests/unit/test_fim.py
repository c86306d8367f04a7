"""Fill in the middle (router/fim.py): the default target's FIM markers found and a
completion's suffix laid out around them as single tokens; a tokenizer without them has
none; the converted folder stops at the markers a model writes past the middle, as
llama.cpp does."""

import pytest

from router.fim import infill_ids, infill_prompt, markers_of, repo_markers_of
from router.tokenizer import ChatTokenizer
from specd.models.catalog import DEFAULT_TARGET
from specd.models.loader import eos_token_ids, load_config
from tests.cluster import char_tokenizer
from tests.conftest import real_model_or_skip


def test_a_tokenizer_without_fim_tokens_has_no_markers():
    assert markers_of(char_tokenizer()) is None


@pytest.mark.real
def test_the_default_targets_suffix_prompt_and_where_its_middle_ends():
    folder = real_model_or_skip(DEFAULT_TARGET)
    tok = ChatTokenizer(folder)
    markers = markers_of(tok)
    assert markers == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    ids = tok(infill_prompt(prefix, suffix, markers))["input_ids"]
    pre, suf, mid = (tok(m)["input_ids"][0] for m in markers)
    # prefix-suffix-middle, each marker one token, the texts between them tokenized alone
    assert ids == [pre, *tok(prefix)["input_ids"], suf, *tok(suffix)["input_ids"], mid]
    ends = eos_token_ids(folder, load_config(folder))
    for text in ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"):
        assert tok(text)["input_ids"][0] in ends, text
    assert not {pre, suf, mid} & ends


@pytest.mark.real
def test_the_default_targets_infill_prompt_is_llama_servers():
    """/infill's prompt as llama-server lays it out for the repo-level pattern: the extra
    files, then prefix (with the cursor's line) and suffix; a marker's spelling in the
    code stays text; the prefix keeps its last 3/4 of the batch."""
    tok = ChatTokenizer(real_model_or_skip(DEFAULT_TARGET))
    markers, repo = markers_of(tok), repo_markers_of(tok)
    assert repo == ("<|repo_name|>", "<|file_sep|>")

    def ids(text: str) -> list[int]:
        return tok(text)["input_ids"]

    pre, suf, mid, rep, sep = (ids(m)[0] for m in (*markers, *repo))
    extra = [("a.py", "x = '<|fim_prefix|>'\n")]
    got = infill_ids(tok, markers, repo, "def f():\n", "\nf()\n", extra, "    ", 4096, 2048)
    chunk = tok("x = '<|fim_prefix|>'\n", split_special_tokens=True)["input_ids"]
    assert pre not in chunk  # the marker's spelling is text there
    want = [rep, *ids("myproject\n"), sep, *ids("a.py\n"), *chunk, sep, *ids("filename\n")]
    want += [pre, *ids("def f():\n"), *ids("    "), suf, *ids("\nf()\n"), mid]
    assert got == want
    long = infill_ids(tok, markers, repo, "word " * 3000, "", [], "", 0, 2048)
    assert long[0] == pre and len(long) == 1 + 1536 + 1 + 1
