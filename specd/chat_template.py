"""A chat template given in place of the model's (vLLM's and SGLang's `--chat-template`,
llama-server's `--chat-template-file`): a file, or the template's text itself."""

from __future__ import annotations

from pathlib import Path

import jinja2


def read_chat_template(setting: str) -> str:
    """The template `setting` names (a file's text, or `setting` where it is a template),
    its syntax checked; ValueError says why not, as vLLM's does for a path not found."""
    try:
        is_file = Path(setting).is_file()
    except OSError:  # a template's text too long to be a path
        is_file = False
    if is_file:
        text = Path(setting).read_text()
    elif "{" in setting:  # a template's text, as vLLM takes it on one line
        text = setting
    else:
        raise ValueError(f"chat_template: no file {setting!r}, and it is not a template's text")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: line {exc.lineno}: {exc.message}") from None
    return text
