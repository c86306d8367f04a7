"""A plain greedy generation with the engine's forward (used by `specd up` for now)."""

from __future__ import annotations

from specd.models.loader import eos_token_ids, load_config, load_model, load_tokenizer, resolve
from specd.models.paged_kv import PagedKV, SeqInput


def chat_ids(tokenizer, prompt: str) -> list[int]:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def generate_once(model_spec: str, prompt: str, max_new_tokens: int) -> str:
    folder = resolve(model_spec)
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(folder, load_config(folder))
    model = load_model(folder)
    ids = chat_ids(tokenizer, prompt)
    kv = PagedKV.for_model(model, num_blocks=-(-(len(ids) + max_new_tokens) // 16))
    kv.allocator.allocate(0)
    logits = model.forward(kv, [SeqInput(0, ids)])
    out: list[int] = []
    while len(out) < max_new_tokens:
        out.append(int(logits[-1].argmax()))
        if out[-1] in eos:
            break
        logits = model.forward(kv, [SeqInput(0, [out[-1]])])
    return tokenizer.decode(out, skip_special_tokens=True)
