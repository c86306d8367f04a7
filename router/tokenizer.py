"""The router's tokenizer, without torch or transformers in its process: the model's
`tokenizer.json` through `tokenizers`, and its own chat template rendered by jinja2 in a
sandbox set up as transformers sets up its own (trim_blocks, lstrip_blocks, loop controls,
a `tojson` that leaves non-ASCII alone, `raise_exception`, `strftime_now`), with the
special tokens as variables. It answers the calls the router makes of a Hugging Face
tokenizer: `len`, a call on text, `decode` and `apply_chat_template` (tests check them
token for token against transformers on every workload conversation)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# the special tokens a Hugging Face tokenizer hands its chat template by name
SPECIAL = tuple(f"{x}_token" for x in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
# what transformers' `clean_up_tokenization` undoes after decoding, where a config asks
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")]
_CLEAN_UP += [(" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]
# continue_final_message: appended to the last message's text before rendering, and the
# rendered chat cut where it last stands; transformers' marker, so that a template that
# writes the message twice leaves the same text as there
_CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _content(token) -> str | None:
    """A special token as a config writes it: a string, or an AddedToken's dict."""
    return token.get("content") if isinstance(token, dict) else token


def _template_source(folder: Path, config: dict) -> str | None:
    """The folder's chat template: `chat_template.jinja` (transformers 5 writes it), else the
    config's (a string, or named templates of which `default` is the one used)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


class ChatTokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.name_or_path = str(folder)  # where it was read from, as transformers names it
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (the router reads only that)")
        self._tok = Tokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special = {k: v for k in SPECIAL if (v := _content(config.get(k))) is not None}
        # skipped when decoding like those tokenizer.json marks special, as transformers does
        named = [self._tok.token_to_id(t) for t in self.special.values()]
        self._special_ids = {i for i in named if i is not None}
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        # the settings it was made with, as transformers keeps them (vLLM's /tokenizer_info)
        added = self._tok.get_added_tokens_decoder()
        self.init_kwargs = {**config, "added_tokens_decoder": added}
        self.chat_template = _template_source(folder, config)

    @property
    def chat_template(self) -> str | None:
        """The chat template's text, as transformers' tokenizers name it; set, it renders
        every chat from then on (a template given in place of the model's)."""
        return self.init_kwargs["chat_template"]

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        self._template = None if source is None else _environment().from_string(source)
        self.init_kwargs["chat_template"] = source

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __call__(
        self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False
    ) -> dict[str, list[int]]:
        """`split_special_tokens`: a special token's text in `text` is text, not the token
        (transformers' argument; the router's event loop is its one caller at a time)."""
        self._tok.encode_special_tokens = split_special_tokens
        try:
            return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}
        finally:
            self._tok.encode_special_tokens = False

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        **kwargs,
    ):
        """The conversation rendered by the model's template (ids: its text tokenized
        without adding special tokens, as transformers does); `tools`: JSON schemas of the
        functions the model may call, as the template's `tools`; `continue_final_message`:
        the text ends where the last message's does (the template's end of its turn cut
        off), so that the output continues it; `kwargs`: more template variables."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        if continue_final_message and messages:
            last = {**messages[-1], "content": (messages[-1].get("content") or "") + _CONTINUE}
            messages = [*messages[:-1], last]
        text = self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**self.special, **kwargs},
        )
        if continue_final_message:
            text = _cut_at_continuation(text)
        return self(text)["input_ids"] if tokenize else text


def _cut_at_continuation(text: str) -> str:
    """The rendered chat up to where the last message's text ended (its marker's last
    occurrence; where the template stripped the text, with the space before it stripped
    too), as transformers cuts it."""
    at = text.rfind(_CONTINUE.strip())
    if at < 0:
        raise ValueError("continue_final_message: the template does not render the last message")
    return text[:at] if text.startswith(_CONTINUE, at) else text[:at].rstrip()
